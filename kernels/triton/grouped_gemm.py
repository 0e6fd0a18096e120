"""Grouped FP8 GEMMs in Triton: every expert of a mixture-of-experts layer in one launch.

The arguments and results are :mod:`te_fuser.kernels.reference.grouped_gemm`'s:

- :func:`grouped_gemm` (fprop and dgrad): ``out[s:e] = a[s:e] @ b[g·Q:(g+1)·Q].T + bias[g]``
  (the bias times ``bias_scale[s:e]`` per row when given) for each group ``g`` with
  rows ``s:e = offsets[g]:offsets[g+1]``. One grid of
  ``(cdiv(P, BLOCK_M) + G) · cdiv(Q, BLOCK_N)`` programs: each takes an m-tile
  slot and finds its group on the device from ``offsets`` (the prefix sums of the
  groups' tile counts, in registers), so the launch needs no host copy of the split
  sizes and empty groups cost nothing; the slots past the last tile return.
  A tile's rows past its group's end (the next group's tokens) are multiplied and
  never stored, so on a GPU the operands may go through TMA descriptors as in
  :func:`~te_fuser.kernels.triton.gemm.gemm`.
- :func:`grouped_gemm_wgrad`: ``out[g·Q:(g+1)·Q] = a[:, s:e] @ b[:, s:e].T``, the
  grouped dim the reduction; a grid ``(cdiv(Q, BLOCK_M) · cdiv(R, BLOCK_N), G)``.
  Both operands are the column-wise (transposed) copies the casts make, so the
  reduction dim is contiguous (K-major) as for the fprop. A group starts at any
  column, but vector loads and TMA boxes need 16-byte aligned columns: the K loop
  runs over tiles from the 16-aligned column at or below the group's start, plain
  tiles inside the group and, at most twice per group, a tile holding columns of a
  neighbour, zeroed in registers (both operands: no NaN of a neighbour's tokens
  reaches the sum). An empty group writes zeros.

Scales are tensor or row scales on either side (a group's own scale is a row
scale repeated over its rows), applied once after the fp32 accumulation; FP8
products are promoted to fp32 every 128 as in the dense GEMM. Plain bf16/fp16/fp32
operands run the same kernels unscaled (both operands of one dtype).

TMA descriptors cost host time at every launch (measured on an H200: a 2 GFLOP
grouped fprop took 0.119 ms with them, against 0.033 ms for the wgrad kernel of
the same size without), so, as in the dense GEMM, only launches of at least
``2**33`` FLOPs, where the GPU time hides the host's, use them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import Scaling
from ..operand import ScaledOperand
from ..reference.grouped_gemm import check_grouped_bias, check_grouped_gemm
from ._launch import launch
from ._common import TL_FLOAT, cdiv, fp8_format, is_interpreted, load_k_tile, next_power_of_2, to_output
from .gemm import Tiles

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "grouped_gemm_unsupported_reason",
           "grouped_gemm_wgrad_unsupported_reason", "TILE_OVERRIDES", "TMA_MIN_FLOP"]

# Tuning hook for the benchmarks: "fprop" / "wgrad" -> Tiles. Empty in normal use.
TILE_OVERRIDES: dict[str, Tiles] = {}


@triton.jit
def _store_tile(acc, offs_m, offs_n, row_end, n_end, bias_ptr, bias_scale_ptr, out_ptr, stride_om,
                HAS_BIAS: tl.constexpr, BIAS_SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """acc (+ the bias row, times each row's bias scale with BIAS_SCALE) rounded once
    to OUT_DTYPE, rows < row_end and columns < n_end."""
    n_ok = offs_n < n_end
    m_ok = offs_m < row_end
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if BIAS_SCALE:
            acc += bias * tl.load(bias_scale_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        else:
            acc += bias
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], to_output(acc, OUT_DTYPE),
             mask=mask)


@triton.jit
def _group_of_slot(offsets_ptr, slot, G, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr):
    """(group, first row, end row) of m-tile ``slot`` in the concatenation of the
    groups' tiles; group == G for a slot past the last tile."""
    idx = tl.arange(0, G_PAD)
    ok = idx < G
    starts = tl.load(offsets_ptr + idx, mask=ok, other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + idx + 1, mask=ok, other=0).to(tl.int32)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # one past each group's last tile
    g = tl.sum((last <= slot).to(tl.int32), axis=0)
    mine = idx == g
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (slot - first_tile) * BLOCK_M
    return g, row0, tl.sum(tl.where(mine, ends, 0), axis=0)


@triton.jit
def _grouped_gemm_kernel(
        a_src, b_src, offsets_ptr, sa_ptr, sb_ptr, bias_ptr, bias_scale_ptr, out_ptr, G, P, Q, K, stride_am,
        stride_bn, stride_om, SCALED: tl.constexpr, A_ROW_SCALES: tl.constexpr, B_ROW_SCALES: tl.constexpr,
        HAS_BIAS: tl.constexpr, BIAS_SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, PROMOTE_EVERY: tl.constexpr, UPCAST: tl.constexpr,
        USE_TMA: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr):
    """Rows of a grouped by ``offsets``, b (G·Q, K) one (Q, K) block per group."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(Q, BLOCK_N)
    slot = pid // tiles_n
    n0 = (pid % tiles_n) * BLOCK_N
    g, m0, row_end = _group_of_slot(offsets_ptr, slot, G, BLOCK_M, G_PAD)
    if g >= G:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows_a = tl.minimum(offs_m, P - 1)  # rows past the group are computed and never stored
    b_row0 = g * Q
    rows_b = b_row0 + offs_n % Q
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = load_k_tile(a_src, m0, rows_a, k0, K, stride_am, offs_k, USE_TMA)
        b = load_k_tile(b_src, b_row0 + n0, rows_b, k0, K, stride_bn, offs_k, USE_TMA)
        if UPCAST:  # the interpreter multiplies bf16 as raw bits: widen first (exact)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION, max_num_imprecise_acc=PROMOTE_EVERY)
    if SCALED:
        sa = tl.load(sa_ptr + rows_a)[:, None] if A_ROW_SCALES else tl.load(sa_ptr)
        sb = tl.load(sb_ptr + rows_b)[None, :] if B_ROW_SCALES else tl.load(sb_ptr)
        acc = acc * sa * sb
    _store_tile(acc, offs_m, offs_n, row_end, Q, bias_ptr + g * Q, bias_scale_ptr, out_ptr, stride_om, HAS_BIAS,
                BIAS_SCALE, OUT_DTYPE)


@triton.jit
def _zero_outside(t, ok):
    """``t`` with zeros where ``ok`` is False (FP8 through its bytes: no FP8 arithmetic)."""
    if t.dtype == tl.float8e4nv or t.dtype == tl.float8e5:
        bits = t.to(tl.uint8, bitcast=True)
        return tl.where(ok, bits, tl.zeros_like(bits)).to(t.dtype, bitcast=True)
    else:
        return tl.where(ok, t, tl.zeros_like(t))


@triton.jit
def _wgrad_tile(acc, a_src, b_src, m0, n0, rows_a, rows_b, k0, start, end, P, stride_am, stride_bn, offs_k,
                EDGE: tl.constexpr, INPUT_PRECISION: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
                UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    """acc + the product of the column tile at k0 (16-aligned); an EDGE tile's
    columns outside the group's ``start:end`` are zeroed in both operands first."""
    a = load_k_tile(a_src, m0, rows_a, k0, P, stride_am, offs_k, USE_TMA)
    b = load_k_tile(b_src, n0, rows_b, k0, P, stride_bn, offs_k, USE_TMA)
    if EDGE:
        cols = k0 + offs_k
        mine = ((cols >= start) & (cols < end))[None, :]
        a = _zero_outside(a, mine)
        b = _zero_outside(b, mine)
    if UPCAST:  # the interpreter multiplies bf16 as raw bits: widen first (exact)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION, max_num_imprecise_acc=PROMOTE_EVERY)


@triton.jit
def _grouped_gemm_wgrad_kernel(
        a_src, b_src, offsets_ptr, sa_ptr, sb_ptr, out_ptr, P, Q, R, stride_am, stride_bn, stride_om,
        SCALED: tl.constexpr, A_ROW_SCALES: tl.constexpr, B_ROW_SCALES: tl.constexpr, OUT_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, PROMOTE_EVERY: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """a (Q, P) and b (R, P), both K-major, reduced over group g's columns of P."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    tiles_n = tl.cdiv(R, BLOCK_N)
    m0 = (pid // tiles_n) * BLOCK_M
    n0 = (pid % tiles_n) * BLOCK_N
    start = tl.load(offsets_ptr + g).to(tl.int32)
    end = tl.load(offsets_ptr + g + 1).to(tl.int32)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows_a = (offs_m % Q).to(tl.int64)
    rows_b = (offs_n % R).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = (start // 16) * 16  # tiles start on 16-element (at least 16-byte) boundaries
    head = (start > k_lo) & (end > start)  # the first tile holds the previous group's last columns
    inner_end = (end - k_lo) // BLOCK_K  # tiles before this one end inside the group
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if head:
        acc = _wgrad_tile(acc, a_src, b_src, m0, n0, rows_a, rows_b, k_lo, start, end, P, stride_am, stride_bn,
                          offs_k, True, INPUT_PRECISION, PROMOTE_EVERY, UPCAST, USE_TMA)
    for t in range(head.to(tl.int32), inner_end):
        acc = _wgrad_tile(acc, a_src, b_src, m0, n0, rows_a, rows_b, k_lo + t * BLOCK_K, start, end, P, stride_am,
                          stride_bn, offs_k, False, INPUT_PRECISION, PROMOTE_EVERY, UPCAST, USE_TMA)
    tail = k_lo + inner_end * BLOCK_K
    if (tail < end) & ((inner_end > 0) | (start == k_lo)):  # a last partial tile the head did not take
        acc = _wgrad_tile(acc, a_src, b_src, m0, n0, rows_a, rows_b, tail, start, end, P, stride_am, stride_bn,
                          offs_k, True, INPUT_PRECISION, PROMOTE_EVERY, UPCAST, USE_TMA)
    if SCALED:
        sa = tl.load(sa_ptr + rows_a)[:, None] if A_ROW_SCALES else tl.load(sa_ptr)
        sb = tl.load(sb_ptr + rows_b)[None, :] if B_ROW_SCALES else tl.load(sb_ptr)
        acc = acc * sa * sb
    _store_tile(acc, offs_m, offs_n, Q, R, out_ptr, out_ptr, out_ptr + g.to(tl.int64) * Q * stride_om, stride_om,
                False, False, OUT_DTYPE)


# --------------------------------------------------------------- launchers


def _k_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _tma_ok(*mats: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row pitches."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in mats)

_SCALINGS = (Scaling.TENSOR, Scaling.ROW)
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)


def _unsupported(a, b) -> str | None:
    scaled = [isinstance(op, ScaledOperand) for op in (a, b)]
    if all(scaled):
        bad = [op.scaling for op in (a, b) if op.scaling not in _SCALINGS]
        return f"{bad[0]} scales (the grouped kernels take tensor and row scales)" if bad else None
    if any(scaled):
        return "one FP8 and one high-precision operand"
    if a.dtype != b.dtype or a.dtype not in _PLAIN:
        return f"plain operands of dtypes {a.dtype} and {b.dtype} (they must be one of bf16, fp16, fp32)"
    return None


def grouped_gemm_unsupported_reason(a, b) -> str | None:
    """Why this pair of operands goes to the fallback (None: the Triton kernel runs it)."""
    return _unsupported(a, b)


def grouped_gemm_wgrad_unsupported_reason(a, b) -> str | None:
    """Why this pair of operands goes to the fallback (None: the Triton kernel runs it)."""
    return _unsupported(a, b)


# Launches below this many FLOPs are host-bound: no TMA descriptors (module doc).
TMA_MIN_FLOP = 2**33


def _tiles(device: torch.device, which: str, fp8: bool, flop: int) -> Tiles:
    if which in TILE_OVERRIDES:
        return TILE_OVERRIDES[which]
    if device.type == "cpu":
        return Tiles(16, 16, 32, 1, 4, 1, use_tma=False)
    use_tma = flop >= TMA_MIN_FLOP
    if not fp8:
        return Tiles(128, 128, 64, 1, 8, 3, use_tma=use_tma)
    return Tiles(128, 128, 128, 1, 8, 4, use_tma=use_tma)


def _sources(a_mat: torch.Tensor, b_mat: torch.Tensor, t: Tiles) -> tuple[object, object, bool]:
    """The operands as TMA descriptors when the tiles ask for it and the matrices allow it."""
    if not (t.use_tma and a_mat.shape[1] > 0 and _tma_ok(a_mat, b_mat)):
        return a_mat, b_mat, False
    return (TensorDescriptor.from_tensor(a_mat, [t.block_m, t.block_k]),
            TensorDescriptor.from_tensor(b_mat, [t.block_n, t.block_k]), True)


def _operands(kernel: str, a, b, out_dtype: torch.dtype):
    """(a matrix, b matrix, a scales, b scales, constexprs) of a supported pair."""
    reason = _unsupported(a, b)
    if reason is not None:
        raise ValueError(f"{kernel}: the Triton kernel does not take {reason}")
    if out_dtype not in TL_FLOAT:
        raise ValueError(f"{kernel}: out_dtype must be one of {list(TL_FLOAT)}, got {out_dtype}")
    scaled = isinstance(a, ScaledOperand)
    if scaled:
        for op in (a, b):
            fp8_format(op.fp8_dtype)
        a_mat, b_mat = _k_major(a.data), _k_major(b.data)
        sa, sb = a.scale_inv.reshape(-1).contiguous(), b.scale_inv.reshape(-1).contiguous()
    else:
        a_mat, b_mat, sa, sb = _k_major(a), _k_major(b), None, None
    upcast = a_mat.dtype == torch.bfloat16 and is_interpreted(a_mat)
    meta = dict(SCALED=scaled, A_ROW_SCALES=scaled and a.scaling == Scaling.ROW,
                B_ROW_SCALES=scaled and b.scaling == Scaling.ROW, OUT_DTYPE=TL_FLOAT[out_dtype],
                INPUT_PRECISION="ieee" if (a_mat.dtype == torch.float32 or upcast) else None, UPCAST=upcast)
    return a_mat, b_mat, sa, sb, meta


def _promote(a_mat: torch.Tensor, t: Tiles) -> int | None:
    return min(t.block_k, 128) if a_mat.dtype.itemsize == 1 else None


def grouped_gemm(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    bias_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out (P, Q)``: rows ``offsets[g]:offsets[g+1]`` are ``a[rows] @ b[g·Q:(g+1)·Q].T
    + bias[g]`` (``+ bias[g] · bias_scale[row]`` with a bias scale per row), fp32
    accumulation and epilogue, one rounding, one launch for all groups. ``offsets``
    (G+1,) int32/int64 on a's device must rise from 0 to P (not checked: that would
    read the device)."""
    groups, p, q, k = check_grouped_gemm("grouped_gemm", a, b, offsets, wgrad=False)
    a_mat, b_mat, sa, sb, meta = _operands("grouped_gemm", a, b, out_dtype)
    bias, bias_scale = check_grouped_bias("grouped_gemm", bias, bias_scale, groups, p, q, a_mat.device)
    out = torch.empty(p, q, dtype=out_dtype, device=a_mat.device)
    if out.numel() == 0:
        return out
    if k == 0:
        a_mat, b_mat, sa, sb = a_mat.new_zeros(p, 1, dtype=torch.float32), b_mat.new_zeros(groups * q, 1,
                                                                                          dtype=torch.float32), None, None
        meta.update(SCALED=False, UPCAST=False, INPUT_PRECISION="ieee")
        k = 1
    t = _tiles(a_mat.device, "fprop", a_mat.dtype.itemsize == 1, 2 * p * q * k)
    a_src, b_src, use_tma = _sources(a_mat, b_mat, t)
    slots = cdiv(p, t.block_m) + groups  # each group may end in a partial tile
    grid = (slots * cdiv(q, t.block_n),)
    launch(_grouped_gemm_kernel, grid,
        a_src, b_src, offsets, sa if sa is not None else out, sb if sb is not None else out,
        bias if bias is not None else out, bias_scale if bias_scale is not None else out, out, groups, p, q, k,
        a_mat.stride(0), b_mat.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BIAS_SCALE=bias_scale is not None, PROMOTE_EVERY=_promote(a_mat, t), USE_TMA=use_tma,
        G_PAD=max(2, next_power_of_2(groups)), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages, **meta)
    return out


def grouped_gemm_wgrad(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``out (G·Q, R)``: ``out[g·Q:(g+1)·Q] = a[:, s:e] @ b[:, s:e].T`` with
    ``s:e = offsets[g]:offsets[g+1]`` (zeros for an empty group); a (Q, P), b (R, P),
    fp32 accumulation, one launch for all groups."""
    groups, p, q, r = check_grouped_gemm("grouped_gemm_wgrad", a, b, offsets, wgrad=True)
    a_mat, b_mat, sa, sb, meta = _operands("grouped_gemm_wgrad", a, b, out_dtype)
    out = torch.empty(groups * q, r, dtype=out_dtype, device=a_mat.device)
    if out.numel() == 0:
        return out
    t = _tiles(a_mat.device, "wgrad", a_mat.dtype.itemsize == 1, 2 * p * q * r)
    a_src, b_src, use_tma = _sources(a_mat, b_mat, t)
    grid = (cdiv(q, t.block_m) * cdiv(r, t.block_n), groups)
    launch(_grouped_gemm_wgrad_kernel, grid,
        a_src, b_src, offsets, sa if sa is not None else out, sb if sb is not None else out, out, p, q, r,
        a_mat.stride(0), b_mat.stride(0), out.stride(0), PROMOTE_EVERY=_promote(a_mat, t), USE_TMA=use_tma,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        **meta)
    return out
