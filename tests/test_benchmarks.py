"""The re-fusion benchmark runs on CPU (quick mode) and reports the published figures."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_refusion_quick_runs_and_reports(tmp_path):
    out = tmp_path / "refusion.json"
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_refusion.py", "--quick", "--no-csv", "--device", "cpu",
         "--json", str(out), "--plot", str(tmp_path / "refusion.png")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.perf_counter() - t0 < 60
    figures = json.loads(out.read_text())
    for key in ("hot_path_us_same_object", "hot_path_us_equal_object", "warm_switch_us"):
        assert set(figures[key]) == {"2", "8", "32", "128"}, key
        assert all(v >= 0 for v in figures[key].values())
    phases = figures["warm_switch_phases_us"]["8"]
    assert {"key", "quantizers", "fusion", "validation", "publish", "total"} <= set(phases)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is a full benchmark: run_gpu.sh handoff")
def test_bench_handoff_imports_and_asks_for_a_gpu_on_cpu():
    run = subprocess.run([sys.executable, "benchmarks/bench_handoff.py"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs a GPU" in run.stdout
