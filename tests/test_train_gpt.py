"""The GPT yardstick: its corpus, the te model against its torch twin, and the
training script (examples/train_gpt.py) at the smoke size on the CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import sys

import pytest
import torch

import te_fuser as te
from te_fuser.models import (
    GPT, GPTConfig, TorchGPT, copy_weights, load_stdlib_corpus, parameter_name_map, rename_state_dict,
    sample_windows, split_corpus, stdlib_source_files,
)
from tolerances import assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEDULE = "bf16:4,delayed:4,bf16:4"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train_gpt = _load_script()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One short run of both arms through bf16 -> delayed scaling -> bf16."""
    out = tmp_path_factory.mktemp("gpt")
    argv = ["--size", "smoke", "--schedule", SCHEDULE, "--arms", "te,torch", "--corpus-bytes", "300000",
            "--eval-batches", "2", "--log-every", "4", "--json", str(out / "run.json"), "--png", str(out / "run.png")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = train_gpt.main(argv)
    return report, json.loads((out / "run.json").read_text()), stdout.getvalue(), out


def test_smoke_run_trains_both_arms(smoke_run):
    report, _, _, _ = smoke_run
    assert set(report["arms"]) == {"te", "torch"}
    for name, arm in report["arms"].items():
        losses = arm["losses"]
        assert len(losses) == 12 and all(math.isfinite(v) for v in losses), f"{name}: {losses}"
        assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, f"{name}: the loss did not fall: {losses}"
        assert [p["phase"] for p in arm["phases"]] == ["bf16", "delayed", "bf16"]
        for phase in arm["phases"]:
            assert math.isfinite(phase["val_bpb"]) and math.isfinite(phase["val_bpb_bf16"]), f"{name}: {phase}"
    te_phases = report["arms"]["te"]["phases"]
    assert te_phases[1]["recipe"] == str(te.recipe.DelayedScaling())
    assert all(p["refusions"] > 0 for p in te_phases)  # every phase switches recipe (and evaluates)


def test_smoke_run_writes_the_json(smoke_run):
    report, written, stdout, out = smoke_run
    assert written == json.loads(json.dumps(report))
    assert {"config", "device", "versions", "date", "corpus", "arms", "skipped"} <= set(written)
    assert {"torch", "triton", "python"} <= set(written["versions"])
    assert written["config"]["n_layer"] == GPTConfig.smoke().n_layer
    assert [p["name"] for p in written["config"]["phases"]] == ["bf16", "delayed", "bf16"]
    for arm in written["arms"].values():
        assert {"losses", "phases", "evals", "tokens_per_s"} <= set(arm)
        assert arm["tokens_per_s"] > 0
        assert {"val_bpb", "val_bpb_bf16", "tokens_per_s", "first_step_ms", "steps"} <= set(arm["phases"][0])
    png_lines = [line for line in stdout.splitlines() if line.startswith("PNG ")]
    assert len(png_lines) == 1, stdout
    assert (out / "run.png").exists() == png_lines[0].startswith("PNG written")


def test_te_in_bf16_matches_the_torch_twin_at_step_0():
    config = GPTConfig.smoke()
    torch.manual_seed(0)
    te_model = GPT(config)
    twin = TorchGPT(config)
    copy_weights(te_model, twin)
    data = load_stdlib_corpus(200_000)
    windows = sample_windows(data, config.batch_size, config.seq_len, torch.Generator().manual_seed(0))
    te_loss = train_gpt.loss_bits_per_byte(te_model, windows, None, torch.device("cpu"))
    torch_loss = train_gpt.loss_bits_per_byte(twin, windows, None, torch.device("cpu"))
    assert_close(te_loss.detach(), torch_loss.detach(), torch.bfloat16, "GPT smoke, bf16, step 0")


def test_state_dicts_convert_both_ways():
    config = GPTConfig.smoke()
    torch.manual_seed(0)
    te_model, twin = GPT(config), TorchGPT(config)
    names = parameter_name_map(te_model, twin)
    assert len(names) == len(list(te_model.parameters())) == len(list(twin.parameters()))
    twin.load_state_dict(rename_state_dict(te_model.state_dict(), names))
    back = GPT(config)
    missing, unexpected = back.load_state_dict(rename_state_dict(twin.state_dict(), {v: k for k, v in names.items()}),
                                               strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    for (name, p), q in zip(te_model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), name


def test_corpus_is_the_stdlib_in_sorted_order():
    files = stdlib_source_files()
    root = os.path.dirname(os.__file__)
    rel = [os.path.relpath(f, root) for f in files]
    assert rel == sorted(rel) and all(f.endswith(".py") for f in rel)
    assert not any(part in ("site-packages", "test", "tests") for f in rel for part in f.split(os.sep))
    data = load_stdlib_corpus(100_000)
    assert len(data) == 100_000 and torch.equal(data, load_stdlib_corpus(100_000))
    with open(files[0], "rb") as f:
        head = f.read(100)
    assert bytes(data[: len(head)].tolist()) == head
    train, val = split_corpus(data)
    assert len(val) == 5_000 and torch.equal(torch.cat([train, val]), data)
    a = sample_windows(train, 3, 16, torch.Generator().manual_seed(1))
    b = sample_windows(train, 3, 16, torch.Generator().manual_seed(1))
    assert a.shape == (3, 17) and a.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: must be a positive integer"),
        (["--schedule", "bf16,fp4"], "unknown phase 'fp4'"),
        (["--schedule", "delayed:ten"], "the step count of 'delayed:ten' must be a positive integer"),
        (["--seq-len", "4096", "--corpus-bytes", "10000"], "does not fit the validation split"),
        (["--arms", "te,jax"], "argument --arms: must be distinct names"),
        (["--lr", "-1"], "argument --lr: must be a positive number"),
    ],
)
def test_argument_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors
