"""Flash attention in Triton: the bf16 / fp16 / fp32 forward, the FP8 forward, and
the backward, against :mod:`te_fuser.kernels.reference.attention`.

Layout and meaning are the reference's: ``q`` (B, H, Tq, D), ``k``, ``v`` (B, Hkv,
Tk, D), query head ``h`` reads kv head ``h // (H / Hkv)`` (the kernels compute the
kv head's address; K and V are never repeated), ``causal`` keeps the keys
``j <= i`` of query ``i``.

Forward (``_attention_forward_kernel``, one program per (BLOCK_M queries, head)):
the query tile stays in registers while the program walks the key tiles with an
online softmax in base 2 (scores times ``softmax_scale · log2 e``): a running row
maximum ``m``, row sum ``l`` and fp32 accumulator, rescaled by ``exp2(m_old - m)``
when the maximum grows. The key range is split in two loops: tiles every query of
the block sees in full (no mask at all) and the tiles on the causal diagonal or
past the end of the keys (masked to -inf). Causal programs skip the tiles above the
diagonal and start with the longest rows (the grid runs the query blocks in
reverse). The epilogue writes ``o = acc / l`` and ``lse = (m + log2 l) · ln 2``.

FP8 forward (the same kernel, ``FP8``): E4M3 q, k, v; ``q kᵀ`` on FP8 tensor cores
scaled by ``q_scale_inv · k_scale_inv`` in fp32; each probability tile
``p = exp2(s - m)`` (in [0, 1]) becomes ``e4m3(p · p_scale)`` (nearest even,
saturated; p_scale enters the exponent as ``+ log2 p_scale``) for the FP8 ``p v``
product, whose fp32 result is added to the accumulator (promoted once per key
tile, never summed across tiles in the tensor cores' narrower accumulator); the
row sum ``l`` takes the unquantized ``p`` (times p_scale, which cancels in
``acc / l``), and the epilogue multiplies by ``v_scale_inv``. V is handed to the
kernel transposed (keys contiguous), the K-major operand Hopper's FP8 tensor
cores read.

Backward: ``_attention_dq_kernel`` (one program per query block and head) first
computes ``delta = rowsum(o · do)`` for its rows and stores it, then walks the key
tiles as the forward does: ``p = exp2(s - lse · log2 e)``, ``ds = p (do vᵀ - delta)``,
``dq += ds k``. ``_attention_dkdv_kernel`` (one program per key block and kv head)
keeps its K and V tiles in registers and walks, for each query head of its group,
the query tiles at or below the diagonal: ``dv += pᵀ do``, ``dk += dsᵀ q``; the
sums over the group stay in registers (no atomics, deterministic). Both scale by
``softmax_scale`` at the end. P and dS enter the tensor-core products in the
inputs' dtype, as in FlashAttention.

Exactness under ``TRITON_INTERPRET=1`` (DESIGN §4): bf16 tiles are widened to fp32
right after the load and the dots run in fp32 (``UPCAST``); a probability tile is
rounded onto the bf16 (fp16) grid in fp32 where the GPU converts it
(``round_through``); the FP8 probabilities are rounded onto the E4M3 grid in fp32
(``round_to_fp8_grid``) and the FP8 operands widened before the dots. Compiled on
a GPU, the probabilities are converted by ``cvt.rn.satfinite`` (after clamping to
the format's largest value), or with ``TE_FUSER_EXACT_FP8=1`` through the same
fp32 rounding. The outputs are rounded with ``to_output``.

Launch shapes: :data:`ATTENTION_PLANS` per kernel and head dim (a small one under
the interpreter); with :data:`AUTOTUNE` set (the benchmarks flip it) the compiled
kernels pick among :data:`AUTOTUNE_CONFIGS` by ``triton.autotune`` instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import E4M3
from ..reference.attention import check_attention, check_attention_backward, check_attention_fp8, keys_inner
from ._launch import launch
from ._common import TL_FLOAT, cdiv, fp8_format, hw_fp8, is_interpreted, round_through, round_to_fp8_grid, to_output

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_forward_fp8",
    "attention_forward_unsupported_reason",
    "attention_backward_unsupported_reason",
    "attention_forward_fp8_unsupported_reason",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape of one attention kernel: (block_m queries, block_n keys) tiles.
    ``one_loop`` (the forwards only): every key tile in one loop with the masks on
    each, where by default the diagonal's and the last tiles have a loop of their
    own; the same values. Two loops keep the masks off most tiles, one loop halves
    the code: in sm_90 builds of the FP8 forward at head dim 128 (64x128, 4 warps)
    968 spilled bytes against 24; the bf16 forward spills in neither. Two loops
    stay the plans': on the H200 the FP8 forward took 0.650 ms in two and 0.744 in
    one (run 190, B 4, 16 heads, T 4096, causal)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    one_loop: bool = False


# (kernel, head dim) -> plan on a GPU; "fwd" the bf16/fp16 forward, "fwd_fp8" the
# FP8 forward, "dq" and "dkdv" the backward's two kernels (dkdv: block_n keys per
# program, block_m queries per step). Head dims missing here use the next larger
# entry. The benchmarks may replace entries to compare launch shapes. Chosen from
# sm_90 builds (Triton's compiler run ahead of time for capability 9.0, with the
# launch's specializations: 16-divisible pointers and strides): every entry
# pipelines its loads (cp.async), runs its dots as wgmma and spills no registers
# (dkdv at head dim 128: none since its one loop; 6 spilled words before under
# Triton 3.6, 256 bytes under 3.9); the FP8 forward's from the sweep
# of bench_attention.py on an H200 (RESULTS.md run 56), the backward's at head
# dim 64 from the sweep at the GPT's shape (run 103: B 16, 16 heads, seq 1024).
ATTENTION_PLANS = {
    ("fwd", 128): AttentionPlan(128, 64, 8, 3),
    ("fwd", 64): AttentionPlan(128, 64, 4, 3),
    ("fwd", 32): AttentionPlan(128, 64, 4, 3),
    ("fwd_fp8", 128): AttentionPlan(64, 128, 4, 3),  # run 56's sweep: 0.653 ms against 0.710 for 128x128 w8
    ("fwd_fp8", 64): AttentionPlan(64, 128, 4, 3),
    ("dq", 128): AttentionPlan(128, 64, 8, 3),  # run 108's sweep at the main case: 2.125 ms a backward against 2.363 (s2)
    ("dq", 64): AttentionPlan(64, 64, 4, 3),  # run 103's sweep at the GPT's shape: 0.498 ms against 0.532 (128x32)
    ("dkdv", 128): AttentionPlan(32, 64, 4, 3),  # run 108: 2.159 ms a backward against 2.361 (32x128 w8 s2)
    ("dkdv", 64): AttentionPlan(32, 64, 4, 3),  # run 103: 0.385 ms a backward against 0.533 (32x128 w8 s2)
}
_INTERPRETED_PLANS = {  # small tiles: several per sequence at test sizes, both loops of each kernel run
    "fwd": AttentionPlan(32, 16, 4, 1),
    "fwd_fp8": AttentionPlan(32, 16, 4, 1),
    "dq": AttentionPlan(32, 16, 4, 1),
    "dkdv": AttentionPlan(16, 32, 4, 1),
}

# True: compiled kernels choose their launch shape with triton.autotune among
# AUTOTUNE_CONFIGS (keyed by the sizes, causal and the head dim); never under the
# interpreter. Off by default: the first call of each shape would time them all.
AUTOTUNE = False


def _configs(shapes, forward: bool = False) -> list:
    """Configs of (block_m, block_n, warps, stages[, one_loop]); a forward's carry ONE_LOOP."""
    configs = []
    for m, n, w, s, *one_loop in shapes:
        kwargs = {"BLOCK_M": m, "BLOCK_N": n}
        if forward:
            kwargs["ONE_LOOP"] = bool(one_loop and one_loop[0])
        configs.append(triton.Config(kwargs, num_warps=w, num_stages=s))
    return configs


AUTOTUNE_CONFIGS = {
    "fwd": _configs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4),
                     (128, 64, 8, 4), (128, 64, 8, 3, True)], forward=True),
    "fwd_fp8": _configs([(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (64, 128, 4, 3),
                         (128, 128, 4, 3), (64, 128, 4, 3, True), (128, 128, 8, 3, True)], forward=True),
    "dq": _configs([(128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                    (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4)]),
    "dkdv": _configs([(32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 2), (32, 64, 8, 3),
                      (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
                      (64, 128, 4, 2), (128, 128, 8, 2)]),
}


# fp32 inputs (a check, not a fast path: IEEE fp32 dots run on the FMA units, and
# spill at any useful tile size): small tiles that fit in shared memory at head dim 128.
_FP32_PLANS = {"fwd": AttentionPlan(32, 32, 4, 2), "dq": AttentionPlan(32, 32, 4, 2),
               "dkdv": AttentionPlan(32, 32, 4, 2)}


def _plan(kernel: str, head_dim: int, t: torch.Tensor) -> AttentionPlan:
    if is_interpreted(t):
        return _INTERPRETED_PLANS[kernel]
    if t.dtype == torch.float32:
        return _FP32_PLANS[kernel]
    dims = sorted(d for k, d in ATTENTION_PLANS if k == kernel)
    return ATTENTION_PLANS[(kernel, next((d for d in dims if d >= head_dim), dims[-1]))]


# --------------------------------------------------------------------- forward


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd, offs_m, offs_d, lo, hi, Tk,
                   qk_scale, p_shift, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                   FP8: tl.constexpr, HW_FP8: tl.constexpr, UPCAST: tl.constexpr, P_DTYPE: tl.constexpr,
                   PRECISION: tl.constexpr, P_FMAX: tl.constexpr, P_MANT_BITS: tl.constexpr,
                   P_MIN_STEP_EXP: tl.constexpr):
    """The key tiles ``[lo, hi)`` of one query block: the online softmax update.
    MASKED: scores of keys past ``Tk`` (and, CAUSAL, above the diagonal) are -inf;
    otherwise every key of every tile is seen by every query of the block.
    ``p_shift`` (FP8: log2 p_scale, else 0) scales the probabilities in the exponent:
    ``p · p_scale = exp2(s - (m - p_shift))``, so ``l`` and ``acc`` carry p_scale
    and it cancels in ``acc / l``."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # (D, BLOCK_N): kᵀ, D contiguous
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd  # (BLOCK_N, D)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Tk, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N); times qk_scale: base-2 scores
        if MASKED:
            seen = offs_n[None, :] < Tk
            if CAUSAL:
                seen = seen & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0: the scaled maximum, exactly
        p = tl.math.exp2(qk * qk_scale - (m_new - p_shift)[:, None])  # one FMA and one exp2 a score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Tk, other=0.0)
        else:
            v = tl.load(v_ptrs)
        if UPCAST:
            v = v.to(tl.float32)
        if FP8:  # p is p · p_scale here
            if HW_FP8:  # cvt.rn.satfinite: nearest even; p >= 0, so the clamp is the saturation
                p = tl.minimum(p, P_FMAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
            else:
                p = round_to_fp8_grid(p, P_FMAX, P_MANT_BITS, P_MIN_STEP_EXP)
                if not UPCAST:
                    p = p.to(tl.float8e4nv)  # on the grid: exact
            # a fresh product per tile, added in fp32: Hopper's FP8 tensor cores add into
            # a narrower accumulator, so the running sum never goes through them
            acc += tl.dot(p, v, input_precision=PRECISION)
        else:
            if UPCAST:
                p = round_through(p, P_DTYPE)
            else:
                p = p.to(P_DTYPE)
            acc = tl.dot(p, v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_forward_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, scales_ptr, qk_scale, H, G, Tq, Tk,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_vd,
        stride_ob, stride_oh, stride_ot,
        CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr, HW_FP8: tl.constexpr,
        UPCAST: tl.constexpr, P_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
        P_FMAX: tl.constexpr, P_MANT_BITS: tl.constexpr, P_MIN_STEP_EXP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_LOOP: tl.constexpr):
    """``o`` and ``lse`` of BLOCK_M queries of one head (see the module docstring).
    ``scales_ptr`` (FP8): q_scale_inv, k_scale_inv, v_scale_inv, p_scale.
    ONE_LOOP: every key tile in one masked loop (see ``AttentionPlan``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid  # the longest rows first
    b = bh // H
    h = bh % H
    hk = h // G
    m0 = pid * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    row_ok = offs_m < Tq
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    p_shift = 0.0
    out_scale = 1.0
    if FP8:
        qk_scale = qk_scale * tl.load(scales_ptr) * tl.load(scales_ptr + 1)
        p_shift = tl.math.log2(tl.load(scales_ptr + 3))
        out_scale = tl.load(scales_ptr + 2)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # [0, lo): tiles every query of the block sees whole; [lo, hi): the diagonal and the last partial tile
    if CAUSAL:
        lo = (tl.minimum(m0, Tk) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(Tk, m0 + BLOCK_M)
    else:
        lo = (Tk // BLOCK_N) * BLOCK_N
        hi = Tk
    if ONE_LOOP:
        lo = 0
    else:
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd, offs_m,
                                       offs_d, 0, lo, Tk, qk_scale, p_shift, False, CAUSAL, BLOCK_N, FP8, HW_FP8,
                                       UPCAST, P_DTYPE, PRECISION, P_FMAX, P_MANT_BITS, P_MIN_STEP_EXP)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd, offs_m, offs_d,
                                   lo, hi, Tk, qk_scale, p_shift, True, CAUSAL, BLOCK_N, FP8, HW_FP8, UPCAST,
                                   P_DTYPE, PRECISION, P_FMAX, P_MANT_BITS, P_MIN_STEP_EXP)
    o = acc * (out_scale / l_i)[:, None]
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], to_output(o, OUT_DTYPE), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i) - p_shift) * 0.6931471805599453  # ln 2: natural log
    tl.store(lse_ptr + bh.to(tl.int64) * Tq + offs_m, lse, mask=row_ok)


# -------------------------------------------------------------------- backward


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, Tk, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
              P_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """``dq += ds k`` over the key tiles ``[lo, hi)`` of one query block (MASKED as
    in ``_forward_tiles``; masked probabilities are 0)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # (D, BLOCK_N)
        vt_ptrs = v_base + offs_n[None, :] * stride_vt + offs_d[:, None]
        if MASKED:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Tk, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_n[None, :] < Tk, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            seen = offs_n[None, :] < Tk
            if CAUSAL:
                seen = seen & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if UPCAST:
            ds = round_through(ds, P_DTYPE)
        else:
            ds = ds.to(P_DTYPE)
        dq = tl.dot(ds, tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attention_dq_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, qk_scale, softmax_scale, H, G, Tq, Tk,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
        CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, P_DTYPE: tl.constexpr,
        OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``delta = rowsum(o · do)`` (stored for the dk/dv kernel) and ``dq`` of
    BLOCK_M queries of one head."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid
    b = bh // H
    h = bh % H
    hk = h // G
    m0 = pid * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    do_base = do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * Tq + offs_m, delta, mask=row_ok)
    lse2 = tl.load(lse_ptr + bh.to(tl.int64) * Tq + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        lo = (tl.minimum(m0, Tk) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(Tk, m0 + BLOCK_M)
    else:
        lo = (Tk // BLOCK_N) * BLOCK_N
        hi = Tk
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, 0, lo, Tk, qk_scale,
                   False, CAUSAL, BLOCK_N, UPCAST, P_DTYPE, PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, Tk, qk_scale,
                   True, CAUSAL, BLOCK_N, UPCAST, P_DTYPE, PRECISION)
    dq_base = dq_ptr + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    tl.store(dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :], to_output(dq * softmax_scale, OUT_DTYPE),
             mask=row_ok[:, None])


@triton.jit
def _key_block(k_ptr, v_ptr, b, hk, n0, Tk, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The keys ``[n0, n0 + BLOCK_N)`` of kv head ``hk`` of batch ``b``: their rows,
    the head dim's offsets, the K and V tiles (keys past ``Tk`` as zeros) and the
    first query tile that sees one of them (CAUSAL: the one holding query n0).
    The dk / dv kernel walks the query tiles from there in one loop with the
    causal mask on every tile, where the tiles past the diagonal need none: the
    same values, half the code, and the registers hold (sm_90 builds at head dim
    128: no spills, where a loop of the diagonal's own spilled 256 bytes)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Tk
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
    return offs_n, offs_d, k, v, lo


@triton.jit
def _store_dkdv(dk, dv, dk_ptr, dv_ptr, b, hk, offs_n, offs_d, Tk, softmax_scale, stride_dkb, stride_dkh, stride_dkt,
                stride_dvb, stride_dvh, stride_dvt, OUT_DTYPE: tl.constexpr):
    """Store ``dk · softmax_scale`` and ``dv`` of a key block in the output dtype (rows past ``Tk`` left)."""
    key_ok = (offs_n < Tk)[:, None]
    dk_base = dk_ptr + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    dv_base = dv_ptr + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
    tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :], to_output(dk * softmax_scale, OUT_DTYPE),
             mask=key_ok)
    tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_d[None, :], to_output(dv, OUT_DTYPE), mask=key_ok)


@triton.jit
def _query_head(q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, Tq, stride_qb, stride_qh, stride_dob, stride_doh):
    """Where query head ``h`` of batch ``b`` (row ``bh`` of lse and delta) starts in q, do, lse and delta."""
    return (q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh,
            do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh,
            lse_ptr + bh.to(tl.int64) * Tq, delta_ptr + bh.to(tl.int64) * Tq)


@triton.jit
def _query_tile(q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_d, start_m, Tq,
                BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """What a key block's products read of one query tile: its rows, ``qᵀ``
    (D, BLOCK_M), ``do`` (BLOCK_M, D), the base-2 lse and delta. Rows past ``Tq``
    load as zeros and add nothing (their do, q and delta are 0)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Tq
    qt = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None], mask=row_ok[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
        do = do.to(tl.float32)
    return offs_m, qt, do, lse2, delta


@triton.jit
def _dkdv_products(dk, dv, k, v, qt, do, lse2, delta, offs_m, offs_n, qk_scale, MASKED: tl.constexpr,
                   UPCAST: tl.constexpr, P_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """``dv += pᵀ do``, ``dk += dsᵀ q`` for one query tile (kept transposed: keys
    along the rows; MASKED: the causal mask): ``(dk, dv)``."""
    st = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
    pt = tl.math.exp2(st - lse2[None, :])
    if MASKED:
        pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    if UPCAST:
        p_in = round_through(pt, P_DTYPE)
    else:
        p_in = pt.to(P_DTYPE)
    dv = tl.dot(p_in, do, dv, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    if UPCAST:
        dst = round_through(dst, P_DTYPE)
    else:
        dst = dst.to(P_DTYPE)
    dk = tl.dot(dst, tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, offs_d, lo, hi,
                Tq, qk_scale, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr,
                P_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """``dv += pᵀ do``, ``dk += dsᵀ q`` over the query tiles ``[lo, hi)`` of one
    query head, for one key block (MASKED: the causal mask on each tile)."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m, qt, do, lse2, delta = _query_tile(q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                                  offs_d, start_m, Tq, BLOCK_M, UPCAST)
        dk, dv = _dkdv_products(dk, dv, k, v, qt, do, lse2, delta, offs_m, offs_n, qk_scale, MASKED, UPCAST,
                                P_DTYPE, PRECISION)
    return dk, dv


@triton.jit
def _attention_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qk_scale, softmax_scale, H, Hkv, G, Tq, Tk,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
        CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, P_DTYPE: tl.constexpr,
        OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dk`` and ``dv`` of BLOCK_N keys of one kv head, summed over the G query
    heads that read it."""
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    n0 = tl.program_id(0) * BLOCK_N
    offs_n, offs_d, k, v, lo = _key_block(k_ptr, v_ptr, b, hk, n0, Tk, stride_kb, stride_kh, stride_kt, stride_vb,
                                          stride_vh, stride_vt, CAUSAL, HEAD_DIM, UPCAST, BLOCK_M, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        bh = b * H + h
        q_base, do_base, lse_base, delta_base = _query_head(q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, bh, Tq, stride_qb,
                                                            stride_qh, stride_dob, stride_doh)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n,
                             offs_d, lo, Tq, Tq, qk_scale, CAUSAL, BLOCK_M, UPCAST, P_DTYPE, PRECISION)
    _store_dkdv(dk, dv, dk_ptr, dv_ptr, b, hk, offs_n, offs_d, Tk, softmax_scale, stride_dkb, stride_dkh, stride_dkt,
                stride_dvb, stride_dvh, stride_dvt, OUT_DTYPE)


# -------------------------------------------------------------------- launchers


@functools.lru_cache(maxsize=None)
def _autotuned(kernel: str):
    """The jit kernel under triton.autotune, keyed by the sizes and the constexprs
    that change the work (built on first use)."""
    fn = {"fwd": _attention_forward_kernel, "fwd_fp8": _attention_forward_kernel, "dq": _attention_dq_kernel,
          "dkdv": _attention_dkdv_kernel}[kernel]
    return triton.autotune(AUTOTUNE_CONFIGS[kernel], key=["Tq", "Tk", "G", "CAUSAL", "HEAD_DIM", "P_DTYPE"])(fn)


def _launch(kernel: str, jit_fn, rows: int, batch_heads: int, head_dim: int, t: torch.Tensor, args: list,
            meta: dict) -> None:
    """Launch over (row blocks, batch · heads) with the plan of ``kernel``, or let
    triton.autotune pick it (:data:`AUTOTUNE`, compiled kernels only)."""
    if AUTOTUNE and not is_interpreted(t):
        block = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
        _autotuned(kernel)[lambda m: (cdiv(rows, m[block]), batch_heads)](*args, **meta)
        return
    plan = _plan(kernel, head_dim, t)
    block = plan.block_n if kernel == "dkdv" else plan.block_m
    if kernel in ("fwd", "fwd_fp8"):
        meta = dict(meta, ONE_LOOP=plan.one_loop)
    launch(jit_fn, (cdiv(rows, block), batch_heads), *args, **meta, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
           num_warps=plan.num_warps, num_stages=plan.num_stages)


def _inner(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous head dim (what the kernels' loads assume)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dtype_meta(dtype: torch.dtype, t: torch.Tensor) -> dict:
    """The constexprs of the high-precision inputs' dtype: UPCAST (the interpreter
    widens bf16 / fp16 to fp32 before arithmetic), the dtype of P and dS in the
    dots, and the dots' precision (fp32 operands: IEEE, not TF32)."""
    upcast = is_interpreted(t) and dtype != torch.float32
    precision = "ieee" if (dtype == torch.float32 or upcast) else None
    return dict(UPCAST=upcast, P_DTYPE=TL_FLOAT[dtype], PRECISION=precision)


def _unsupported(q: torch.Tensor, fp8: bool) -> str | None:
    if not isinstance(q, torch.Tensor):
        return None  # the check names the argument
    if q.dtype == torch.float64:
        return "the triton attention kernels compute in fp32; float64 runs on the reference"
    if q.device.type not in ("cuda", "cpu"):
        return f"the triton backend does not run on {q.device.type} tensors"
    if fp8 and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 9):
        return "FP8 tensor-core dots need sm_89 or later"
    return None


def attention_forward_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why :func:`attention_forward` would not run these operands (None: it runs)."""
    return _unsupported(q, fp8=False)


def attention_backward_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    return _unsupported(q, fp8=False)


def attention_forward_fp8_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    return _unsupported(q, fp8=True)


def _require_supported(q: torch.Tensor, kernel: str, fp8: bool = False) -> None:
    reason = _unsupported(q, fp8)
    if reason is not None:
        raise ValueError(f"{kernel}: {reason}")


def _forward(q, k, v, causal, softmax_scale, out_dtype, scales, fp8: bool):
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    q, k = _inner(q), _inner(k)
    if fp8 and keys_inner(v) and all(v.stride(d) % 16 == 0 for d in (0, 1, 3)) and v.data_ptr() % 16 == 0:
        vk, stride_vt, stride_vd = v, 1, v.stride(3)  # V given with its keys inner (a transposed copy): as it lies
    elif fp8:  # V transposed, keys contiguous: K-major for the FP8 p·v product; rows padded to 16 bytes
        pitch = -(-Tk // 16) * 16
        vk = torch.empty(B, Hkv, D, pitch, dtype=v.dtype, device=v.device)[..., :Tk]
        vk.copy_(v.transpose(2, 3))
        stride_vt, stride_vd = vk.stride(3), vk.stride(2)
    else:
        vk = _inner(v)
        stride_vt, stride_vd = vk.stride(2), vk.stride(3)
    # o in the (B, T, H, D) layout of a fused tensor: its (B, T, H·D) merge is a view
    o = torch.empty(B, Tq, H, D, dtype=out_dtype, device=q.device).transpose(1, 2)  # (B, H, T, D)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    if B * H * Tq == 0:
        return o, lse
    if fp8:
        fmax, mant_bits, min_step_exp, _ = fp8_format(E4M3)
        meta = dict(FP8=True, HW_FP8=hw_fp8(q), UPCAST=is_interpreted(q), P_DTYPE=tl.float8e4nv,
                    PRECISION="ieee" if is_interpreted(q) else None, P_FMAX=fmax, P_MANT_BITS=mant_bits,
                    P_MIN_STEP_EXP=min_step_exp)
    else:
        meta = dict(FP8=False, HW_FP8=False, P_FMAX=0.0, P_MANT_BITS=0, P_MIN_STEP_EXP=0,
                    **_dtype_meta(q.dtype, q))
    args = [q, k, vk, o, lse, scales, float(softmax_scale) * LOG2E, H, H // Hkv, Tq, Tk,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            vk.stride(0), vk.stride(1), stride_vt, stride_vd, o.stride(0), o.stride(1), o.stride(2)]
    meta.update(CAUSAL=causal, HEAD_DIM=D, OUT_DTYPE=TL_FLOAT[out_dtype])
    _launch("fwd_fp8" if fp8 else "fwd", _attention_forward_kernel, Tq, B * H, D, q, args, meta)
    return o, lse


def attention_forward(q, k, v, causal, softmax_scale):
    """Flash attention forward: ``(o, lse)`` as :func:`attention_forward_reference`."""
    check_attention(q, k, v, causal, softmax_scale)
    _require_supported(q, "attention_forward")
    return _forward(q, k, v, causal, softmax_scale, q.dtype, q, fp8=False)


def attention_forward_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale,
                          out_dtype):
    """FP8 flash attention forward: ``(o, lse)`` as
    :func:`attention_forward_fp8_reference` (up to where the running maximum puts
    each probability on the E4M3 grid; see the reference)."""
    check_attention_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale, out_dtype)
    _require_supported(q, "attention_forward_fp8", fp8=True)
    scales = torch.stack([s.reshape(()) for s in (q_scale_inv, k_scale_inv, v_scale_inv, p_scale)])  # (4,) fp32
    return _forward(q, k, v, causal, softmax_scale, out_dtype, scales, fp8=True)


def _gradient_buffers(q, k, v):
    """dq, dk, dv as (B, heads, T, D) views of one (B, T, H + 2·Hkv, D) buffer (the
    gradient of a fused QKV tensor, which the caller can then take without a
    concatenation) when the three share a dtype and a length; else three
    tensors in the (B, T, heads, D) layout."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Tq == Tk and q.dtype == k.dtype == v.dtype:
        fused = torch.empty(B, Tq, H + 2 * Hkv, D, dtype=q.dtype, device=q.device)
        return fused.transpose(1, 2).split((H, Hkv, Hkv), dim=1)  # (B, heads, T, D) views of it
    return (torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2),
            torch.empty(B, Tk, Hkv, D, dtype=k.dtype, device=q.device).transpose(1, 2),
            torch.empty(B, Tk, Hkv, D, dtype=v.dtype, device=q.device).transpose(1, 2))


def attention_backward(q, k, v, o, lse, do, causal, softmax_scale):
    """Flash attention backward: ``(dq, dk, dv)`` as :func:`attention_backward_reference`."""
    _check_backward(q, k, v, o, lse, do, causal, softmax_scale, "attention_backward")
    return attention_backward_prechecked(q, k, v, o, lse, do, causal, softmax_scale)


def attention_backward_prechecked(q, k, v, o, lse, do, causal, softmax_scale):
    """:func:`attention_backward` for arguments its caller has checked (the cuda
    backend, choosing between its kernels and these), without a second check."""
    dq, dk, dv, delta, launch = _backward_start(q, k, v, o, lse, do, causal, softmax_scale)
    if launch is not None:
        q, k, v, do, lse, meta, qk_scale, G = launch
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        sq, sk, sv, sdo = q.stride()[:3], k.stride()[:3], v.stride()[:3], do.stride()[:3]
        _launch("dkdv", _attention_dkdv_kernel, Tk, B * Hkv, D, q,
                [q, k, v, do, lse, delta, dk, dv, qk_scale, float(softmax_scale), H, Hkv, G, Tq, Tk,
                 *sq, *sk, *sv, *sdo, *dk.stride()[:3], *dv.stride()[:3]], meta)
    return dq, dk, dv


def attention_dq(q, k, v, o, lse, do, causal, softmax_scale):
    """The backward's first kernel alone: ``(dq, delta)``, ``delta = rowsum(o · do)``
    fp32 (B, H, Tq), contiguous, what a dk / dv kernel reads beside lse."""
    dq, _, _, delta = attention_dq_with_buffers(q, k, v, o, lse, do, causal, softmax_scale)
    return dq, delta


def attention_dq_with_buffers(q, k, v, o, lse, do, causal, softmax_scale):
    """:func:`attention_dq` with the buffers another dk / dv kernel fills: ``(dq, dk,
    dv, delta)``, dk and dv the unwritten views beside dq of one (B, T, H + 2·Hkv, D)
    buffer (as :func:`attention_backward` returns them), zeros where there is no
    query."""
    _check_backward(q, k, v, o, lse, do, causal, softmax_scale, "attention_dq")
    return _backward_start(q, k, v, o, lse, do, causal, softmax_scale)[:4]


def _check_backward(q, k, v, o, lse, do, causal, softmax_scale, kernel: str) -> None:
    check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    _require_supported(q, kernel)


def _backward_start(q, k, v, o, lse, do, causal, softmax_scale):
    """The gradients' buffers and the dq kernel (which stores delta), for checked
    arguments: ``(dq, dk, dv, delta, launch)``, launch the dk / dv kernel's operands
    (None: nothing to run)."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    q, k, v, o, do = (_inner(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    dq, dk, dv = _gradient_buffers(q, k, v)
    delta = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    if B * H * Tq == 0:
        return dq, dk.zero_(), dv.zero_(), delta, None
    meta = dict(CAUSAL=causal, HEAD_DIM=D, OUT_DTYPE=TL_FLOAT[q.dtype], **_dtype_meta(q.dtype, q))
    qk_scale, G = float(softmax_scale) * LOG2E, H // Hkv
    # each tensor's (batch, head, token) strides, one call a tensor (the head dim's is 1)
    sq, sk, sv, sdo = q.stride()[:3], k.stride()[:3], v.stride()[:3], do.stride()[:3]
    _launch("dq", _attention_dq_kernel, Tq, B * H, D, q,
            [q, k, v, o, do, lse, delta, dq, qk_scale, float(softmax_scale), H, G, Tq, Tk,
             *sq, *sk, *sv, *o.stride()[:3], *sdo, *dq.stride()[:3]], meta)
    return dq, dk, dv, delta, (q, k, v, do, lse, meta, qk_scale, G)


# ------------------------------------------------ the fused gradient's layout


@triton.jit
def _merge_heads_kernel(dq_ptr, dk_ptr, dv_ptr, out_ptr, T, H, Hkv,
                        s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
                        HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    """One (BLOCK_T tokens, head) tile of dq | dk | dv into the fused (B, T, H + 2·Hkv, D)
    gradient: head n < H from dq, then Hkv heads from dk, then from dv (bytes copied)."""
    n_heads = H + 2 * Hkv
    bn = tl.program_id(1)
    b, n = bn // n_heads, bn % n_heads
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_t[:, None].to(tl.int64)
    mask = (offs_t < T)[:, None]
    if n < H:
        src = dq_ptr + b.to(tl.int64) * s_qb + n.to(tl.int64) * s_qh + rows * s_qt + offs_d[None, :]
    elif n < H + Hkv:
        src = dk_ptr + b.to(tl.int64) * s_kb + (n - H).to(tl.int64) * s_kh + rows * s_kt + offs_d[None, :]
    else:
        src = dv_ptr + b.to(tl.int64) * s_vb + (n - H - Hkv).to(tl.int64) * s_vh + rows * s_vt + offs_d[None, :]
    vals = tl.load(src, mask=mask)
    dst = out_ptr + (b.to(tl.int64) * T + rows) * (n_heads * HEAD_DIM) + n * HEAD_DIM + offs_d[None, :]
    tl.store(dst, vals, mask=mask)


def merge_head_gradients(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
    """dq (B, H, T, D), dk and dv (B, Hkv, T, D), each with a contiguous head dim, as
    views of one (B, T, H + 2·Hkv, D) tensor (the fused QKV input's gradient, which
    DotProductAttention takes without a concatenation): one launch that copies
    the bytes, where torch's three permuted copies run at half the bandwidth."""
    B, H, T, D = dq.shape
    Hkv = dk.shape[1]
    dq, dk, dv = (_inner(t) for t in (dq, dk, dv))
    fused = torch.empty(B, T, H + 2 * Hkv, D, dtype=dq.dtype, device=dq.device)
    if fused.numel():
        block_t = 16 if is_interpreted(dq) else 64
        launch(_merge_heads_kernel, (cdiv(T, block_t), B * (H + 2 * Hkv)),
            dq, dk, dv, fused, T, H, Hkv, dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1),
            dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), HEAD_DIM=D, BLOCK_T=block_t, num_warps=4)
    return (fused[:, :, :H].transpose(1, 2), fused[:, :, H:H + Hkv].transpose(1, 2),
            fused[:, :, H + Hkv:].transpose(1, 2))
