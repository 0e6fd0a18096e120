"""The cuda backend's contract, checked without a GPU: it imports cleanly and
compiles nothing, it provides its kernels (their signatures: test_kernel_contract.py), asking for it on
CPU tensors fails with a clear reason, and the shipped ``auto`` table is valid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_fuser import backend
from te_fuser.kernels import cuda
from te_fuser.kernels.operand import ScaledOperand

REPO = Path(__file__).resolve().parent.parent
PROVIDED = ("quantize_tensorwise", "quantize_tensorwise_column_sums", "quantize_current", "quantize_current_column_sums",
            "quantize_rowwise", "quantize_mxfp8", "gemm", "delayed_scale_update", "delayed_scale_update_many",
            "attention_forward", "attention_backward", "attention_forward_fp8", "layer_norm", "layer_norm_grad", "rotary",
            "dact_dbias")


def test_import_compiles_nothing_and_needs_no_gpu():
    code = (
        "import sys, torch; import te_fuser.kernels.cuda as c; "
        "assert not c.is_loaded(); "
        "assert not any('te_fuser_cuda_kernels' in m for m in sys.modules); "
        "assert 'triton' not in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_it_provides_its_kernels():
    """(Their signatures: tests/test_kernel_contract.py, for every backend.)"""
    assert all(callable(getattr(cuda, kernel)) for kernel in PROVIDED)


def test_kernels_cublaslt_cannot_do_are_left_to_the_fallback():
    for kernel in backend.KERNELS:
        assert hasattr(cuda, kernel) == (kernel in PROVIDED), kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_tensors_get_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="cuda backend needs CUDA tensors, got a cpu tensor"):
        backend.resolve("quantize_current", "cpu", backend="cuda")
    with pytest.raises(RuntimeError, match="needs x on a CUDA device"):
        cuda.quantize_current(torch.ones(4, 4), torch.float8_e4m3fn)
    op = ScaledOperand(torch.ones(16, 16).to(torch.float8_e4m3fn), torch.tensor(1.0), "tensor")
    with pytest.raises(RuntimeError, match="needs a on a CUDA device"):
        cuda.gemm(op, op)
    assert cuda.unavailable_reason() is not None
    with pytest.raises(RuntimeError, match="te_fuser.kernels.cuda cannot run: .*") as err:
        cuda.load_extension()
    assert cuda.unavailable_reason() in str(err.value)
    assert not cuda.is_loaded()


def test_auto_backend_on_cpu_is_reference():
    choice = backend.resolve("gemm", "cpu", backend="auto")
    assert choice.backend == "reference"


def _q(scaling, rows, k, fp8=torch.float8_e4m3fn):
    from te_fuser.kernels.operand import scale_grid_shape

    return ScaledOperand(torch.zeros(rows, k).to(fp8), torch.ones(scale_grid_shape(scaling, rows, k)), scaling)


@pytest.mark.parametrize(
    "a,b,expected",
    [
        (("mx_32", 64, 128), ("mx_32", 64, 128), "no mx_32 x mx_32"),
        (("tensor", 64, 40), ("tensor", 64, 40), "multiples of 16"),
        (("tensor", 64, 64, torch.float8_e5m2), ("tensor", 64, 64, torch.float8_e5m2), "two E5M2"),
        (("block_1x128", 64, 384), ("block_128x128", 64, 384), "K % 512"),
        (("block_1x128", 66, 512), ("block_1x128", 64, 512), "M % 4"),
        (("block_1x128", 64, 320), ("block_1x128", 64, 320), "K % 128"),
        (("row", 64, 64), ("block_128x128", 64, 64), "no row x block_128x128"),
        (("tensor", 64, 64), ("tensor", 64, 64), "not on a CUDA device"),
    ],
)
def test_gemm_unsupported_reasons(a, b, expected):
    reason = cuda.gemm_unsupported_reason(_q(*a), _q(*b))
    assert reason is not None and expected in reason, reason


def test_auto_table_is_valid():
    table = json.loads((REPO / "kernels" / "auto_table.json").read_text())
    assert set(table) == set(backend.KERNELS)
    for kernel, entry in table.items():
        if isinstance(entry, dict):  # split by size
            assert set(entry) == {"small", "large", "min_elements"}, (kernel, entry)
            assert isinstance(entry["min_elements"], int) and entry["min_elements"] > 0, (kernel, entry)
            names = [entry["small"], entry["large"]]
        else:
            names = [entry]
        for name in names:
            assert name in ("reference", "triton", "cuda"), (kernel, name)
            if name == "cuda":
                assert hasattr(cuda, kernel), f"auto table picks cuda for {kernel}, which it does not provide"


def test_auto_split_by_size_sends_each_call_by_its_element_count(monkeypatch):
    from te_fuser.kernels import reference, triton as tk

    calls = []
    monkeypatch.setattr(reference, "quantize_rowwise_reference", lambda x, *a, **k: calls.append(("small", x.numel())))
    monkeypatch.setattr(tk, "quantize_rowwise", lambda x, *a, **k: calls.append(("large", x.numel())))
    monkeypatch.setattr(backend, "_resolved", {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # triton runs there
    choice = backend._by_size("quantize_rowwise", device,
                              {"small": "reference", "large": "triton", "min_elements": 64})
    choice.fn(torch.zeros(7, 9), torch.float8_e4m3fn)
    choice.fn(torch.zeros(8, 8), torch.float8_e4m3fn)
    choice.fn(torch.zeros(4, 32), torch.float8_e4m3fn)
    assert calls == [("small", 63), ("large", 64), ("large", 128)]
    assert choice.backend == "triton" and "64 elements or more go to triton" in choice.note


def test_auto_split_by_size_keeps_the_lean_entry_of_the_kernel_the_size_picks(monkeypatch):
    from te_fuser.kernels import reference, triton as tk

    def small(x, *a, **k):
        return "small"

    small.lean = lambda x, *a, **k: ("small lean", x.numel())
    monkeypatch.setattr(reference, "quantize_rowwise_reference", small)
    monkeypatch.setattr(tk, "quantize_rowwise", lambda x, *a, **k: "large")  # no lean entry
    monkeypatch.setattr(backend, "_resolved", {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice = backend._by_size("quantize_rowwise", device,
                              {"small": "reference", "large": "triton", "min_elements": 64})
    assert choice.fn.lean(torch.zeros(7, 9)) == ("small lean", 63)
    assert choice.fn.lean(torch.zeros(8, 8)) is None  # the large kernel has none: its checked call decides
    assert choice.fn(torch.zeros(8, 8)) == "large"


def test_per_call_fallback_keeps_the_kernels_lean_entries():
    def primary(a, b, **kw):
        return "primary"

    primary.tensorwise = lambda *args: "lean"
    dispatch = backend._per_call_fallback(primary, lambda a, b: None, lambda *a, **k: "fallback", lean_from=primary)
    assert dispatch.tensorwise() == "lean"
    assert not hasattr(dispatch, "prepare")


def test_tune_auto_script_runs_its_help():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tune_auto.py"), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "auto_table.json" in result.stdout, result.stderr


def test_an_auto_entry_set_for_the_process_is_the_gpus_choice_and_gives_back_the_old_one():
    """``set_auto_entry``: a benchmark's A/B of one kernel; bad kernels and entries are
    named, and a rejected entry changes nothing."""
    from te_fuser import backend

    gpu = torch.device("cuda")
    before = backend._auto_entry("layer_norm_grad", gpu)
    split = {"small": "triton", "large": "cuda", "min_elements": 7}
    try:
        assert backend.set_auto_entry("layer_norm_grad", split) == before
        assert backend._auto_entry("layer_norm_grad", gpu) == split
        assert backend._auto_entry("layer_norm_grad", torch.device("cpu")) == "reference"
        with pytest.raises(ValueError, match="set_auto_entry\\(kernel=...\\)"):
            backend.set_auto_entry("nope", "triton")
        with pytest.raises(ValueError, match="set_auto_entry\\(entry=...\\)"):
            backend.set_auto_entry("layer_norm_grad", {"small": "triton", "large": "cuda", "min_elements": 0})
        assert backend._auto_entry("layer_norm_grad", gpu) == split
    finally:
        backend.set_auto_entry("layer_norm_grad", before)
    assert backend._auto_entry("layer_norm_grad", gpu) == before


def test_per_call_fallback_sends_unsupported_operands_to_the_next_backend():
    from te_fuser import backend

    calls = []
    dispatch = backend._per_call_fallback(
        lambda a, b, **kw: calls.append("primary"),
        lambda a, b: None if a == "ok" else "no such path",
        lambda a, b, **kw: calls.append("fallback"),
    )
    dispatch("ok", 1, out_dtype=None)
    dispatch("mx", 1)
    assert calls == ["primary", "fallback"]
    assert backend._fallback("gemm", "cuda", torch.device("cpu")).backend in ("triton", "reference")
