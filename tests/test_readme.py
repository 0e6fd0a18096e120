"""Docs that run: the README's commands and examples."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "`bash scripts/dev.sh main`" in readme and "`bash scripts/dev.sh test`" in readme
    assert "bash scripts/dev.sh test" in (ROOT / ".ci" / "run").read_text()


OWN_TESTS = {"train_gpt.py": "tests/test_train_gpt.py"}  # examples that a test file of their own runs
EXPECTED = {"apply_recipe.py": "re-fusions: 3", "convert_hf_style.py": "converted: 9 modules"}  # what an example prints, where it is not two recipes' builds


def test_examples_run():
    examples = []
    for example in sorted((ROOT / "examples").glob("*.py")):
        if example.name in OWN_TESTS:
            assert (ROOT / OWN_TESTS[example.name]).exists()
        else:
            examples.append(example)

    def run(example):
        return subprocess.run([sys.executable, str(example)], capture_output=True, text=True, cwd=ROOT, timeout=300)

    # two at a time: each spends most of its few seconds importing torch on one core
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(run, examples))
    for example, out in zip(examples, outs):
        assert out.returncode == 0, f"{example.name} failed:\n{out.stderr[-3000:]}"
        assert EXPECTED.get(example.name, "re-fusions: 2") in out.stdout, f"{example.name}: {out.stdout[-500:]}"


def test_main_job_runs_the_recipe_schedule(tmp_path):
    rows_path, out_dir = tmp_path / "rows.json", tmp_path / "report"
    out = subprocess.run(
        [sys.executable, "-m", "te_fuser", "--steps", "3", "--hidden", "64", "--ffn", "128", "--json", str(rows_path),
         "--out", str(out_dir)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(rows_path.read_text())
    assert [r["phase"] for r in rows] == ["bf16", "delayed", "current", "block", "mxfp8", "bf16"]
    assert all(r["refusions"] == 1 for r in rows)
    assert all(r["torch_bf16_loss_last"] > 0 for r in rows)
    assert "torch bf16" in out.stdout and "fusion plan of the delayed phase" in out.stdout
    assert "fusion plan of the mxfp8 phase" in out.stdout
    report = json.loads((out_dir / "report.json").read_text())
    assert len(report["losses"]["te_fuser"]) == len(report["losses"]["torch bf16"]) == 18
    assert {"device", "torch", "date"} <= set(report)
    svg = (out_dir / "loss.svg").read_text()
    assert svg.startswith("<svg") and "MLP 64-&gt;128-&gt;64" in svg and report["torch"] in svg


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--batch", "8", "--steps", "1"], "--batch 8 --hidden 256 --ffn 512: the mxfp8 phase cannot run"),
    (["--hidden", "abc"], "argument --hidden: must be a positive integer, got 'abc'"),
])
def test_main_job_argument_errors_are_one_line(args, message):
    out = subprocess.run([sys.executable, "-m", "te_fuser", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert message in lines[-1] and not any("Traceback" in line for line in lines)
