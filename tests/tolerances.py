"""The one table of numerical tolerances for te_fuser's tests (DESIGN.md section 5).

Casts are compared bit for bit and need no entry. GEMMs, ops and models compare
against a float64 reference on representable inputs, within these bounds.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float8_e4m3fn: dict(rtol=0.125, atol=0.0675),
    torch.float8_e5m2: dict(rtol=0.25, atol=0.125),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    # FP8 operands that are exactly representable, multiplied and accumulated in
    # fp32: only the fp32 accumulation and the output rounding differ.
    "fp8_gemm_fp32_out": dict(rtol=1e-5, atol=1e-5),
    # The same on Hopper's FP8 tensor cores, which add the products in a narrower
    # accumulator (about 14 significant bits, per the DeepSeek-V3 report) before
    # each promotion to fp32: measured up to 3.5e-4 on outputs of size 5 at K=160.
    # Used with scaled=True (the bound is relative to the largest output).
    "fp8_gemm_tensor_core": dict(rtol=2e-3, atol=1e-5),
    # Fast accumulation: one promotion at the end of the K loop. On zero-mean
    # operands the narrow accumulator's error stays near 1e-3 of the largest output
    # at K=4096; on same-sign products it truncates without bound (an H200 gave
    # sums 8% low at K=4096, off-centre data), which is why only fprop defaults to
    # it. Used with scaled=True, on zero-mean operands.
    "fp8_gemm_fast_accum": dict(rtol=1e-2, atol=1e-5),
    # Norm gradients in fp32 from two kernels that sum a row (dx) or a column
    # (dweight) in different orders. Used with scaled=True.
    "norm_grad_fp32": dict(rtol=1e-5, atol=1e-6),
    # Column sums in fp32 (a bias gradient) in another order than float64's: each
    # partial sum rounds once per level of its tree. Used with scaled=True.
    "column_sums_fp32": dict(rtol=1e-5, atol=1e-6),
}


def tolerance(key) -> dict:
    return TOLERANCES[key]


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    flat = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    return f"worst at {idx}: got {actual.double()[idx].item()!r}, expected {expected.double()[idx].item()!r}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, key, context: str = "", *, scaled: bool = False) -> None:
    """``torch.testing.assert_close`` with the table's bounds and a message naming the
    shape, the context (recipe, op) and the worst coordinates.

    ``scaled``: the absolute bound grows to ``rtol * max|expected|``. For results
    that differ by one rounding of an *intermediate* (a fused op skipping a
    rounding), whose size is that of the tensor, not of each (possibly cancelled)
    element.
    """
    tol = dict(TOLERANCES[key])
    if scaled and expected.numel():
        tol["atol"] = max(tol["atol"], tol["rtol"] * expected.double().abs().max().item())
    try:
        torch.testing.assert_close(actual.double(), expected.double(), **tol)
    except AssertionError as err:
        raise AssertionError(
            f"{context} shape={tuple(actual.shape)} tol[{key}]={tol}: {_worst(actual, expected)}\n{err}"
        ) from None


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, context: str = "") -> None:
    """Bit-for-bit equality (FP8 compared as bytes; NaN equals NaN of the same bits)."""
    assert actual.shape == expected.shape, f"{context}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{context}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.element_size() == 1:
        a, e = a.view(torch.uint8), e.view(torch.uint8)
    elif a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.view(ints), e.view(ints)
    mismatch = (a != e).nonzero()
    if len(mismatch):
        first = tuple(int(i) for i in mismatch[0])
        raise AssertionError(
            f"{context}: {len(mismatch)} of {a.numel()} elements differ, shape={tuple(a.shape)}; "
            f"first at {first}: got {actual[first]!r}, expected {expected[first]!r}"
        )
