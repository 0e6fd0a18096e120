"""Activations, their gradients, and the fused backward ``dact_dbias`` in Triton.

The math matches :mod:`te_fuser.kernels.reference.activation` (GELU is the tanh
approximation; a gated kind is ``gate(x[..., :d]) * x[..., d:]``, SwiGLU's gate
silu; ClampedSwiGLU and SiTU-GLU also transform the up half, their parameters
compile-time constants of the kernels), computed in fp32
(fp64 for fp64 inputs). The ``@triton.jit`` helpers here are also the GEMM
epilogue's activations.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import ACTIVATION_CODES, GLU_GATES, activation_params
from ._launch import launch
from ..reference.cast import check_given_amax
from ._common import TL_FLOAT, abs_bits, cdiv, check_input, is_interpreted, round_through, sm_count, sum_rows
from .cast import CastPlan

__all__ = ["activation", "activation_grad", "dact_dbias", "ACTIVATION_CODES"]


def activation_code(kind: str | None) -> int:
    try:
        return ACTIVATION_CODES[kind]
    except KeyError:
        kinds = [k for k in ACTIVATION_CODES if k is not None]
        raise ValueError(f"activation: must be one of {kinds}, got {kind!r}") from None


# ------------------------------------------------------------------- jit math


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(u):
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _gelu_inner(x):
    return 0.7978845608028654 * (x + 0.044715 * x * x * x)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + _tanh(_gelu_inner(x)))


@triton.jit
def gelu_grad(x):
    t = _tanh(_gelu_inner(x))
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


@triton.jit
def silu(x):
    return x * _sigmoid(x)


@triton.jit
def silu_grad(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def qgelu(x):
    return x * _sigmoid(1.702 * x)


@triton.jit
def qgelu_grad(x):
    s = _sigmoid(1.702 * x)
    return s * (1.0 + 1.702 * x * (1.0 - s))


@triton.jit
def srelu(x):
    r = tl.where(x > 0.0, x, 0.0)
    return r * r


@triton.jit
def apply_activation(x, KIND: tl.constexpr):
    """Element-wise activation ``KIND`` (1 gelu, 2 relu, 3 silu, 5 qgelu, 6 srelu;
    0 identity)."""
    if KIND == 1:
        return gelu(x)
    elif KIND == 2:
        return tl.where(x > 0.0, x, 0.0)
    elif KIND == 3:
        return silu(x)
    elif KIND == 5:
        return qgelu(x)
    elif KIND == 6:
        return srelu(x)
    else:
        return x


@triton.jit
def apply_activation_grad(dy, x, KIND: tl.constexpr):
    if KIND == 1:
        return dy * gelu_grad(x)
    elif KIND == 2:
        return tl.where(x > 0.0, dy, 0.0)
    elif KIND == 5:
        return dy * qgelu_grad(x)
    elif KIND == 6:
        return dy * (2.0 * tl.where(x > 0.0, x, 0.0))
    else:
        return dy * silu_grad(x)


@triton.jit
def glu_gate(a, KIND: tl.constexpr):
    """The gate's activation of the gated kind ``KIND`` (4 swiglu, 7 glu, 8 geglu,
    9 qgeglu, 10 reglu, 11 sreglu)."""
    if KIND == 7:
        return _sigmoid(a)
    elif KIND == 8:
        return gelu(a)
    elif KIND == 9:
        return qgelu(a)
    elif KIND == 10:
        return tl.where(a > 0.0, a, 0.0)
    elif KIND == 11:
        return srelu(a)
    else:
        return silu(a)


@triton.jit
def glu_gate_grad(a, KIND: tl.constexpr):
    if KIND == 7:
        s = _sigmoid(a)
        return s * (1.0 - s)
    elif KIND == 8:
        return gelu_grad(a)
    elif KIND == 9:
        return qgelu_grad(a)
    elif KIND == 10:
        return tl.where(a > 0.0, 1.0, 0.0)
    elif KIND == 11:
        return 2.0 * tl.where(a > 0.0, a, 0.0)
    else:
        return silu_grad(a)


@triton.jit
def _tanh_small(u):
    """tanh for the soft caps of SiTU-GLU: the odd Taylor series to u¹³ where
    |u| < 0.125 (truncation below 1e-15 relative, where 1 - 2 / (exp(2u) + 1) loses
    digits to the cancellation), that form elsewhere."""
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (
        62.0 / 2835.0 + u2 * (-1382.0 / 155925.0 + u2 * (21844.0 / 6081075.0)))))))
    return tl.where(tl.abs(u) < 0.125, series, _tanh(u))


@triton.jit
def _sech2(u):
    """``1 - tanh²(u)`` as ``4e / (1 + e)²``, ``e = exp(-2|u|)`` (no cancellation near |tanh| = 1)."""
    e = tl.exp(-2.0 * tl.abs(u))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _clamped_qgelu(a, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    c = tl.minimum(a, LIMIT)
    return c * _sigmoid(ALPHA * c)


@triton.jit
def _clamped_qgelu_grad(a, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    c = tl.minimum(a, LIMIT)
    s = _sigmoid(ALPHA * c)
    return tl.where(a <= LIMIT, s * (1.0 + ALPHA * c * (1.0 - s)), 0.0)


@triton.jit
def gated(gate, up, KIND: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
    """A gated kind's output from its two halves: ``glu_gate(gate) * up``, or for
    12 clamped_swiglu (P0 limit, P1 alpha, P2 glu_linear_offset)
    ``clamped_qgelu(gate) * (clamp(up, -limit, limit) + offset)`` and for 13
    situglu (P0 beta1, P1 beta2) ``beta1·tanh(gate/beta1)·sigmoid(gate) ·
    beta2·tanh(up/beta2)``."""
    if KIND == 12:
        return _clamped_qgelu(gate, P0, P1) * (tl.minimum(tl.maximum(up, -P0), P0) + P2)
    elif KIND == 13:
        return P0 * _tanh_small(gate / P0) * _sigmoid(gate) * (P1 * _tanh_small(up / P1))
    else:
        return glu_gate(gate, KIND) * up


@triton.jit
def gated_grad(dy, gate, up, KIND: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
    """``(d gate, d up)`` of :func:`gated` for the output gradient ``dy``."""
    if KIND == 12:
        up_c = tl.minimum(tl.maximum(up, -P0), P0) + P2
        up_pass = tl.where((up >= -P0) & (up <= P0), 1.0, 0.0)
        return dy * up_c * _clamped_qgelu_grad(gate, P0, P1), dy * _clamped_qgelu(gate, P0, P1) * up_pass
    elif KIND == 13:
        t = _tanh_small(gate / P0)
        s = _sigmoid(gate)
        t_up = _tanh_small(up / P1)
        d_gate = _sech2(gate / P0) * s + P0 * t * s * (1.0 - s)
        return dy * (P1 * t_up) * d_gate, dy * (P0 * t * s) * _sech2(up / P1)
    else:
        return dy * up * glu_gate_grad(gate, KIND), dy * glu_gate(gate, KIND)


# -------------------------------------------------------------------- kernels


@triton.jit
def _activation_kernel(x_ptr, y_ptr, amax_ptr, rows, cols_out, KIND: tl.constexpr, GATED: tl.constexpr,
                       COMPUTE: tl.constexpr, ROUND_TO: tl.constexpr, AMAX: tl.constexpr, P0: tl.constexpr,
                       P1: tl.constexpr, P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y (rows, cols_out) = KIND(x); for a GATED kind x is (rows, 2 * cols_out). With
    AMAX, the tile's amax(|y|) of y as returned (rounded to ROUND_TO, the output
    dtype where it is narrower) folded into amax_ptr (the int32 bits of a zeroed
    fp32: |y|'s bits order like its values, NaN above inf) by an atomic maximum."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols_out)
    if GATED:
        row_ptr = x_ptr + offs_r[:, None] * (2 * cols_out) + offs_c[None, :]
        gate = tl.load(row_ptr, mask=mask, other=0.0).to(COMPUTE)
        up = tl.load(row_ptr + cols_out, mask=mask, other=0.0).to(COMPUTE)
        y = gated(gate, up, KIND, P0, P1, P2)
    else:
        x = tl.load(x_ptr + offs_r[:, None] * cols_out + offs_c[None, :], mask=mask, other=0.0).to(COMPUTE)
        y = apply_activation(x, KIND)
    tl.store(y_ptr + offs_r[:, None] * cols_out + offs_c[None, :], y, mask=mask)
    if AMAX:
        y_out = y if ROUND_TO is None else round_through(y, ROUND_TO)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, abs_bits(y_out.to(tl.float32)), 0), axis=1), axis=0))


@triton.jit
def _masked_bits(v, mask):
    """The int32 bits of |v| (as fp32) where ``mask``, else 0."""
    return tl.where(mask, abs_bits(v.to(tl.float32)), 0)


@triton.jit
def _dact_tile(dy_ptr, x_ptr, dx_ptr, offs_r, offs_c, rows, cols_dy, KIND: tl.constexpr, GATED: tl.constexpr,
               COMPUTE: tl.constexpr, ROUND_TO: tl.constexpr, AMAX: tl.constexpr, P0: tl.constexpr,
               P1: tl.constexpr, P2: tl.constexpr):
    """Write the input gradient of one tile; return its column sums (two halves,
    gate then up, for a GATED kind; the second is zeros otherwise) and, with AMAX,
    the int32 bits of |dx| element by element (of the larger half for a GATED kind;
    zeros past the tile's edge, and without AMAX). With a ROUND_TO
    dtype (narrower than COMPUTE: the op's dtype), dx is first rounded once to
    it, and the sums and maxima are of the rounded values: what the unfused
    backward (dx in the op's dtype, then a bias gradient of that dx) computes."""
    mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols_dy)
    dy = tl.load(dy_ptr + offs_r[:, None] * cols_dy + offs_c[None, :], mask=mask, other=0.0).to(COMPUTE)
    if GATED:
        x_row = x_ptr + offs_r[:, None] * (2 * cols_dy) + offs_c[None, :]
        gate = tl.load(x_row, mask=mask, other=0.0).to(COMPUTE)
        up = tl.load(x_row + cols_dy, mask=mask, other=0.0).to(COMPUTE)
        d_gate, d_up = gated_grad(dy, gate, up, KIND, P0, P1, P2)
        if ROUND_TO is not None:
            d_gate = round_through(d_gate, ROUND_TO)
            d_up = round_through(d_up, ROUND_TO)
        dx_row = dx_ptr + offs_r[:, None] * (2 * cols_dy) + offs_c[None, :]
        tl.store(dx_row, d_gate, mask=mask)
        tl.store(dx_row + cols_dy, d_up, mask=mask)
        bits = tl.zeros_like(mask.to(tl.int32))
        if AMAX:
            bits = tl.maximum(_masked_bits(d_gate, mask), _masked_bits(d_up, mask))
        return tl.sum(tl.where(mask, d_gate, 0.0), axis=0), tl.sum(tl.where(mask, d_up, 0.0), axis=0), bits
    else:
        x = tl.load(x_ptr + offs_r[:, None] * cols_dy + offs_c[None, :], mask=mask, other=0.0).to(COMPUTE)
        dx = apply_activation_grad(dy, x, KIND)
        if ROUND_TO is not None:
            dx = round_through(dx, ROUND_TO)
        tl.store(dx_ptr + offs_r[:, None] * cols_dy + offs_c[None, :], dx, mask=mask)
        col_sum = tl.sum(tl.where(mask, dx, 0.0), axis=0)
        bits = tl.zeros_like(mask.to(tl.int32))
        if AMAX:
            bits = _masked_bits(dx, mask)
        return col_sum, tl.zeros_like(col_sum), bits


@triton.jit
def _activation_grad_kernel(dy_ptr, x_ptr, dx_ptr, rows, cols_dy, KIND: tl.constexpr, GATED: tl.constexpr,
                            COMPUTE: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _dact_tile(dy_ptr, x_ptr, dx_ptr, offs_r, offs_c, rows, cols_dy, KIND, GATED, COMPUTE, None, False, P0, P1, P2)


@triton.jit
def _dact_dbias_kernel(dy_ptr, x_ptr, dx_ptr, partial_ptr, amax_ptr, rows, cols_dy, rows_per_split,
                       KIND: tl.constexpr, GATED: tl.constexpr, COMPUTE: tl.constexpr, ROUND_TO: tl.constexpr,
                       AMAX: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (c, s) writes dx for its columns over rows [s * rows_per_split, ...)
    and the column sums of that slab into partial[s] (a row of cols_dx); with AMAX,
    the slab's max |dx| is folded into amax_ptr (the int32 bits of a zeroed fp32)
    by one atomic maximum, as :func:`_activation_kernel` folds its tiles': the
    maximum is kept element by element over the slab's tiles and reduced once at
    the end (a reduction across the tile's rows every tile cost half the pass's
    time on an H100)."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    first = split * rows_per_split
    sum_a = tl.zeros([BLOCK_C], dtype=COMPUTE)
    sum_b = tl.zeros([BLOCK_C], dtype=COMPUTE)
    bits = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for r0 in range(first, tl.minimum(first + rows_per_split, rows), BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        offs_r = tl.where(offs_r < first + rows_per_split, offs_r, rows)  # stay inside this split
        part_a, part_b, part_bits = _dact_tile(dy_ptr, x_ptr, dx_ptr, offs_r, offs_c, rows, cols_dy, KIND, GATED,
                                               COMPUTE, ROUND_TO, AMAX, P0, P1, P2)
        sum_a += part_a
        sum_b += part_b
        bits = tl.maximum(bits, part_bits)
    cols_dx = 2 * cols_dy if GATED else cols_dy
    col_ok = offs_c < cols_dy
    tl.store(partial_ptr + split * cols_dx + offs_c, sum_a, mask=col_ok)
    if GATED:
        tl.store(partial_ptr + split * cols_dx + cols_dy + offs_c, sum_b, mask=col_ok)
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))


# ------------------------------------------------------------------ launchers


def _compute_dtype(x: torch.Tensor):
    return (tl.float64, torch.float64) if x.dtype == torch.float64 else (tl.float32, torch.float32)


def _as_rows(x: torch.Tensor, kind: str, kernel: str) -> tuple[torch.Tensor, int, int]:
    """``(x contiguous, rows, output columns)``: the kernels read x through its
    pointer as its 2-D flattening (prod(leading), x.shape[-1]), so x keeps its dims
    (a reshape on either side is a dispatch of its own on the host)."""
    if x.dim() == 0:
        raise ValueError(f"{kernel}: x must have at least one dimension, got a 0-d tensor")
    cols = x.shape[-1]
    if kind in GLU_GATES:
        if cols % 2:
            raise ValueError(f"{kernel}: {kind} needs an even last dimension, got {cols}")
        cols //= 2
    return (x if x.is_contiguous() else x.contiguous()), math.prod(x.shape[:-1]), cols


# Launch shapes on a GPU (tiles of block_m rows x block_n columns; for dact_dbias,
# programs_per_sm programs in flight, each walking its slab of rows); the
# benchmarks may replace entries to compare launch shapes (tune_dact_dbias.py).
ACTIVATION_PLANS = {
    "elementwise": CastPlan(8, 256, 4, 0),
    "dact_dbias": CastPlan(64, 64, 4, 8),  # H200 sweep (16384x4096 GELU): 0.147 ms, 2.5x (8, 256, 4, 4)
}
_INTERPRETED_PLAN = CastPlan(16, 32, 4, 4)


def _plan(x: torch.Tensor, kernel: str) -> CastPlan:
    return _INTERPRETED_PLAN if is_interpreted(x) else ACTIVATION_PLANS[kernel]


def _kernel_params(kind: str, params) -> dict:
    """The P0..P2 constexprs of ``kind`` (its parameters; zeros past them)."""
    p = activation_params(kind, params) + (0.0, 0.0, 0.0)
    return {"P0": p[0], "P1": p[1], "P2": p[2]}


def activation(x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
               params: tuple | None = None, amax_out: torch.Tensor | None = None) -> torch.Tensor:
    """``kind(x)`` in fp32 (fp64 for fp64 input), or rounded once to ``out_dtype``;
    a gated kind halves the last dimension; ``params``: a parametrized kind's values
    (its defaults when None); ``amax_out``: overwritten with amax(|y|) of y as
    returned, reduced in the same pass (see the reference)."""
    code = activation_code(kind)
    if kind is None:
        raise ValueError("activation: kind must be given")
    consts = _kernel_params(kind, params)
    check_input(x, "activation", dims=None)
    if amax_out is not None:
        check_given_amax(amax_out, x, "activation", "amax_out")
        amax_out.zero_()  # the kernel folds each tile's maximum in
    x_c, rows, cols = _as_rows(x, kind, "activation")
    tl_compute, compute = _compute_dtype(x)
    # On the GPU the store rounds to out_dtype (RNE) in the kernel; the interpreter's
    # own bf16 conversion is not trusted, so there torch rounds the fp32 result.
    store_dtype = out_dtype if (out_dtype is not None and not is_interpreted(x)) else compute
    y = torch.empty((*x.shape[:-1], cols), dtype=store_dtype, device=x.device)  # written as (rows, cols)
    if y.numel():
        plan = _plan(x, "elementwise")
        grid = (cdiv(rows, plan.block_m), cdiv(cols, plan.block_n))
        round_to = TL_FLOAT[out_dtype] if out_dtype in (torch.bfloat16, torch.float16) else None
        launch(_activation_kernel, grid, x_c, y, x_c if amax_out is None else amax_out.view(torch.int32), rows, cols,
               KIND=code, GATED=kind in GLU_GATES, COMPUTE=tl_compute, ROUND_TO=round_to, AMAX=amax_out is not None,
               **consts, BLOCK_R=plan.block_m, BLOCK_C=plan.block_n, num_warps=plan.num_warps)
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y


def _check_grad_inputs(dy: torch.Tensor, x: torch.Tensor, kind: str, kernel: str):
    activation_code(kind)
    if kind is None:
        raise ValueError(f"{kernel}: kind must be given")
    check_input(x, kernel, "x", dims=None)
    check_input(dy, kernel, "dy", dims=None)
    x_c, rows, cols = _as_rows(x, kind, kernel)
    expected = (*x.shape[:-1], cols)
    if tuple(dy.shape) != expected:
        raise ValueError(f"{kernel}: dy must have shape {expected} for x of shape {tuple(x.shape)} "
                         f"and kind {kind!r}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"{kernel}: dy is on {dy.device} but x is on {x.device}")
    # both contiguous in their own dims, read as (rows, cols) and (rows, x's columns)
    return (dy if dy.is_contiguous() else dy.contiguous()), x_c, rows, cols


def activation_grad(dy: torch.Tensor, x: torch.Tensor, kind: str, params: tuple | None = None) -> torch.Tensor:
    """Gradient w.r.t. the activation's input ``x`` given the output gradient ``dy``."""
    dy_c, x_c, rows, cols = _check_grad_inputs(dy, x, kind, "activation_grad")
    consts = _kernel_params(kind, params)
    tl_compute, compute = _compute_dtype(x if x.dtype == torch.float64 else dy)
    dx = torch.empty(x.shape, dtype=compute, device=x.device)  # written as (rows, x's columns)
    if dx.numel():
        plan = _plan(x, "elementwise")
        grid = (cdiv(rows, plan.block_m), cdiv(cols, plan.block_n))
        launch(_activation_grad_kernel, grid, dy_c, x_c, dx, rows, cols, KIND=activation_code(kind),
               GATED=kind in GLU_GATES, COMPUTE=tl_compute, **consts, BLOCK_R=plan.block_m, BLOCK_C=plan.block_n,
               num_warps=plan.num_warps)
    return dx


def _dact_dbias_launch(dy_c, x_c, rows: int, cols: int, kind: str, dx: torch.Tensor, compute,
                       round_to: torch.dtype | None = None, params: tuple | None = None,
                       amax_out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused kernel into ``dx`` (x's shape), reading ``dy_c`` and ``x_c``
    (contiguous) as (rows, cols) and (rows, x's columns), dx first rounded to the
    narrower ``round_to`` when given (and its amax folded into the zeroed
    ``amax_out``); return dbias."""
    tl_compute, torch_compute = compute
    cols_dx = x_c.shape[-1]
    plan = _plan(x_c, "dact_dbias")
    block_r, block_c = plan.block_m, plan.block_n
    col_blocks = cdiv(cols, block_c)
    in_flight = plan.programs_per_sm * sm_count(x_c)
    splits = max(1, min(cdiv(rows, block_r), in_flight // col_blocks))
    rows_per_split = cdiv(cdiv(rows, splits), block_r) * block_r
    splits = cdiv(rows, rows_per_split)
    partial = torch.empty((splits, cols_dx), dtype=torch_compute, device=x_c.device)
    launch(_dact_dbias_kernel, (col_blocks, splits),
        dy_c, x_c, dx, partial, x_c if amax_out is None else amax_out.view(torch.int32), rows, cols, rows_per_split,
        KIND=activation_code(kind), GATED=kind in GLU_GATES, COMPUTE=tl_compute,
        ROUND_TO=None if round_to is None else TL_FLOAT[round_to], AMAX=amax_out is not None,
        **_kernel_params(kind, params),
        BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=plan.num_warps)
    return sum_rows(partial)


def dact_dbias(
    dy: torch.Tensor, x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
    params: tuple | None = None, amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dbias)``: the activation gradient, rounded once to ``out_dtype``
    (default ``x.dtype``), and the fp32 sum over all leading dimensions of that
    rounded dx (the gradient of a bias added before the activation, as the unfused
    ops compute it), in one pass over ``dy`` and ``x``; ``amax_out``: overwritten
    with amax(|dx|) of dx as returned, reduced in the same pass (see the reference)."""
    dy_c, x_c, rows, cols = _check_grad_inputs(dy, x, kind, "dact_dbias")
    activation_params(kind, params)
    if amax_out is not None:
        check_given_amax(amax_out, x, "dact_dbias", "amax_out")
        amax_out.zero_()  # the kernel folds each slab's maximum in
    compute = _compute_dtype(x if x.dtype == torch.float64 else dy)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    # The interpreter's own narrowing conversion is not trusted: there the kernel
    # rounds in integer arithmetic (exact) and writes the compute dtype, and torch
    # converts the rounded values.
    in_kernel = out_dtype == compute[1] or not is_interpreted(x)
    dx = torch.empty(x.shape, dtype=out_dtype if in_kernel else compute[1], device=x.device)  # as (rows, x's columns)
    if not dx.numel():
        return dx.to(out_dtype), torch.zeros(x.shape[-1], dtype=compute[1], device=x.device)
    dbias = _dact_dbias_launch(dy_c, x_c, rows, cols, kind, dx, compute,
                               round_to=out_dtype if out_dtype != compute[1] else None, params=params,
                               amax_out=amax_out)
    if not in_kernel:
        dx = dx.to(out_dtype)
        dbias = dx.to(compute[1]).reshape(rows, -1).sum(dim=0)
    return dx, dbias
