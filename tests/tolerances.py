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
    # The embedding's weight gradient in fp32 against float64: each id's rows in groups
    # of 32 (a tree each), the groups added in token order; an id read thousands of
    # times adds hundreds of groups one after another. Used with scaled=True.
    "embedding_grad_fp32": dict(rtol=2e-5, atol=1e-6),
    # The same in float64 (a kernel's fp64 partial sums added in row order).
    "column_sums_fp64": dict(rtol=1e-13, atol=1e-15),
    # Flash attention on representable bf16 inputs against float64: the probabilities
    # P (forward, dv) and dS (dq, dk) enter the tensor-core products rounded to bf16
    # (2^-9 each) and the output is rounded once more; the errors are those roundings
    # summed over a row, so they are bounded relative to the tensor's largest element
    # (measured <= 4e-3 at T=67; a wrong mask, scale or kv head is O(1)). Used with
    # scaled=True, for o, dq, dk, dv.
    "attention_bf16": dict(rtol=1.6e-2, atol=1e-5),
    # The same with fp16 (2^-11 per rounding; measured <= 4.2e-4). scaled=True.
    "attention_fp16": dict(rtol=2e-3, atol=1e-5),
    # fp32 inputs: IEEE fp32 products (not TF32) and exp2 in fp32 (the GPU's ex2.approx
    # is within 2 ulp); measured <= 8e-7 under the interpreter. scaled=True. Also the
    # bound for lse (fp32 sums) of every high-precision path, absolute on values O(log Tk).
    "attention_fp32": dict(rtol=2e-5, atol=2e-5),
    # The FP8 forward on representable E4M3 inputs against float64 attention. Each
    # probability is cast to E4M3 once (relative error <= 2^-4 for normals, the
    # subnormal half-step 2^-10 / p_scale below), so |o - o_exact| <= 2^-4 · Σ_j p_j |v_j|
    # + n_keys · 2^-10 / p_scale · max|v|, plus the output's rounding (2^-9 in bf16)
    # and the FP8 tensor cores' narrower accumulation of q kᵀ (~1e-3 relative on p).
    # Here rtol multiplies Σ_j p_ij |v_j| (not |o|) in test_attention_kernels.py's
    # bound; the kernel and the reference each meet it (they round different
    # products: the running maximum vs the row's). Measured up to 0.5 of the bound.
    "attention_fp8": dict(rtol=0.07, atol=1e-5),
    # lse of the FP8 forward: unquantized sums, but q kᵀ from FP8 tensor cores (about
    # 14 significant bits per product sum on Hopper). Absolute and relative.
    "attention_fp8_lse": dict(rtol=2e-3, atol=2e-3),
    # The bf16 backward fed the FP8 forward's o (the FP8 recipe): o carries one E4M3
    # rounding per probability (2^-4), which reaches dq and dk through
    # delta = rowsum(o · do); twice that, relative to the largest element
    # (measured <= 0.027 at T=67). scaled=True.
    "attention_fp8_backward": dict(rtol=0.125, atol=1e-5),
    # te.ops.DotProductAttention under fp8_dpa / fp8_mha on representable inputs (q, k,
    # v and do exact on their grids): P cast to E4M3 (2^-4 relative) and O cast to E4M3
    # by the o role (2^-4 more), the backward fed that o (as above). Relative to the
    # tensor's largest element (scaled=True), forward and gradients.
    "attention_fp8_op": dict(rtol=0.125, atol=1e-5),
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
