"""Bit-exactness check, on a CUDA GPU, of every Triton kernel that writes FP8, under
both FP8 encodings.

Compiled kernels write FP8 with the hardware conversion (``cvt.rn.satfinite``,
sm_89 and later) or, with ``TE_FUSER_EXACT_FP8=1``, with the exact integer
encoding (see ``kernels/triton/_common.py``). This script runs every check once
with the encoding the launchers pick and once with the exact one (flipping
``te_fuser.kernels.triton._common.EXACT_FP8`` in-process, as the variable does),
and compares bytes, scales and amaxes bit for bit with the reference
(``kernels/reference``, run on the same device):

1. ``quantize_tensorwise`` and ``quantize_current`` (row-wise, with the transposed
   copy, of transposed views), ``quantize_rowwise`` (rows in registers and swept),
   ``quantize_block`` (1x128 and 128x128, transposed views read in place) and
   ``quantize_mxfp8``, at real and odd shapes, E4M3 and E5M2, bf16 and fp32
   inputs, on data with FP8 ties, saturating values, NaN, +-inf, +-0 and subnormals
   (NaN and inf in the first rows only, so that most scaling groups stay finite);
2. ``dact_dbias`` (SwiGLU and GELU) against the reference within the
   tolerance;
3. ``gemm_fp8_out`` (tensor, block and MXFP8 scaling; bias + GELU, SwiGLU,
   residual) against the cast of the same GEMM's fp32 result, and with a zero A
   operand, so that a residual full of special values reaches the epilogue's cast
   unchanged.

Prints one PASS/FAIL row per comparison (the number of differing elements and
the first one: index, got and expected bits), then the PASS/FAIL counts of each
encoding; exits 1 on any failure. Estimated at one to two minutes on an H200, most
of it compiling each encoding's kernels (not yet timed there).

    python benchmarks/check_gpu_defects.py [--quick] [--encodings hardware exact]
    TRITON_INTERPRET=1 python benchmarks/check_gpu_defects.py --device cpu --quick   # the script itself
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from te_fuser.kernels.triton import _common

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
_NAMES = {E4M3: "e4m3", E5M2: "e5m2", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FMAX = {E4M3: 448.0, E5M2: 57344.0}
_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Sizes:
    """Shapes of the checks: ``real`` with all four (fp8, input dtype) pairs,
    ``odd`` with two."""

    real: tuple
    odd: tuple
    dact: tuple
    gemm: tuple  # (scaling, m, n, k, fp8 dtype, activation)
    gemm_specials: tuple  # (m, n, k)


GPU_SIZES = Sizes(
    real=((4096, 4096),), odd=((1001, 1000), (67, 1408), (13, 8704)), dact=((4096, 4096), (1001, 1002)),
    gemm=(("tensor", 2048, 2048, 2048, E4M3, "gelu"), ("tensor", 1001, 1000, 512, E5M2, "swiglu"),
          ("block", 2048, 2048, 2048, E5M2, None), ("mx", 1024, 1024, 1024, E4M3, "swiglu")),
    gemm_specials=(1001, 1024, 256))
# --device cpu: the interpreter on small shapes, the exact encoding only (a check of this script)
CPU_SIZES = Sizes(
    real=((128, 256),), odd=((67, 160), (13, 96)), dact=((64, 96), (33, 34)),
    gemm=(("tensor", 64, 64, 128, E4M3, "gelu"), ("tensor", 33, 40, 64, E5M2, "swiglu"),
          ("block", 64, 128, 256, E5M2, None), ("mx", 32, 64, 64, E4M3, "swiglu")),
    gemm_specials=(33, 64, 64))
DEVICE = "cuda"
SIZES = GPU_SIZES


# ----------------------------------------------------------------------- data


def _fp8_ties(fp8_dtype: torch.dtype) -> torch.Tensor:
    """Every value halfway between two neighbouring positive FP8 values."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8_dtype).float()
    grid = grid[torch.isfinite(grid)]
    return (grid[:-1] + grid[1:]) / 2


def _data(rows: int, cols: int, dtype: torch.dtype, fp8_dtype: torch.dtype, seed: int,
          specials: bool = True) -> torch.Tensor:
    """Off-centre values over a wide range, an all-zero 128-column band, FP8 values
    and ties at several powers of two (ties stay ties under power-of-2 scales),
    saturating values, +-0 and subnormals; with ``specials`` also NaN and +-inf,
    in the first four rows only."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(rows, cols, device=DEVICE, generator=gen)
    x = x * torch.exp2(torch.randint(-14, 14, (rows, cols), device=DEVICE, generator=gen).float())
    if cols > 256:
        x[:, 128:256] = 0.0
    fmax = _FMAX[fp8_dtype]
    ties = _fp8_ties(fp8_dtype)
    values = torch.arange(1, 0x7F, dtype=torch.uint8).view(fp8_dtype).float()
    finite = torch.cat([ties * 2.0**k for k in (-6, -3, 0, 3)] + [values[torch.isfinite(values)]] + [
        torch.tensor([0.0, -0.0, fmax, 1.04 * fmax, 1.2 * fmax, 3e38, 2.0**-10, 2.0**-17, 1e-39, 1e-45])])
    finite = torch.cat([finite, -finite]).to(DEVICE)
    flat = x.view(-1)
    where = torch.randperm(flat.numel(), device=DEVICE, generator=gen)[: min(flat.numel() // 4, finite.numel())]
    flat[where] = finite[: where.numel()]
    if specials:
        marks = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")], device=DEVICE)
        for r in range(min(rows, 4)):
            x[r, (7 * r) % cols] = marks[r]
    return x.to(dtype)


# ---------------------------------------------------------------------- table


def _unsigned_nan(q: torch.Tensor) -> torch.Tensor:
    """FP8 bytes with NaN (0x7F or 0xFF) as 0x7F."""
    u = q.view(torch.uint8)
    return torch.where(u == 0xFF, torch.full_like(u, 0x7F), u)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(t.shape or (1,)).contiguous().view(ints)


def _first_difference(got: torch.Tensor, want: torch.Tensor, nan_equal: bool) -> tuple[int, str]:
    """(number of differing elements, description of the first) of two same-shape tensors, as bits."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return -1, f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    a, e = _bits(got), _bits(want)
    diff = a != e
    if nan_equal and got.is_floating_point() and got.element_size() > 1:
        diff &= ~(torch.isnan(got.reshape(a.shape)) & torch.isnan(want.reshape(e.shape)))
    count = int(diff.sum())
    if not count:
        return 0, ""
    idx = tuple(int(i) for i in diff.nonzero()[0])
    mask = 2 ** (8 * got.element_size()) - 1
    width = 2 * got.element_size()
    g, w = int(a[idx]) & mask, int(e[idx]) & mask
    values = f" ({got.reshape(a.shape)[idx].float().item():g} vs {want.reshape(e.shape)[idx].float().item():g})"
    return count, f"first at {idx}: got 0x{g:0{width}x}, want 0x{w:0{width}x}{values}"


class Table:
    """PASS/FAIL rows, counted per encoding."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.encoding = ""

    def add(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor, nan_equal: bool = False) -> None:
        """Bit for bit (``nan_equal``: any NaN matches any NaN, for amaxes and scales)."""
        count, first = _first_difference(got, want, nan_equal)
        total = want.numel()
        self.rows.append((self.encoding, case, what, "PASS" if count == 0 else "FAIL",
                          f"{count} of {total} differ; {first}" if count else f"{total} equal"))

    def add_close(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
        """Within rtol, the absolute bound grown to rtol * max|want| (the tests' ``scaled``)."""
        err = (got.double() - want.double()).abs()
        bound = rtol * want.double().abs() + max(1e-5, rtol * want.double().abs().max().item())
        bad = err > bound
        detail = f"max |err| {err.max().item():.3g}"
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            detail += f"; first outside rtol {rtol} at {idx}: {got[idx].item():g} vs {want[idx].item():g}"
        self.rows.append((self.encoding, case, what, "FAIL" if bad.any() else "PASS", detail))

    def add_error(self, case: str, err: Exception) -> None:
        self.rows.append((self.encoding, case, "raised", "FAIL", f"{type(err).__name__}: {str(err)[:300]}"))

    def show(self) -> bool:
        widths = [max(len(r[i]) for r in self.rows) for i in range(4)]
        for row in self.rows:
            print("  ".join(f"{v:<{w}}" for v, w in zip(row[:4], widths)) + "  " + row[4])
        failures = [r for r in self.rows if r[3] == "FAIL"]
        if failures:
            print("\nfailures:")
            for row in failures:
                print("  ".join(row))
        print()
        for encoding in dict.fromkeys(r[0] for r in self.rows):
            rows = [r for r in self.rows if r[0] == encoding]
            failed = sum(r[3] == "FAIL" for r in rows)
            print(f"{encoding}: {len(rows) - failed} PASS, {failed} FAIL")
        failed = sum(r[3] == "FAIL" for r in self.rows)
        print(f"all: {len(self.rows) - failed} PASS, {failed} FAIL")
        return failed == 0


def _guarded(table: Table, case: str, check: Callable[..., None], **params) -> None:
    """``check(table, case, **params)``; an exception is a FAIL row, not the end of the run."""
    try:
        check(table, case, **params)
    except Exception as err:  # noqa: BLE001 - a kernel that fails to compile or launch is one failure
        table.add_error(case, err)


# --------------------------------------------------------------------- checks


def _combos(few: bool):
    """(fp8, input dtype) pairs: all four, or two that still cover both of each."""
    if few:
        return [(E4M3, torch.bfloat16), (E5M2, torch.float32)]
    return [(fp8, dtype) for fp8 in FP8 for dtype in (torch.bfloat16, torch.float32)]


def _tensorwise(table: Table, case: str, x, scale, fp8, columnwise: bool) -> None:
    got = tk.quantize_tensorwise(x, scale, fp8, True, columnwise)
    want = ref.quantize_tensorwise_reference(x, scale, fp8, True, columnwise)
    table.add(case, "data", got[0], want[0])
    if columnwise:
        table.add(case, "data_t", got[1], want[1])
    table.add(case, "amax", got[2], want[2], nan_equal=True)


def _current(table: Table, case: str, x, fp8, power_2: bool, columnwise: bool) -> None:
    got = tk.quantize_current(x, fp8, power_2=power_2, columnwise=columnwise)
    want = ref.quantize_current_reference(x, fp8, power_2=power_2, columnwise=columnwise)
    table.add(case, "data", got[0], want[0])
    if columnwise:
        table.add(case, "data_t", got[1], want[1])
    for what, g, w in zip(("scale", "scale_inv", "amax"), got[2:], want[2:]):
        table.add(case, what, g, w, nan_equal=True)


def check_per_tensor(table: Table, shapes, quick: bool) -> None:
    """Delayed and current scaling: row-wise, with the transposed copy, of transposed views."""
    for rows, cols in shapes:
        for fp8, dtype in _combos(quick or (rows, cols) not in SIZES.real):
            base = _data(rows, cols, dtype, fp8, seed=rows + cols)
            scale = torch.tensor(2.0**-3 if fp8 == E4M3 else 2.0**4, device=DEVICE)
            tag = f"{rows}x{cols} {_NAMES[dtype]} {_NAMES[fp8]}"
            for layout, x in (("", base), (" transposed view", base.t())):
                for columnwise in (False, True):
                    _guarded(table, f"tensorwise{'+T' if columnwise else ''} {tag}{layout}", _tensorwise, x=x,
                             scale=scale, fp8=fp8, columnwise=columnwise)
            finite = torch.where(torch.isfinite(base), base, torch.zeros_like(base))
            for name, x, power_2, columnwise in (("", base, False, True), (" finite", finite, True, False),
                                                 (" finite transposed view", finite.t(), False, True)):
                case = f"current{'+T' if columnwise else ''} {tag}{name}{' power_2' if power_2 else ''}"
                _guarded(table, case, _current, x=x, fp8=fp8, power_2=power_2, columnwise=columnwise)


def _rowwise(table: Table, case: str, x, fp8, power_2: bool) -> None:
    got = tk.quantize_rowwise(x, fp8, power_2=power_2)
    want = ref.quantize_rowwise_reference(x, fp8, power_2=power_2)
    table.add(case, "data", got.data, want.data)
    table.add(case, "scale_inv", got.scale_inv, want.scale_inv, nan_equal=True)


def _block(table: Table, case: str, x, fp8, tile_rows: int) -> None:
    got = tk.quantize_block(x, fp8, tile_rows)
    want = ref.quantize_block_reference(x, fp8, tile_rows)
    table.add(case, "data", got.data, want.data)
    table.add(case, "scale_inv", got.scale_inv, want.scale_inv, nan_equal=True)


def _mxfp8(table: Table, case: str, x, fp8) -> None:
    got = tk.quantize_mxfp8(x, fp8)
    want = ref.quantize_mxfp8_reference(x, fp8)
    # a NaN block's data is x * NaN, whose sign is the platform's: NaN bytes compare as 0x7F
    table.add(case, "data", _unsigned_nan(got.data), _unsigned_nan(want.data))
    table.add(case, "scale", got.scale_inv, want.scale_inv)


def check_scaled_groups(table: Table, shapes, quick: bool) -> None:
    """Row-wise, block (1x128, 128x128; transposed views in place) and MXFP8 casts."""
    for rows, cols in shapes:
        for fp8, dtype in _combos(quick or (rows, cols) not in SIZES.real):
            base = _data(rows, cols, dtype, fp8, seed=3 * rows + cols)
            tag = f"{rows}x{cols} {_NAMES[dtype]} {_NAMES[fp8]}"
            for power_2 in (False, True):
                _guarded(table, f"rowwise {tag}{' power_2' if power_2 else ''}", _rowwise, x=base, fp8=fp8,
                         power_2=power_2)
            for layout, x in (("", base), (" transposed view", base.t().contiguous().t())):
                for tile_rows in (1, 128):
                    case = f"block {'1x128' if tile_rows == 1 else '128x128'} {tag}{layout}"
                    _guarded(table, case, _block, x=x, fp8=fp8, tile_rows=tile_rows)
            if cols % 32 == 0:
                _guarded(table, f"mxfp8 {tag}", _mxfp8, x=base, fp8=fp8)


def _dact(table: Table, case: str, rows: int, cols: int, kind: str, dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 7 + cols)
    x = (-0.3 + 2.5 * torch.randn(rows, cols, device=DEVICE, generator=gen)).to(dtype)
    dy_cols = cols // 2 if kind == "swiglu" else cols
    dy = (-0.3 + 2.5 * torch.randn(rows, dy_cols, device=DEVICE, generator=gen)).to(dtype)
    dy.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e30, -1e30])  # zeros and huge values
    dx, dbias = tk.dact_dbias(dy, x, kind)
    dx_ref, dbias_ref = ref.dact_dbias_reference(dy, x, kind)
    table.add_close(case, "dx vs reference", dx, dx_ref, _RTOL[dtype])
    table.add_close(case, "dbias vs reference (sum order may differ)", dbias, dbias_ref, _RTOL[torch.float32])


def check_dact_dbias(table: Table, shapes, quick: bool) -> None:
    dtypes = sorted({dtype for _, dtype in _combos(quick)}, key=str)
    for rows, cols in shapes:
        for dtype in dtypes:
            for kind in ("swiglu", "gelu"):
                case = f"dact_dbias {kind} {rows}x{cols} {_NAMES[dtype]}"
                _guarded(table, case, _dact, rows=rows, cols=cols, kind=kind, dtype=dtype)


def _operands(scheme: str, m: int, n: int, k: int, fp8: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=gen).bfloat16()
    w = (0.05 * torch.randn(n, k, device=DEVICE, generator=gen)).bfloat16()
    if scheme == "tensor":
        a = tk.quantize_current(x, fp8)
        b = tk.quantize_current(w, fp8)
        return ScaledOperand(a[0], a[3], "tensor"), ScaledOperand(b[0], b[3], "tensor")
    if scheme == "block":
        return tk.quantize_block(x, fp8, 1), tk.quantize_block(w, fp8, 128)
    return tk.quantize_mxfp8(x, fp8), tk.quantize_mxfp8(w, fp8)


def _gemm(table: Table, case: str, scheme: str, m: int, n: int, k: int, fp8, activation) -> None:
    """The FP8 epilogue against the reference cast of the same GEMM's fp32 result."""
    a, b = _operands(scheme, m, n, k, fp8, seed=m + k)
    n_out = n // 2 if activation == "swiglu" else n
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    epilogue = {"bias": torch.randn(n, device=DEVICE, generator=gen).bfloat16(), "activation": activation,
                "residual": torch.randn(m, n_out, device=DEVICE, generator=gen).bfloat16()}
    out_scale = torch.tensor(96.0 if fp8 == E4M3 else 12288.0, device=DEVICE)  # saturates some outputs
    got, amax = tk.gemm_fp8_out(a, b, out_scale, fp8, **epilogue)
    y = tk.gemm(a, b, torch.float32, **epilogue)
    want, _, want_amax = ref.quantize_tensorwise_reference(y, out_scale, fp8)
    table.add(case, "data", got, want)
    table.add(case, "amax", amax, want_amax, nan_equal=True)


def _gemm_specials(table: Table, case: str, m: int, n: int, k: int, fp8) -> None:
    """A zero A operand: the epilogue casts 0 + residual, a residual full of special values."""
    a, b = _operands("tensor", m, n, k, fp8, seed=5)
    a = ScaledOperand(torch.zeros_like(a.data), a.scale_inv, "tensor")
    residual = _data(m, n, torch.float32, fp8, seed=11)
    out_scale = torch.tensor(2.0**-3 if fp8 == E4M3 else 2.0**4, device=DEVICE)
    got, _ = tk.gemm_fp8_out(a, b, out_scale, fp8, residual=residual)
    y = torch.zeros(m, n, device=DEVICE) + residual  # the epilogue's 0 + residual (-0 becomes +0)
    want, _, _ = ref.quantize_tensorwise_reference(y, out_scale, fp8)
    table.add(case, "data", got, want)


def check_gemm_fp8_out(table: Table, quick: bool) -> None:
    for scheme, m, n, k, fp8, activation in SIZES.gemm[:2] if quick else SIZES.gemm:
        case = f"gemm_fp8_out {scheme} {m}x{n}x{k} {activation} {_NAMES[fp8]}"
        _guarded(table, case, _gemm, scheme=scheme, m=m, n=n, k=k, fp8=fp8, activation=activation)
    m, n, k = SIZES.gemm_specials
    for fp8 in FP8:
        case = f"gemm_fp8_out zero A, special residual {m}x{n}x{k} {_NAMES[fp8]}"
        _guarded(table, case, _gemm_specials, m=m, n=n, k=k, fp8=fp8)


# ----------------------------------------------------------------------- main


def run_checks(table: Table, quick: bool) -> None:
    """Every check at the real shapes (all four fp8 and dtype pairs) and the odd
    ones (two pairs)."""
    real, odd = list(SIZES.real), list(SIZES.odd)
    check_per_tensor(table, real + odd[:1], quick)
    check_scaled_groups(table, real + (odd[:1] if quick else odd), quick)
    check_dact_dbias(table, list(SIZES.dact[:1] if quick else SIZES.dact), quick)
    check_gemm_fp8_out(table, quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and dtypes")
    parser.add_argument("--encodings", nargs="+", default=["hardware", "exact"], choices=["hardware", "exact"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: Triton's interpreter (TRITON_INTERPRET=1) on small shapes, a check of this script")
    args = parser.parse_args(argv)
    global DEVICE, SIZES
    DEVICE, SIZES = args.device, (GPU_SIZES if args.device == "cuda" else CPU_SIZES)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_gpu_defects: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    import triton

    name = (f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
            if args.device == "cuda" else "cpu (interpreted)")
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}  "
          f"TE_FUSER_EXACT_FP8 read as {_common.EXACT_FP8}\n")
    table = Table()
    probe = torch.empty(1, device=DEVICE)
    saved = _common.EXACT_FP8
    try:
        for encoding in args.encodings:
            _common.EXACT_FP8 = encoding == "exact"
            if encoding == "hardware" and not _common.hw_fp8(probe):
                print("hardware: not on this device (the interpreter, or a GPU before sm_89); skipped\n")
                continue
            table.encoding = encoding
            run_checks(table, args.quick)
    finally:
        _common.EXACT_FP8 = saved
    return 0 if table.show() else 1


if __name__ == "__main__":
    sys.exit(main())
