"""The two FP8 encodings of the Triton kernels and the switch between them,
checked without a GPU.

Compiled kernels on a GPU write FP8 through the hardware conversion
(``fp8_bytes_hw``: inline PTX); the interpreter, and a GPU with
``TE_FUSER_EXACT_FP8=1``, take the exact integer encoding. Here: the launchers pass
the exact encoding for CPU tensors and never reach the hardware one; the choice
for CUDA devices (made without a GPU); the environment variable, read at import;
and the PTX's byte logic, run by a small emulator of its instructions against
torch's casts for every FP8 value, the ties, saturation, NaN, inf and zeros,
whatever NaN pattern and zero sign the conversion instruction itself gives.
``benchmarks/check_gpu_defects.py`` checks the compiled kernels on a GPU, bit for
bit, under both encodings.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from te_fuser.kernels.triton import _common, cast

triton_gemm = importlib.import_module("te_fuser.kernels.triton.gemm")  # the module (the package's `gemm` is the kernel)

REPO = Path(__file__).resolve().parent.parent
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CUDA = types.SimpleNamespace(device=torch.device("cuda", 0))  # all hw_fp8 reads of a tensor


# ----------------------------------------------------------------- the switch


def test_cpu_tensors_take_the_exact_encoding():
    assert _common.hw_fp8(torch.empty(2)) is False


def test_cuda_devices_take_the_hardware_encoding_unless_exact(monkeypatch):
    monkeypatch.setattr(_common, "_has_fp8_conversion", lambda index: True)
    monkeypatch.setattr(_common, "_INTERPRETER", False)
    monkeypatch.setattr(_common, "EXACT_FP8", False)
    assert _common.hw_fp8(CUDA) is True
    monkeypatch.setattr(_common, "EXACT_FP8", True)
    assert _common.hw_fp8(CUDA) is False
    monkeypatch.setattr(_common, "EXACT_FP8", False)
    monkeypatch.setattr(_common, "_INTERPRETER", True)  # the interpreter runs CUDA tensors too
    assert _common.hw_fp8(CUDA) is False
    monkeypatch.setattr(_common, "_INTERPRETER", False)
    monkeypatch.setattr(_common, "_has_fp8_conversion", lambda index: False)  # before sm_89
    assert _common.hw_fp8(CUDA) is False


def _import_common(value: str | None) -> subprocess.CompletedProcess:
    code = ("import types, torch; from te_fuser.kernels.triton import _common as c; "
            "print(c.EXACT_FP8, c.hw_fp8(types.SimpleNamespace(device=torch.device('cuda', 0))) if c.EXACT_FP8 "
            "else '-')")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TE_FUSER_EXACT_FP8")}
    if value is not None:
        env["TE_FUSER_EXACT_FP8"] = value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=False,
                          timeout=120)


def test_exact_fp8_environment_variable_is_read_at_import():
    """TE_FUSER_EXACT_FP8=1 makes even compiled kernels on a GPU take the exact
    encoding (decided without touching a GPU); unset or 0, they do not."""
    forced = _import_common("1")
    assert forced.returncode == 0 and forced.stdout.split() == ["True", "False"], forced.stderr[-2000:]
    for value in (None, "0"):
        default = _import_common(value)
        assert default.returncode == 0 and default.stdout.split() == ["False", "-"], default.stderr[-2000:]
    bad = _import_common("maybe")
    assert bad.returncode != 0 and "TE_FUSER_EXACT_FP8" in bad.stderr


class _HardwareEncodingReached(RuntimeError):
    pass


def _spy(calls: list):
    def fp8_bytes_hw_spy(v, OUT_DTYPE):
        calls.append(OUT_DTYPE)
        raise _HardwareEncodingReached("the hardware FP8 encoding was reached")
    return fp8_bytes_hw_spy


def _every_fp8_writer():
    """One small call of each launcher that writes FP8 (both layouts of the bytes)."""
    gen = torch.Generator().manual_seed(3)
    x = (-0.5 + torch.randn(40, 96, generator=gen)).bfloat16()
    scale = torch.tensor(3.0)
    a = ScaledOperand(torch.randn(40, 64, generator=gen).to(E4M3), torch.tensor(0.5), "tensor")
    b = ScaledOperand(torch.randn(32, 64, generator=gen).to(E4M3), torch.tensor(0.25), "tensor")
    return {
        "quantize_tensorwise": lambda: tk.quantize_tensorwise(x, scale, E4M3, True, True),
        "quantize_tensorwise (transposed view)": lambda: tk.quantize_tensorwise(x.t(), scale, E5M2, True, True),
        "quantize_current": lambda: tk.quantize_current(x, E5M2, columnwise=True),
        "quantize_rowwise": lambda: tk.quantize_rowwise(x, E4M3),
        "quantize_block": lambda: tk.quantize_block(x.t(), E4M3, 1),
        "quantize_mxfp8": lambda: tk.quantize_mxfp8(x, E5M2),
        "gemm_fp8_out": lambda: tk.gemm_fp8_out(a, b, scale, E4M3, activation="gelu"),
    }


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels interpreted")
@pytest.mark.parametrize("writer", list(_every_fp8_writer()))
def test_launchers_never_reach_the_hardware_encoding_on_cpu(monkeypatch, writer):
    """Under the interpreter every FP8 writer runs the exact encoding: with both
    hardware encodings replaced by a spy that raises, the call completes and is
    bit-exact; forcing HW_FP8 in the launchers (the positive control) reaches it."""
    calls = []
    monkeypatch.setattr(_common, "fp8_bytes_hw", _spy(calls))
    monkeypatch.setattr(_common, "fp8_bytes_hw_lanes", _spy(calls))
    _every_fp8_writer()[writer]()
    assert calls == []
    for module in (cast, triton_gemm):
        monkeypatch.setattr(module, "hw_fp8", lambda t: True)
    with pytest.raises(Exception) as raised:
        _every_fp8_writer()[writer]()
    assert calls, f"{writer}: forcing HW_FP8 did not reach the hardware encoding ({raised.value!r})"


# ------------------------------------------------- the PTX, instruction by instruction


def _hw_cvt(bits: int, fp8_dtype: torch.dtype, nan_byte: int, zero_sign: str) -> int:
    """A model of one ``cvt.rn.satfinite`` lane: a saturating RNE cast for numbers,
    infinities included (the instruction saturates them to +-fmax; the asm never
    sees one, :func:`nan_for_inf` runs first); NaN gives ``nan_byte``; a zero
    result keeps (``keep``) or drops (``drop``) its sign, or is always negative
    (``set``)."""
    x = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    if torch.isnan(x).item():
        return nan_byte
    x = x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)  # inf as the largest float
    byte = int(ref.saturating_cast_reference(x, fp8_dtype).view(torch.uint8))
    if byte & 0x7F == 0:
        byte = {"keep": byte, "drop": 0, "set": 0x80}[zero_sign]
    return byte


def _emulate(asm: str, inputs: list[int], fp8_dtype, nan_byte: int, zero_sign: str) -> dict[int, int]:
    """Run the inline PTX on fp32 bit patterns ``$n``; return the ``$n`` it writes."""
    regs = {f"${i}": v for i, v in enumerate(inputs)}
    out: dict[int, int] = {}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" in rest:
            d, lo, hi = re.match(r"(\S+),\s*\{(\S+),\s*(\S+)\}", rest).groups()
            value = val(lo) | val(hi) << 16
        else:
            d, *args = [t.strip() for t in rest.split(",")]
            if op.startswith("cvt.rn.satfinite."):
                value = (_hw_cvt(val(args[0]), fp8_dtype, nan_byte, zero_sign) << 8
                         | _hw_cvt(val(args[1]), fp8_dtype, nan_byte, zero_sign))
            elif op == "prmt.b32":
                source = [(val(args[0]) >> 8 * i) & 0xFF for i in range(4)] + \
                         [(val(args[1]) >> 8 * i) & 0xFF for i in range(4)]
                value = sum(source[(val(args[2]) >> 4 * j) & 7] << 8 * j for j in range(4))
            elif op == "bfe.u32":
                value = (val(args[0]) >> val(args[1])) & ((1 << val(args[2])) - 1)
            else:
                a, b = val(args[0]), (val(args[1]) if len(args) > 1 else 0)
                value = {"mov.b32": a, "and.b32": a & b, "or.b32": a | b, "add.u32": a + b, "shr.u32": a >> b,
                         "mul.lo.u32": a * b}[op]
        regs[d] = value & 0xFFFFFFFF
        if d.startswith("$"):
            out[int(d[1:])] = regs[d]
    return out


def _special_fp32(fp8_dtype) -> torch.Tensor:
    """Every FP8 value, the ties between neighbours and just off them, saturating
    values, infinities, NaNs of both signs, zeros and fp32 subnormals."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[:-1] + finite[1:]) / 2
    nudged = torch.cat([mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf")))])
    extra = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e9, float("inf"), -float("inf"),
                          float("nan"), 1e-40, 2.0**-126, 2.0**-149])
    values = torch.cat([finite, mids, nudged, extra])
    values = torch.cat([values, -values])
    return values[: values.numel() // 4 * 4]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("lanes", [False, True])
def test_ptx_bytes_match_torch_whatever_the_instruction_does_with_nan_and_zero(fp8_dtype, lanes):
    fmt = "e4m3" if fp8_dtype == E4M3 else "e5m2"
    shipped = {("e4m3", False): _common._CVT_E4M3, ("e4m3", True): _common._CVT_E4M3_LANES,
               ("e5m2", False): _common._CVT_E5M2, ("e5m2", True): _common._CVT_E5M2_LANES}[fmt, lanes]
    asm = shipped.value
    values = _special_fp32(fp8_dtype)
    want = ref.saturating_cast_reference(values, fp8_dtype).view(torch.uint8).tolist()  # inf, NaN: 0x7F | sign
    # what the asm receives: fp8_bytes has made each inf a NaN of its sign (nan_for_inf)
    bits = [b & 0xFFFFFFFF for b in values.view(torch.int32).tolist()]
    bits = [b | 0x400000 if b & 0x7FFFFFFF == 0x7F800000 else b for b in bits]
    nan_bytes = (0x7F, 0xFF) if fp8_dtype == E4M3 else (0x7F, 0xFF, 0x7E, 0x7D, 0xFD)
    first = 4 if lanes else 1  # the first input operand
    for nan_byte in nan_bytes:
        for zero_sign in ("keep", "drop", "set"):
            got = []
            for i in range(0, len(bits), 4):
                regs = _emulate(asm, [0] * first + bits[i:i + 4], fp8_dtype, nan_byte, zero_sign)
                if lanes:
                    assert all(regs[j] < 256 for j in range(4))
                    got += [regs[j] for j in range(4)]
                else:
                    got += [(regs[0] >> 8 * j) & 0xFF for j in range(4)]
            bad = [(values[i].item(), hex(g), hex(w)) for i, (g, w) in enumerate(zip(got, want)) if g != w]
            assert not bad, f"{fmt} lanes={lanes} nan=0x{nan_byte:02x} zero {zero_sign}: {bad[:5]}"


# ------------------------------------------------------------ the GPU check script


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the script's CPU mode runs interpreted")
def test_gpu_check_script_runs_on_cpu():
    """benchmarks/check_gpu_defects.py, interpreted on small shapes (the exact
    encoding only): every comparison passes, so the one GPU run checks kernels,
    not the script."""
    run = subprocess.run([sys.executable, "benchmarks/check_gpu_defects.py", "--device", "cpu", "--quick"],
                         capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    counts = re.search(r"^all: (\d+) PASS, 0 FAIL$", run.stdout, re.MULTILINE)
    assert counts and int(counts.group(1)) > 100, run.stdout[-2000:]
    assert "hardware: not on this device" in run.stdout
