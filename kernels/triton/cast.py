"""FP8 casts in Triton, bit-exact against :mod:`te_fuser.kernels.reference.cast`.

Each kernel reads the high-precision input once per pass, converts it to fp32 at
once, and writes FP8 bytes through ``uint8`` views (see :mod:`._common`). Compiled
on a GPU, the bytes come from the hardware conversion (``HW_FP8``; the exact integer
encoding under the interpreter or with ``TE_FUSER_EXACT_FP8=1``), in the form each
store allows:

- stored in the layout they are computed in (the row-wise output of an input
  with contiguous rows, ``ROW_MAJOR``, in every cast; MXFP8 brings its scaled
  values back to the tile's 2-D shape before the encoding): packed four to a
  register by the conversion and stored as they are (``fp8_bytes_hw``);
- moved to another layout before the store: the transposed copies (``tl.trans``)
  and the outputs of inputs with strided rows (a transposed view read in place is
  loaded column-major, then its bytes move to the row-major store layout): one
  byte per int32 lane, narrowed by Triton (``fp8_bytes_hw_lanes``). A layout
  change after packed conversion results is the pattern Triton 3.6 miscompiled
  with its own conversion, while the lanes leave Triton exactly what the exact
  encoding does (on triton 3.6 the transposed copy's layout change even moves to
  the bf16 input, and each copy is converted in its own layout).

- ``quantize_tensorwise``: delayed scaling, one pass: cast with the given scale,
  the amax of the input and, optionally, the transposed (column-wise) copy, all
  from one read of each tile.
- ``quantize_current``: two passes: per-program amax partials, then a cast pass
  whose programs reduce the partials, derive the scale and cast.
- ``amax_column_sums``: the amax of current scaling and the column sums (a bias
  gradient) from one read, for a cast that takes the amax given.
- ``quantize_rowwise``, ``quantize_block`` (1x128, 128x128), ``quantize_mxfp8``.
- ``dequantize`` of any :class:`ScaledOperand`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import Scaling, block_scaling, scaling_tile
from ..operand import ScaledOperand, scaled_unchecked
from ..reference.cast import check_block_copies, check_given_amax, check_matrix, check_sums_dtype, column_sums_as
from ._launch import launch
from ._common import (
    TL_FLOAT,
    TL_FP8,
    abs_bits,
    bf16_value,
    cdiv,
    check_epsilon,
    check_input,
    check_scale,
    e8m0_from_amax,
    e8m0_reciprocal,
    e8m0_value,
    fp8_bytes,
    fp8_format,
    fp8_to_float,
    hw_fp8,
    is_interpreted,
    next_power_of_2,
    reciprocal,
    scale_from_amax,
    sm_count,
    sum_rows,
    to_output,
)

__all__ = [
    "quantize_tensorwise",
    "quantize_current",
    "amax_column_sums",
    "quantize_rowwise",
    "quantize_block",
    "quantize_mxfp8",
    "dequantize",
]


def _fp8_meta(fp8_dtype: torch.dtype, xk: torch.Tensor) -> dict:
    """The FP8 constexprs of a kernel reading ``xk``: the format, the encoding
    (HW_FP8) and whether xk's rows are contiguous (ROW_MAJOR: then the kernels
    load and store in one layout)."""
    fmax, mant_bits, min_step_exp, _ = fp8_format(fp8_dtype)
    return dict(OUT_DTYPE=TL_FP8[fp8_dtype], FMAX=fmax, MANT_BITS=mant_bits, MIN_STEP_EXP=min_step_exp,
                HW_FP8=hw_fp8(xk), ROW_MAJOR=xk.stride(1) == 1)


@dataclass(frozen=True)
class CastPlan:
    """Launch shape of a per-tensor cast: tiles of (block_m, block_n) elements and
    ``programs_per_sm`` persistent programs per multiprocessor. ``maxnreg``: a cap
    on a thread's registers (Triton's launch option; None: ptxas chooses), so that
    ``programs_per_sm`` programs can be resident at once: ptxas may otherwise take
    all 255 and leave room for one program of 256 threads a multiprocessor."""

    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int
    maxnreg: int | None = None


# Launch shapes on a GPU: "flat" casts a contiguous tensor without a transposed
# copy (viewed as rows of block_n elements), "transpose" writes both copies.
# The benchmarks may replace entries to compare launch shapes.
CAST_PLANS = {
    "flat": CastPlan(8, 1024, 8, 8),
    "transpose": CastPlan(64, 128, 4, 8),  # H200 sweep (run 141): tensorwise+T 0.096 ms at 8192^2, (128, 128, 8, 4) 0.122
}
_INTERPRETED_PLAN = CastPlan(32, 64, 4, 8)
# ``amax_column_sums``: (block_m, block_n) slices, programs_per_sm programs per
# multiprocessor, each walking a band of rows of one column block.
CAST_PLANS["column_sums"] = CastPlan(32, 128, 4, 4)
_INTERPRETED_COLUMN_SUMS = CastPlan(16, 32, 4, 4)


def _cast_plan(x2d: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, CastPlan]:
    """The plan, and x2d as the kernels see it: a contiguous x without a transposed
    copy is viewed as (numel / block_n, block_n) rows when that divides evenly."""
    if is_interpreted(x2d):
        plan = _INTERPRETED_PLAN
    elif columnwise:
        return x2d, CAST_PLANS["transpose"]
    else:
        plan = CAST_PLANS["flat"]
    if not columnwise and x2d.is_contiguous() and x2d.numel() % plan.block_n == 0:
        return x2d.view(-1, plan.block_n), plan  # (numel / block_n, block_n)
    return x2d, plan


def _launch_meta(xk: torch.Tensor, plan: CastPlan) -> tuple[int, dict]:
    """(number of persistent programs, shared launch arguments) for kernel view xk."""
    M, N = xk.shape
    n_tiles = cdiv(M, plan.block_m) * cdiv(N, plan.block_n)
    programs = min(n_tiles, plan.programs_per_sm * sm_count(xk))
    even = M % plan.block_m == 0 and N % plan.block_n == 0
    meta = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, EVEN=even, num_warps=plan.num_warps)
    if plan.maxnreg is not None and not is_interpreted(xk):
        meta["maxnreg"] = plan.maxnreg
    return programs, meta


# ----------------------------------------------------------------- per tensor


@triton.jit
def _store_fp8_transposed(qt_ptr, v, offs_m, offs_n, M, mask, EVEN: tl.constexpr, OUT_DTYPE: tl.constexpr,
                          FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr,
                          HW_FP8: tl.constexpr):
    """Store the FP8 bytes of ``v`` (a scaled tile of x at rows ``offs_m``, columns
    ``offs_n``) transposed into the (N, M) copy at ``qt_ptr``. The bytes change
    layout (``tl.trans``), so with HW_FP8 they are encoded in int32 lanes (MOVED).
    EVEN: the tile lies inside x (``mask``, x's, unused)."""
    qt = tl.trans(fp8_bytes(v, OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=True))
    ptrs = qt_ptr + offs_n[:, None] * M + offs_m[None, :]
    if EVEN:
        tl.store(ptrs, qt)
    else:
        tl.store(ptrs, qt, mask=tl.trans(mask))


@triton.jit
def _cast_tile(x_ptr, q_ptr, qt_ptr, sums_ptr, scale, tile, M, N, stride_xm, stride_xn,
               ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, SUMS: tl.constexpr, ROUND: tl.constexpr,
               BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN: tl.constexpr, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr,
               MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr, HW_FP8: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """Cast one (BLOCK_M, BLOCK_N) tile of x; return |x| of the tile as int32 bits
    (zero where masked), for the caller's running maximum. SUMS: also store the
    tile's column sums in fp32 as row ``tile // tiles_n`` of the (tiles_m, N) partials.
    ROUND: the cast reads x rounded to bf16 (the sums and nothing else read x as given).
    EVEN: the tiles cover x exactly (no masks). ROW_MAJOR: x's rows are contiguous,
    so the row-wise copy is stored in the layout it is computed in (packed bytes
    with HW_FP8); the transposed copy's bytes change layout (``tl.trans``), so with
    HW_FP8 they are encoded apart, in int32 lanes (the exact encodings of the two
    copies are one computation)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    if EVEN:
        mask = None
        x = tl.load(x_ptrs)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if SUMS:  # masked elements were loaded as zeros
        tl.store(sums_ptr + (tile // tiles_n) * N + offs_n, tl.sum(x, axis=0), mask=offs_n < N)
    if ROUND:
        x = bf16_value(x)
    if ROWWISE:
        q = fp8_bytes(x * scale, OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=not ROW_MAJOR)
        tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    if COLUMNWISE:
        _store_fp8_transposed(qt_ptr, x * scale, offs_m, offs_n, M, mask, EVEN, OUT_DTYPE, FMAX, MANT_BITS,
                              MIN_STEP_EXP, HW_FP8)
    return abs_bits(x)


@triton.jit
def _quantize_tensorwise_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, work_ptr, sums_ptr, M, N, stride_xm,
                                stride_xn, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, SUMS: tl.constexpr,
                                ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                                OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MANT_BITS: tl.constexpr,
                                MIN_STEP_EXP: tl.constexpr, HW_FP8: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """Cast with a given scale; program p casts tiles p, p + P, ... The amax is
    reduced with integer atomics on the bits of |x| in ``work[0]``, and the last
    program to finish writes it out. Each program keeps an elementwise running
    maximum over its tiles and reduces it across threads once, after the loop.
    SUMS: each tile also stores its column sums; ROUND: x is read rounded to bf16
    (see ``_cast_tile``), the amax too."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    scale = tl.load(scale_ptr)
    running = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for tile in range(pid, n_tiles, n_programs):
        tile_bits = _cast_tile(x_ptr, q_ptr, qt_ptr, sums_ptr, scale, tile, M, N, stride_xm, stride_xn, ROWWISE,
                               COLUMNWISE, SUMS, ROUND, BLOCK_M, BLOCK_N, EVEN, OUT_DTYPE, FMAX, MANT_BITS,
                               MIN_STEP_EXP, HW_FP8, ROW_MAJOR)
        running = tl.maximum(running, tile_bits)
    amax_bits = tl.max(tl.max(running, axis=1), axis=0)
    tl.atomic_max(work_ptr, amax_bits)
    finished = tl.atomic_add(work_ptr + 1, 1)
    if finished == n_programs - 1:
        total = tl.atomic_max(work_ptr, 0)
        tl.store(amax_ptr, total.to(tl.float32, bitcast=True))


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, M, N, stride_xm, stride_xn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """Pass 1 of current scaling: program p reduces tiles p, p + P, ... of x."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    running = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for tile in range(pid, n_tiles, n_programs):
        offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
        if EVEN:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0)
        running = tl.maximum(running, abs_bits(x.to(tl.float32)))
    tl.store(partials_ptr + pid, tl.max(tl.max(running, axis=1), axis=0))


@triton.jit
def _quantize_current_kernel(x_ptr, partials_ptr, n_partials, q_ptr, qt_ptr, scale_ptr, scale_inv_ptr, amax_ptr,
                             M, N, stride_xm, stride_xn, POWER_2: tl.constexpr, EPSILON: tl.constexpr,
                             ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, ROUND: tl.constexpr,
                             PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                             OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MANT_BITS: tl.constexpr,
                             MIN_STEP_EXP: tl.constexpr, HW_FP8: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """Pass 2 of current scaling: reduce the amax partials, derive the scale, and
    cast tiles p, p + P, ... ROUND: x is read rounded to bf16, and so is the amax
    (rounding is monotonic: the amax of the rounded x is the rounded amax of x)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    offs = tl.arange(0, PARTIALS)
    amax_bits = tl.max(tl.load(partials_ptr + offs, mask=offs < n_partials, other=0), axis=0)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if ROUND:
        amax = bf16_value(amax)
    scale = scale_from_amax(amax, FMAX, POWER_2, EPSILON)
    for tile in range(pid, n_tiles, n_programs):
        _cast_tile(x_ptr, q_ptr, qt_ptr, x_ptr, scale, tile, M, N, stride_xm, stride_xn, ROWWISE, COLUMNWISE, False,
                   ROUND, BLOCK_M, BLOCK_N, EVEN, OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, ROW_MAJOR)
    if pid == 0:
        tl.store(scale_ptr, scale)
        tl.store(scale_inv_ptr, reciprocal(scale))
        tl.store(amax_ptr, amax)


def _as_matrix(x: torch.Tensor, columnwise: bool, kernel: str) -> torch.Tensor:
    """2-D view of ``x``: (M, N) as given, or (prod(leading), last) without a column-wise copy."""
    if x.dim() == 2:
        return x
    if columnwise:
        raise ValueError(f"{kernel}: a column-wise (transposed) copy needs a 2-D x, got shape {tuple(x.shape)}")
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])  # (prod(leading), N)


def _outputs(x2d: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool):
    M, N = x2d.shape
    q = torch.empty((M, N), dtype=fp8_dtype, device=x2d.device) if rowwise else None
    qt = torch.empty((N, M), dtype=fp8_dtype, device=x2d.device) if columnwise else None
    return q, qt


def _u8(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """uint8 view of an FP8 output (a dummy pointer when the output is not wanted)."""
    return t.view(torch.uint8) if t is not None else like


def quantize_tensorwise(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Delayed-scaling cast of ``x`` with the 0-d fp32 ``scale``, in one pass.

    Returns ``(data (M, K) or None, data_t (K, M) or None, amax)``; with ``amax_out``
    (a one-element fp32 tensor) the amax is written there and that tensor returned.
    """
    q, qt, amax, _ = _tensorwise("quantize_tensorwise", x, scale, fp8_dtype, rowwise, columnwise, amax_out, False)
    return q, qt, amax


def quantize_tensorwise_column_sums(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensorwise` of 2-D ``x`` (M, N), and ``x`` summed over its rows
    in fp32 (N,), a bias gradient, from the cast's one read: each tile stores its
    column sums, and a small second pass adds the tiles' rows in order.
    ``round_bf16``: the cast and its amax read x rounded to bf16, the sums x as given.
    ``sums_dtype``: fp32, or bf16 (the fp32 sums rounded once, by torch).

    Returns ``(data or None, data_t or None, amax, sums)``.
    """
    kernel = "quantize_tensorwise_column_sums"
    check_matrix(x, kernel)
    check_sums_dtype(sums_dtype, kernel)
    q, qt, amax, sums = _tensorwise(kernel, x, scale, fp8_dtype, rowwise, columnwise, amax_out, True,
                                    bool(round_bf16))
    return q, qt, amax, column_sums_as(sums, sums_dtype)


def _tensorwise(kernel: str, x, scale, fp8_dtype, rowwise: bool, columnwise: bool, amax_out, sums: bool,
                round_bf16: bool = False):
    """The one-pass delayed-scaling cast, with the column sums when ``sums`` (x 2-D);
    ``round_bf16``: of x rounded to bf16."""
    check_input(x, kernel, dims=None)
    check_scale(scale, kernel, x.device)
    fp8_format(fp8_dtype)
    if amax_out is not None and (amax_out.numel() != 1 or amax_out.dtype != torch.float32):
        raise ValueError(f"{kernel}: amax_out must be a one-element float32 tensor, got {amax_out.dtype} "
                         f"of shape {tuple(amax_out.shape)}")
    x2d = _as_matrix(x, columnwise, kernel)
    q, qt = _outputs(x2d, fp8_dtype, rowwise, columnwise)
    amax = torch.empty((), dtype=torch.float32, device=x.device) if amax_out is None else amax_out
    column_sums = None
    if x2d.numel() == 0:
        amax.fill_(0.0)
        if sums:
            column_sums = torch.zeros(x2d.shape[1], dtype=torch.float32, device=x.device)
    else:
        if sums:  # the column sums need x's own columns: no flat view
            xk, plan = x2d, (_INTERPRETED_PLAN if is_interpreted(x2d) else CAST_PLANS["transpose"])
        else:
            xk, plan = _cast_plan(x2d, columnwise)
        programs, shared = _launch_meta(xk, plan)
        work = torch.zeros(2, dtype=torch.int32, device=x.device)  # amax bits, programs finished
        partials = (torch.empty((cdiv(xk.shape[0], plan.block_m), xk.shape[1]), dtype=torch.float32,
                                device=x.device) if sums else work)  # (tiles_m, N)
        launch(_quantize_tensorwise_kernel, (programs,),
            xk, scale, _u8(q, work), _u8(qt, work), amax, work, partials, *xk.shape, xk.stride(0), xk.stride(1),
            ROWWISE=rowwise, COLUMNWISE=columnwise, SUMS=sums, ROUND=round_bf16, **shared,
            **_fp8_meta(fp8_dtype, xk))
        if sums:
            column_sums = partials[0] if partials.shape[0] == 1 else sum_rows(partials)
    if q is not None and x.dim() != 2:
        q = q.reshape(x.shape)
    return q, qt, amax, column_sums


def quantize_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling in two passes (amax, then cast); with ``amax`` given (0-d
    fp32, e.g. from :func:`amax_column_sums`), the cast pass only.

    Returns ``(data, data_t, scale, scale_inv, amax)``, the last three 0-d fp32.
    """
    return _current("quantize_current", x, fp8_dtype, power_2, epsilon, rowwise, columnwise, amax, False)


def _current(kernel: str, x, fp8_dtype, power_2, epsilon, rowwise: bool, columnwise: bool, amax, round_bf16: bool):
    """Current scaling's passes; ``round_bf16``: the cast of x rounded to bf16 (the
    given amax, x's own, rounded too)."""
    check_input(x, kernel, dims=None)
    epsilon = check_epsilon(epsilon, kernel)
    fp8_format(fp8_dtype)
    if amax is not None:
        check_given_amax(amax, x, kernel)
    x2d = _as_matrix(x, columnwise, kernel)
    q, qt = _outputs(x2d, fp8_dtype, rowwise, columnwise)
    # separate allocations: cuBLASLt wants each scale pointer 16-byte aligned
    scale, scale_inv, amax_out = (torch.empty((), dtype=torch.float32, device=x.device) for _ in range(3))
    if x2d.numel() == 0:
        scale.fill_(1.0), scale_inv.fill_(1.0), amax_out.fill_(0.0)
    else:
        xk, plan = _cast_plan(x2d, columnwise)
        programs, shared = _launch_meta(xk, plan)
        if amax is None:
            partials = torch.empty(programs, dtype=torch.int32, device=x.device)
            launch(_amax_partials_kernel, (programs,), xk, partials, *xk.shape, xk.stride(0), xk.stride(1), **shared)
        else:  # one partial: the given amax's bits, with the sign cleared as |x|'s are
            partials = amax.reshape(1).view(torch.int32) & 0x7FFFFFFF
        launch(_quantize_current_kernel, (programs,),
            xk, partials, partials.numel(), _u8(q, partials), _u8(qt, partials), scale, scale_inv, amax_out,
            *xk.shape, xk.stride(0), xk.stride(1), POWER_2=bool(power_2), EPSILON=epsilon, ROWWISE=rowwise,
            COLUMNWISE=columnwise, ROUND=round_bf16, PARTIALS=max(2, next_power_of_2(partials.numel())), **shared,
            **_fp8_meta(fp8_dtype, xk))
    amax = amax_out
    if q is not None and x.dim() != 2:
        q = q.reshape(x.shape)
    return q, qt, scale, scale_inv, amax


@triton.jit
def _amax_column_sums_kernel(x_ptr, amax_partials_ptr, sums_ptr, M, N, stride_xm, stride_xn, rows_per_program,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (j, i) reads rows [i * R, (i + 1) * R) of columns [j * BLOCK_N, ...):
    their amax, as int32 bits of |x|, and their fp32 column sums, one partial row
    of sums per i. Both are kept elementwise over (BLOCK_M, BLOCK_N) while the
    program walks its rows (each lane adds its rows in order) and reduced across
    lanes once, after the loop."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    running = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    row0 = pid_m * rows_per_program
    for r in range(0, rows_per_program, BLOCK_M):
        offs_m = row0 + r + tl.arange(0, BLOCK_M)
        mask = (offs_m[:, None] < M) & col_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        running = tl.maximum(running, abs_bits(x))
        acc += x
    tl.store(sums_ptr + pid_m * N + offs_n, tl.sum(acc, axis=0), mask=col_ok)
    tl.store(amax_partials_ptr + pid_m * tl.num_programs(0) + pid_n, tl.max(tl.max(running, axis=1), axis=0))


def amax_column_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax(|x|), x summed over its rows)`` of 2-D ``x`` (M, N), 0-d and (N,) fp32,
    from one read of x: the amax of current scaling and a bias gradient together.
    The partial sums of each program's rows are added in a second, small pass."""
    kernel = "amax_column_sums"
    check_input(x, kernel, dims=2)
    M, N = x.shape
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device), torch.zeros(N, dtype=torch.float32,
                                                                                  device=x.device)
    plan = _INTERPRETED_COLUMN_SUMS if is_interpreted(x) else CAST_PLANS["column_sums"]
    block_m, block_n, num_warps = plan.block_m, plan.block_n, plan.num_warps
    col_blocks = cdiv(N, block_n)
    target = plan.programs_per_sm * (1 if is_interpreted(x) else sm_count(x))  # programs in flight
    row_blocks = max(1, min(cdiv(M, block_m), target // col_blocks))
    rows_per_program = cdiv(cdiv(M, row_blocks), block_m) * block_m
    row_blocks = cdiv(M, rows_per_program)
    amax_partials = torch.empty(row_blocks * col_blocks, dtype=torch.int32, device=x.device)
    sums = torch.empty((row_blocks, N), dtype=torch.float32, device=x.device)
    launch(_amax_column_sums_kernel, (col_blocks, row_blocks),
        x, amax_partials, sums, M, N, x.stride(0), x.stride(1), rows_per_program,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    amax = amax_partials.max().view(torch.float32)
    return amax, (sums[0] if row_blocks == 1 else sum_rows(sums))


def quantize_current_column_sums(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_current` of 2-D ``x`` with its column sums: the amax pass
    (:func:`amax_column_sums`) also sums the columns, the cast pass takes its amax.
    ``round_bf16``: the cast of x rounded to bf16 (the amax rounded with it), the
    sums of x as given. ``sums_dtype``: fp32, or bf16 (the fp32 sums rounded once, by torch).

    Returns ``(data, data_t, scale, scale_inv, amax, sums)``.
    """
    kernel = "quantize_current_column_sums"
    check_matrix(x, kernel)
    check_sums_dtype(sums_dtype, kernel)
    amax, sums = amax_column_sums(x)
    return (*_current(kernel, x, fp8_dtype, power_2, epsilon, rowwise, columnwise, amax, bool(round_bf16)),
            column_sums_as(sums, sums_dtype))


# ------------------------------------------------------------ per row / tile


@triton.jit
def _quantize_rowwise_kernel(x_ptr, q_ptr, scale_inv_ptr, M, N, stride_xm, stride_xn,
                             POWER_2: tl.constexpr, EPSILON: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr,
                             HW_FP8: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """BLOCK_M rows per program. SINGLE_PASS (BLOCK_N >= N): the rows stay in
    registers between the amax and the cast; else one sweep for the row amaxes
    and one to cast (the second mostly from L2)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    if SINGLE_PASS:
        offs_n = tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (offs_n[None, :] < N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(abs_bits(x), axis=1).to(tl.float32, bitcast=True)  # (BLOCK_M,)
        scale = scale_from_amax(amax, FMAX, POWER_2, EPSILON)
        q = fp8_bytes(x * scale[:, None], OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=not ROW_MAJOR)
        tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    else:
        running = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (offs_n[None, :] < N)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
            running = tl.maximum(running, abs_bits(x.to(tl.float32)))
        amax = tl.max(running, axis=1).to(tl.float32, bitcast=True)  # (BLOCK_M,)
        scale = scale_from_amax(amax, FMAX, POWER_2, EPSILON)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (offs_n[None, :] < N)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
            q = fp8_bytes(x.to(tl.float32) * scale[:, None], OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8,
                          MOVED=not ROW_MAJOR)
            tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    tl.store(scale_inv_ptr + offs_m, reciprocal(scale), mask=row_ok)


def _rowwise_blocks(x: torch.Tensor) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps): whole rows in registers up to
    8192 columns on a GPU (256 interpreted), else sweeps of 1024 (64)."""
    N = x.shape[1]
    limit, sweep = (256, 64) if is_interpreted(x) else (8192, 1024)
    if N <= limit:
        block_n = next_power_of_2(N)
        return max(1, 4096 // block_n), block_n, True, 8 if block_n >= 4096 else 4
    return 4, sweep, False, 4


def quantize_rowwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool = False, epsilon: float = 0.0
) -> ScaledOperand:
    """One scale per row of 2-D ``x``: ``ScaledOperand(data (M, K), scale_inv (M, 1), "row")``."""
    kernel = "quantize_rowwise"
    check_input(x, kernel)
    epsilon = check_epsilon(epsilon, kernel)
    meta = _fp8_meta(fp8_dtype, x)
    M, N = x.shape
    q = torch.empty((M, N), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and N:
        block_m, block_n, single_pass, warps = _rowwise_blocks(x)
        launch(_quantize_rowwise_kernel, (cdiv(M, block_m),),
            x, q.view(torch.uint8), scale_inv, M, N, x.stride(0), x.stride(1), POWER_2=bool(power_2),
            EPSILON=epsilon, BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single_pass, num_warps=warps, **meta)
    elif M:
        scale_inv.fill_(1.0)
    return ScaledOperand(q, scale_inv, Scaling.ROW)


@triton.jit
def _quantize_block_kernel(x_ptr, q_ptr, scale_inv_ptr, M, N, stride_xm, stride_xn, stride_sm, stride_sn,
                           qt_ptr, scale_t_ptr, stride_tm, stride_tn,
                           TILE_ROWS: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, POWER_2: tl.constexpr,
                           EPSILON: tl.constexpr, EVEN: tl.constexpr, ROWWISE: tl.constexpr,
                           COLUMNWISE: tl.constexpr, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr,
                           MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr, HW_FP8: tl.constexpr,
                           ROW_MAJOR: tl.constexpr):
    """ROWS_PER_PROGRAM x 128 elements per program: 1x128 tiles (one scale per row)
    or one 128x128 tile (one scale). Padding outside x does not count in amax.
    COLUMNWISE (ROWS_PER_PROGRAM 128): also the transposed copy (N, M) from the same
    read, quantized along M: under 1x128 one scale per column of the 128-row band
    (x.T's own 1x128 tiles), under 128x128 the tile's scale; its scales stored at
    (column, band) through (stride_tm, stride_tn)."""
    offs_m = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    offs_n = tl.program_id(1) * 128 + tl.arange(0, 128)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    if EVEN:
        mask = None
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    magnitude = abs_bits(x)  # int32 bits
    row_amax = tl.max(magnitude, axis=1)  # (ROWS_PER_PROGRAM,)
    if TILE_ROWS == 1:
        if ROWWISE:
            scale = scale_from_amax(row_amax.to(tl.float32, bitcast=True), FMAX, POWER_2, EPSILON)
            tl.store(scale_inv_ptr + offs_m * stride_sm + tl.program_id(1) * stride_sn, reciprocal(scale),
                     mask=offs_m < M)
            q = fp8_bytes(x * scale[:, None], OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=not ROW_MAJOR)
            tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
        if COLUMNWISE:
            col_scale = scale_from_amax(tl.max(magnitude, axis=0).to(tl.float32, bitcast=True), FMAX, POWER_2,
                                        EPSILON)  # (128,): one per column of the band
            tl.store(scale_t_ptr + offs_n * stride_tm + tl.program_id(0) * stride_tn, reciprocal(col_scale),
                     mask=offs_n < N)
            _store_fp8_transposed(qt_ptr, x * col_scale[None, :], offs_m, offs_n, M, mask, EVEN, OUT_DTYPE, FMAX,
                                  MANT_BITS, MIN_STEP_EXP, HW_FP8)
    else:
        tile_amax = tl.max(row_amax, axis=0).to(tl.float32, bitcast=True)
        scale = scale_from_amax(tile_amax, FMAX, POWER_2, EPSILON)
        if ROWWISE:
            tl.store(scale_inv_ptr + tl.program_id(0) * stride_sm + tl.program_id(1) * stride_sn, reciprocal(scale))
            q = fp8_bytes(x * scale, OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=not ROW_MAJOR)
            tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
        if COLUMNWISE:
            tl.store(scale_t_ptr + tl.program_id(1) * stride_tm + tl.program_id(0) * stride_tn, reciprocal(scale))
            _store_fp8_transposed(qt_ptr, x * scale, offs_m, offs_n, M, mask, EVEN, OUT_DTYPE, FMAX, MANT_BITS,
                                  MIN_STEP_EXP, HW_FP8)


def _block_scales_like(tile_rows: int, rows: int, cols: int, device) -> torch.Tensor:
    """The scale_inv of a (rows, cols) block-scaled operand: 1x128 scales stored
    K-block by K-block with the rows inner (the order cuBLASLt's block-scaled GEMM
    reads; the tensor (rows, ceil(cols/128)) has strides (1, rows)), 128x128 as the
    row-major tile grid."""
    k_blocks = -(-cols // 128)
    if tile_rows == 1:
        return torch.empty_strided((rows, k_blocks), (1, rows), dtype=torch.float32, device=device)
    return torch.empty((-(-rows // 128), k_blocks), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class _BlockLaunch:
    """What a block cast of one configuration launches with: its rows per program
    and its constexprs and options (with EVEN False and True)."""
    rows_per_program: int
    meta: tuple[dict, dict]


# (device, x's dtype, whether x's rows are contiguous, fp8_dtype, tile_rows, power_2,
# epsilon, rowwise, columnwise, hw_fp8(x)) -> _BlockLaunch, made once its arguments are checked
_BLOCK_LAUNCHES: dict[tuple, _BlockLaunch] = {}


def _block_launch(x: torch.Tensor, fp8_dtype, tile_rows, power_2, epsilon, rowwise, columnwise) -> _BlockLaunch:
    kernel = "quantize_block"
    check_input(x, kernel)
    if tile_rows not in (1, 128) or isinstance(tile_rows, bool):
        raise ValueError(f"tile_rows: must be 1 (1x128) or 128 (128x128), got {tile_rows}")
    check_block_copies(rowwise, columnwise, kernel)
    epsilon = check_epsilon(epsilon, kernel)
    if tile_rows == 128 or columnwise:
        rows_per_program = 128
    else:
        rows_per_program = 16 if is_interpreted(x) else 32
    meta = dict(TILE_ROWS=tile_rows, ROWS_PER_PROGRAM=rows_per_program, POWER_2=bool(power_2), EPSILON=epsilon,
                ROWWISE=rowwise, COLUMNWISE=columnwise, num_warps=8 if rows_per_program == 128 else 4,
                **_fp8_meta(fp8_dtype, x))
    return _BlockLaunch(rows_per_program, (dict(meta, EVEN=False), dict(meta, EVEN=True)))


def quantize_block(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    tile_rows: int,
    power_2: bool = True,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
) -> ScaledOperand | tuple[ScaledOperand | None, ScaledOperand]:
    """Block scaling of 2-D ``x`` with 1x128 (``tile_rows=1``) or 128x128 tiles;
    partial tiles at the edges are allowed. 1x128 scales are stored K-block by
    K-block with the rows inner, the order cuBLASLt's block-scaled GEMM reads: the
    operand's ``scale_inv`` (M, ceil(N/128)) is the transposed view of that array.

    ``columnwise``: also ``x.T`` (N, M) quantized along M from the same read, as
    :func:`quantize_block` of ``x.T`` would (1x128: its own scales; 128x128: the same
    tiles transposed); the result is then the pair (the row-wise operand, or None
    without ``rowwise``, and the column-wise one).

    The arguments are checked the first time a configuration is seen; its launch
    constants are kept (:data:`_BLOCK_LAUNCHES`), so a call after that checks x's
    kind and shape only."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        check_input(x, "quantize_block")  # raises
    key = (x.device, x.dtype, x.stride(1) == 1, fp8_dtype, tile_rows, power_2, epsilon, rowwise, columnwise,
           hw_fp8(x))  # the encoding in force: EXACT_FP8 can be switched at run time (benchmarks)
    if rowwise.__class__ is not bool or columnwise.__class__ is not bool or tile_rows.__class__ is bool:
        plan = None  # 1 and True are one key: the checks below tell them apart
    else:
        try:
            plan = _BLOCK_LAUNCHES.get(key)
        except TypeError:  # an argument that cannot be hashed: checked (and refused) below
            plan = None
    if plan is None:
        plan = _block_launch(x, fp8_dtype, tile_rows, power_2, epsilon, rowwise, columnwise)
        if len(_BLOCK_LAUNCHES) < 1024:
            _BLOCK_LAUNCHES[key] = plan
    M, N = x.shape
    scaling = block_scaling(tile_rows)
    device = x.device
    q = scale_inv = qt = scale_t = x  # an operand not made: a pointer the kernel never reads
    if rowwise:
        q = torch.empty((M, N), dtype=fp8_dtype, device=device)
        scale_inv = _block_scales_like(tile_rows, M, N, device)
    if columnwise:
        qt = torch.empty((N, M), dtype=fp8_dtype, device=device)
        scale_t = _block_scales_like(tile_rows, N, M, device)
    if M and N:
        rows = plan.rows_per_program
        launch(_quantize_block_kernel, (-(-M // rows), -(-N // 128)),
            x, q.view(torch.uint8) if rowwise else x, scale_inv, M, N, x.stride(0), x.stride(1),
            *(scale_inv.stride() if rowwise else (0, 0)),
            qt.view(torch.uint8) if columnwise else x, scale_t, *(scale_t.stride() if columnwise else (0, 0)),
            **plan.meta[M % rows == 0 and N % 128 == 0])
    op = scaled_unchecked(q, scale_inv, scaling) if rowwise else None
    if not columnwise:
        return op
    return op, scaled_unchecked(qt, scale_t, scaling)


@triton.jit
def _quantize_mxfp8_kernel(x_ptr, q_ptr, scale_ptr, M, N, stride_xm, stride_xn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                           FP8_EMAX: tl.constexpr, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MANT_BITS: tl.constexpr,
                           MIN_STEP_EXP: tl.constexpr, HW_FP8: tl.constexpr, ROW_MAJOR: tl.constexpr):
    """(BLOCK_M, BLOCK_N) elements per program, one E8M0 byte per 32 of a row. The
    scaled values return to (BLOCK_M, BLOCK_N) before the encoding, so the bytes
    are stored in the layout they are computed in."""
    GROUPS: tl.constexpr = BLOCK_N // 32
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    if EVEN:
        mask = None
        x = tl.load(x_ptrs)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, GROUPS, 32))  # (BLOCK_M, GROUPS, 32)
    amax = tl.max(abs_bits(x3), axis=2).to(tl.float32, bitcast=True)  # (BLOCK_M, GROUPS)
    byte = e8m0_from_amax(amax, FP8_EMAX)
    x_scaled = tl.reshape(x3 * e8m0_reciprocal(byte)[:, :, None], (BLOCK_M, BLOCK_N))
    q = fp8_bytes(x_scaled, OUT_DTYPE, FMAX, MANT_BITS, MIN_STEP_EXP, HW_FP8, MOVED=not ROW_MAJOR)
    tl.store(q_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    s_ptrs = scale_ptr + offs_m[:, None] * (N // 32) + offs_g[None, :]
    if EVEN:
        tl.store(s_ptrs, byte.to(tl.uint8))
    else:
        tl.store(s_ptrs, byte.to(tl.uint8), mask=(offs_m[:, None] < M) & (offs_g[None, :] < N // 32))


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> ScaledOperand:
    """MXFP8 along the last dim of 2-D ``x`` (a multiple of 32): E8M0 ``uint8`` scales."""
    kernel = "quantize_mxfp8"
    check_input(x, kernel)
    meta = _fp8_meta(fp8_dtype, x)
    M, N = x.shape
    if N % 32:
        raise ValueError(f"MXFP8: the quantized dimension ({N}) must be a multiple of 32")
    q = torch.empty((M, N), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((M, N // 32), dtype=torch.uint8, device=x.device)
    if M and N:
        block_m, block_n = (16, 64) if is_interpreted(x) else (32, 128)
        grid = (cdiv(M, block_m), cdiv(N, block_n))
        launch(_quantize_mxfp8_kernel, grid,
            x, q.view(torch.uint8), scale, M, N, x.stride(0), x.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
            EVEN=M % block_m == 0 and N % block_n == 0,
            FP8_EMAX=fp8_format(fp8_dtype)[3], num_warps=4, **meta)
    return ScaledOperand(q, scale, Scaling.MX_32)


# ---------------------------------------------------------------- dequantize


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, M, N, stride_sm, stride_sn,
                       TILE_R: tl.constexpr, TILE_C: tl.constexpr, E8M0: tl.constexpr, IS_E4M3: tl.constexpr,
                       OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``data * scale_inv`` in fp32, the scale of element (m, n) at
    ``s[(m // TILE_R) * stride_sm + (n // TILE_C) * stride_sn]``, a tile side of 0
    being the whole dimension (``formats.SCALING_TILES``): one scale for the tensor
    is read once a program, one a row once a row of the tile, and only block scales
    are looked up element by element (through zero strides the compiler cannot
    see, one scale would cost every thread a load per element)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    q = tl.load(q_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    if TILE_R == 0:
        s = tl.load(s_ptr)
    elif TILE_C == 0:
        s = tl.load(s_ptr + (offs_m // TILE_R) * stride_sm, mask=offs_m < M, other=1)[:, None]
    else:
        s_offs = (offs_m[:, None] // TILE_R) * stride_sm + (offs_n[None, :] // TILE_C) * stride_sn
        s = tl.load(s_ptr + s_offs, mask=mask, other=1)
    if E8M0:
        s = e8m0_value(s.to(tl.int32))
    out = fp8_to_float(q, IS_E4M3) * s
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], to_output(out, OUT_DTYPE), mask=mask)


def _scale_lookup(op: ScaledOperand) -> tuple[int, int, int, int]:
    """(TILE_R, TILE_C, stride_sm, stride_sn) of an operand's scale grid (a tile
    side of 0: the whole dimension, its stride unused)."""
    tile_r, tile_c = scaling_tile(op.scaling)
    return (tile_r, tile_c, op.scale_inv.stride(0) if tile_r else 0,
            op.scale_inv.stride(1) if tile_c else 0)


def dequantize(op: ScaledOperand, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` in fp32 (exact for representable values), then ``out_dtype``."""
    if not isinstance(op, ScaledOperand):
        raise TypeError(f"dequantize: op must be a ScaledOperand, got {type(op).__name__}")
    if out_dtype not in TL_FLOAT:
        raise ValueError(f"dequantize: out_dtype must be one of {list(TL_FLOAT)}, got {out_dtype}")
    fp8_format(op.fp8_dtype)
    data = op.data.contiguous()
    M, N = data.shape
    out = torch.empty((M, N), dtype=out_dtype, device=data.device)
    if M and N:
        tile_r, tile_c, stride_sm, stride_sn = _scale_lookup(op)
        block_m, block_n = (16, 64) if is_interpreted(data) else (32, 128)
        grid = (cdiv(M, block_m), cdiv(N, block_n))
        launch(_dequantize_kernel, grid,
            data, op.scale_inv, out, M, N, stride_sm, stride_sn, TILE_R=tile_r, TILE_C=tile_c,
            E8M0=op.scaling == Scaling.MX_32, IS_E4M3=op.fp8_dtype == torch.float8_e4m3fn,
            OUT_DTYPE=TL_FLOAT[out_dtype],
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out
