"""FP8 GEMMs with fused epilogues in Triton.

``out = activation(a @ b.T + bias) + residual`` with ``a`` (P, R) and ``b`` (Q, R)
both K-major (see :mod:`te_fuser.kernels.operand`), fp32 accumulation, and one of
these kernels chosen by the operands' scalings:

- ``_fp8_gemm_tensorwise_kernel``: tensor or row scales on either side, applied
  once in the epilogue; also the kernel for plain high-precision operands;
- ``_fp8_gemm_blockwise_1x128_128x128_kernel`` / ``_fp8_gemm_blockwise_1x128_1x128_kernel``:
  DeepSeek-style block scaling: each 128-deep partial product is promoted to the
  fp32 accumulator with its A-row and B-block scales;
- ``_mxfp8_gemm_kernel``: MXFP8 (E8M0 per 32 along K); Hopper has no MXFP8
  datapath, so each FP8 tile is multiplied by its power-of-2 scales in registers
  (exact in bf16) and fed to a bf16 dot (or, switchable, ``tl.dot_scaled``).

The epilogue adds the bias, applies GELU/ReLU/SiLU, or SwiGLU as a gated pair:
the program computes the gate columns ``j`` and the up columns ``j + Q/2`` side by
side and writes ``silu(gate) * up``; then it adds the residual and casts (to
bf16/fp16/fp32, or, in :func:`gemm_fp8_out`, to FP8 with a given scale while
reducing the amax). Other scaling pairs are dequantized to fp32 and multiplied by
the tensorwise kernel.

On Hopper the FP8 tensor cores accumulate in a narrower format; the tensorwise
kernel promotes to fp32 every 128 products, also with 256-deep tiles
(``gemm(..., fast_accum=True)`` promotes once, at the end), the block kernels every
128-deep block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import Scaling
from ..operand import ScaledOperand
from ..reference.gemm import check_epilogue_activation
from ._launch import launch
from ._common import (
    TL_FLOAT, TL_FP8, abs_bits, cdiv, e8m0_value, fp8_bytes_as, fp8_format, fp8_to_float, hw_fp8, is_interpreted,
    load_k_tile, round_through, to_output)
from .activation import activation_code, apply_activation, silu
from .cast import dequantize

__all__ = ["gemm", "gemm_fp8_out"]

_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


# ------------------------------------------------------------ shared pieces


@triton.jit
def _tile_coords(M, N_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """First row and column of this program's output tile, in grouped order
    (GROUP_M row tiles share each column tile while it is in L2)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _epilogue(acc, acc_up, offs_m, offs_n, M, N_OUT, HALF, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, stride_rm,
              stride_om, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr):
    """bias -> activation (SwiGLU from the gate/up pair) -> residual -> store.
    An FP8 OUT_DTYPE casts with the scale in ``fp8_state[0]`` (fp32 bits) and
    reduces the amax of the fp32 result into ``fp8_state[1]`` (int32 bits of |out|);
    with a ROUND_TO dtype the result is first rounded to it (still in fp32), so the
    cast and the amax are those of the rounded tensor. The accumulator's MMA layout
    is not the store's, so the FP8 bytes change layout before the store: with HW_FP8
    they come from the hardware conversion one per int32 lane (MOVED)."""
    n_ok = offs_n < N_OUT
    mask = (offs_m[:, None] < M) & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION == 4:
            acc_up += tl.load(bias_ptr + HALF + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 4:
        out = silu(acc) * acc_up
    else:
        out = apply_activation(acc, ACTIVATION)
    if HAS_RESIDUAL:
        out += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if OUT_DTYPE == tl.float8e4nv or OUT_DTYPE == tl.float8e5:
        if ROUND_TO is not None:
            out = round_through(out, ROUND_TO)
        scale = tl.load(fp8_state_ptr).to(tl.float32, bitcast=True)
        tl.store(out_ptrs, fp8_bytes_as(out * scale, OUT_DTYPE, HW_FP8, MOVED=True), mask=mask)
        tile_amax = tl.max(tl.max(tl.where(mask, abs_bits(out), 0), axis=1), axis=0)
        tl.atomic_max(fp8_state_ptr + 1, tile_amax)
    else:
        tl.store(out_ptrs, to_output(out, OUT_DTYPE), mask=mask)


# ------------------------------------------------------------ tensor / row


@triton.jit
def _fp8_gemm_tensorwise_kernel(
        a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K, HALF,
        stride_am, stride_bn, stride_rm, stride_om,
        SCALED: tl.constexpr, A_ROW_SCALES: tl.constexpr, B_ROW_SCALES: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr, INPUT_PRECISION: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
        UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """a (M, K) @ b (N, K).T with one scale per tensor or per row, applied after
    the fp32 accumulation (they are constant along K)."""
    GATED: tl.constexpr = ACTIVATION == 4
    m0, n0 = _tile_coords(M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M  # wrapped rows are computed and never stored
    rows_b = offs_n % N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = load_k_tile(a_src, m0, rows_a, k0, K, stride_am, offs_k, USE_TMA)
        b = load_k_tile(b_src, n0, rows_b, k0, K, stride_bn, offs_k, USE_TMA)
        if UPCAST:  # the interpreter multiplies bf16 as raw bits: widen first (exact)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION, max_num_imprecise_acc=PROMOTE_EVERY)
        if GATED:
            b_up = load_k_tile(b_src, HALF + n0, HALF + rows_b, k0, K, stride_bn, offs_k, USE_TMA)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, tl.trans(b_up), acc_up, input_precision=INPUT_PRECISION,
                            max_num_imprecise_acc=PROMOTE_EVERY)
    if SCALED:
        sa = tl.load(sa_ptr + rows_a)[:, None] if A_ROW_SCALES else tl.load(sa_ptr)
        sb = tl.load(sb_ptr + rows_b)[None, :] if B_ROW_SCALES else tl.load(sb_ptr)
        acc = acc * sa * sb
        if GATED:
            sb_up = tl.load(sb_ptr + HALF + rows_b)[None, :] if B_ROW_SCALES else tl.load(sb_ptr)
            acc_up = acc_up * sa * sb_up
    _epilogue(acc, acc_up, offs_m, offs_n, M, N_OUT, HALF, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, stride_rm,
              stride_om, HAS_BIAS, ACTIVATION, HAS_RESIDUAL, OUT_DTYPE, HW_FP8, ROUND_TO)


# ------------------------------------------------------------ block scaling


@triton.jit
def _blockwise_partial(a, b_src, n0, rows_b, sa, sb_ptrs, k0, K, stride_bn, offs_k, B_SCALAR: tl.constexpr,
                       USE_TMA: tl.constexpr):
    """One 128-deep block of a @ b.T, a fresh fp32 product promoted with its scales
    (B_SCALAR: the tile's columns share one B scale, ``sb_ptrs`` is one pointer)."""
    b = load_k_tile(b_src, n0, rows_b, k0, K, stride_bn, offs_k, USE_TMA)
    partial = tl.dot(a, tl.trans(b))
    sb = tl.load(sb_ptrs + k0 // 128)
    if B_SCALAR:
        return partial * (sa * sb)[:, None]
    else:
        return partial * sa[:, None] * sb[None, :]


@triton.jit
def _fp8_gemm_blockwise_body(
        a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K, HALF,
        stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om, B_TILE_ROWS: tl.constexpr,
        B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """a: 1x128 scales (M, K/128); b: 1x128 (N, K/128) or 128x128 (N/128, K/128).
    B_SCALAR: 128x128 B tiles and output tiles inside one of them (one B scale)."""
    BLOCK_K: tl.constexpr = 128
    GATED: tl.constexpr = ACTIVATION == 4
    m0, n0 = _tile_coords(M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M
    rows_b = offs_n % N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    sa_ptrs = sa_ptr + rows_a * stride_sam
    if B_SCALAR:
        sb_ptrs = sb_ptr + (n0 // 128) * stride_sbn
        sb_up_ptrs = sb_ptr + ((HALF + n0) // 128) * stride_sbn
    else:
        sb_ptrs = sb_ptr + (rows_b // B_TILE_ROWS) * stride_sbn
        sb_up_ptrs = sb_ptr + ((HALF + rows_b) // B_TILE_ROWS) * stride_sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = load_k_tile(a_src, m0, rows_a, k0, K, stride_am, offs_k, USE_TMA)
        sa = tl.load(sa_ptrs + k0 // BLOCK_K)
        acc += _blockwise_partial(a, b_src, n0, rows_b, sa, sb_ptrs, k0, K, stride_bn, offs_k, B_SCALAR, USE_TMA)
        if GATED:
            acc_up += _blockwise_partial(a, b_src, HALF + n0, HALF + rows_b, sa, sb_up_ptrs, k0, K, stride_bn,
                                         offs_k, B_SCALAR, USE_TMA)
    _epilogue(acc, acc_up, offs_m, offs_n, M, N_OUT, HALF, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, stride_rm,
              stride_om, HAS_BIAS, ACTIVATION, HAS_RESIDUAL, OUT_DTYPE, HW_FP8, ROUND_TO)


@triton.jit
def _fp8_gemm_blockwise_1x128_128x128_kernel(
        a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K, HALF,
        stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om,
        B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    _fp8_gemm_blockwise_body(a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K,
                             HALF, stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om, 128, B_SCALAR,
                             HAS_BIAS, ACTIVATION, HAS_RESIDUAL, OUT_DTYPE, HW_FP8, ROUND_TO, USE_TMA, BLOCK_M,
                             BLOCK_N, GROUP_M)


@triton.jit
def _fp8_gemm_blockwise_1x128_1x128_kernel(
        a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K, HALF,
        stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om,
        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
        HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    _fp8_gemm_blockwise_body(a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K,
                             HALF, stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om, 1, False,
                             HAS_BIAS, ACTIVATION, HAS_RESIDUAL, OUT_DTYPE, HW_FP8, ROUND_TO, USE_TMA, BLOCK_M,
                             BLOCK_N, GROUP_M)


# ------------------------------------------------------------------ MXFP8


@triton.jit
def _mx_scaled_tile(q, s, IS_E4M3: tl.constexpr, DOT_DTYPE: tl.constexpr, DECODE_SPECIALS: tl.constexpr):
    """(R, BLOCK_K) FP8 tile times its E8M0 scales (R, BLOCK_K / 32), exactly, in
    DOT_DTYPE. DECODE_SPECIALS: decode NaN/inf explicitly (the interpreter's FP8
    conversion does not; the GPU's does)."""
    R: tl.constexpr = q.shape[0]
    BLOCK_K: tl.constexpr = q.shape[1]
    if DECODE_SPECIALS:
        v = fp8_to_float(q, IS_E4M3)
    else:
        v = q.to(tl.float32)
    v = tl.reshape(v, (R, BLOCK_K // 32, 32)) * e8m0_value(s.to(tl.int32))[:, :, None]  # (R, groups, 32)
    return tl.reshape(v, (R, BLOCK_K)).to(DOT_DTYPE)


@triton.jit
def _mx_partial(a, sa, b_src, n0, rows_b, sb_ptrs, k0, K, stride_bn, offs_k, s_ok,
                A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr, DOT_SCALED: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DECODE_SPECIALS: tl.constexpr, USE_TMA: tl.constexpr):
    """a @ b.T for one BLOCK_K slice: ``tl.dot_scaled``, or the same products from
    tiles scaled in registers (FP8 times a power of two is exact in bf16)."""
    b = load_k_tile(b_src, n0, rows_b, k0, K, stride_bn, offs_k, USE_TMA)
    sb = tl.load(sb_ptrs, mask=s_ok, other=127)
    if DOT_SCALED:
        return tl.dot_scaled(a, sa, A_FORMAT, tl.trans(b), sb, B_FORMAT)
    else:
        a_hp = _mx_scaled_tile(a, sa, A_FORMAT == "e4m3", DOT_DTYPE, DECODE_SPECIALS)
        b_hp = _mx_scaled_tile(b, sb, B_FORMAT == "e4m3", DOT_DTYPE, DECODE_SPECIALS)
        return tl.dot(a_hp, tl.trans(b_hp), input_precision="ieee")


@triton.jit
def _mxfp8_gemm_kernel(
        a_src, b_src, sa_ptr, sb_ptr, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, M, N_OUT, K, HALF,
        stride_am, stride_bn, stride_sam, stride_sbn, stride_rm, stride_om,
        A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr, DOT_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
        DECODE_SPECIALS: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, ROUND_TO: tl.constexpr,
        USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    """MXFP8 x MXFP8: E8M0 scales (uint8) per 32 along K on both sides."""
    GATED: tl.constexpr = ACTIVATION == 4
    GROUPS: tl.constexpr = BLOCK_K // 32
    m0, n0 = _tile_coords(M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M
    rows_b = offs_n % N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        groups = k0 // 32 + offs_g
        s_ok = groups[None, :] < K // 32
        a = load_k_tile(a_src, m0, rows_a, k0, K, stride_am, offs_k, USE_TMA)
        sa = tl.load(sa_ptr + rows_a[:, None] * stride_sam + groups[None, :], mask=s_ok, other=127)
        sb_ptrs = sb_ptr + rows_b[:, None] * stride_sbn + groups[None, :]
        acc += _mx_partial(a, sa, b_src, n0, rows_b, sb_ptrs, k0, K, stride_bn, offs_k, s_ok,
                           A_FORMAT, B_FORMAT, DOT_SCALED, DOT_DTYPE, DECODE_SPECIALS, USE_TMA)
        if GATED:
            acc_up += _mx_partial(a, sa, b_src, HALF + n0, HALF + rows_b, sb_ptrs + HALF * stride_sbn, k0, K,
                                  stride_bn, offs_k, s_ok, A_FORMAT, B_FORMAT, DOT_SCALED, DOT_DTYPE,
                                  DECODE_SPECIALS, USE_TMA)
    _epilogue(acc, acc_up, offs_m, offs_n, M, N_OUT, HALF, bias_ptr, res_ptr, out_ptr, fp8_state_ptr, stride_rm,
              stride_om, HAS_BIAS, ACTIVATION, HAS_RESIDUAL, OUT_DTYPE, HW_FP8, ROUND_TO)


# --------------------------------------------------------------- launcher


@dataclass(frozen=True)
class _Epilogue:
    """The checked epilogue of one GEMM call."""

    bias: torch.Tensor | None
    residual: torch.Tensor | None
    activation: int
    n_out: int
    half: int
    out_dtype: torch.dtype
    fp8_state: torch.Tensor | None = None  # FP8 output: int32 [scale bits, amax bits]
    round_to: torch.dtype | None = None  # FP8 output: the dtype the result is rounded to before the cast


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True


# Tuning hook for the benchmarks: kernel family ("tensor", "block", "mx", "plain")
# -> Tiles used instead of the defaults below. Empty in normal use.
TILE_OVERRIDES: dict[str, Tiles] = {}


def _tiles(device: torch.device, family: str, m: int, n_out: int, k: int, gated: bool) -> Tiles:
    """Tile shapes: small ones for the interpreter, Hopper-sized ones on a GPU.
    Below ~8 GFLOP the host's launch cost exceeds the GPU time, so those GEMMs
    skip the TMA descriptors (about 20 us of host time per call)."""
    if family in TILE_OVERRIDES:
        return TILE_OVERRIDES[family]
    block_k = 128 if family in ("block", "mx") else 64
    if device.type == "cpu":
        return Tiles(32, 32, block_k if family != "plain" else 32, 4, 4, 1, use_tma=False)
    use_tma = 2 * m * n_out * k >= 2**33
    if family == "plain":
        return Tiles(128, 128, 64, 8, 8, 3, use_tma)
    if family == "tensor" and not gated and m * n_out > 1024 * 1024:
        return Tiles(256, 128, 128, 8, 8, 3, use_tma)  # the fastest measured on an H200 (RESULTS.md)
    if family == "mx" and not gated and m * n_out > 1024 * 1024:
        return Tiles(128, 256, 128, 8, 8, 3, use_tma)  # 307 against 275 TFLOP/s at 128x128 (H200, 8192^3)
    return Tiles(128, 128, 128, 8, 8, 3 if (gated or family == "mx") else 4, use_tma)


def _check_epilogue(bias, residual, activation, out_dtype, m, n, device, fp8_state=None, round_to=None) -> _Epilogue:
    if out_dtype not in (TL_FP8 if fp8_state is not None else TL_FLOAT):
        raise ValueError(f"gemm: out_dtype must be one of {list(TL_FLOAT)}, got {out_dtype}")
    code = activation_code(activation)
    check_epilogue_activation(activation)
    n_out = n
    if code == 4:
        if n % 2:
            raise ValueError(f"gemm: swiglu needs an even number of output columns, b has {n} rows")
        n_out = n // 2
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (n,) or bias.device != device:
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"gemm: bias must be a ({n},) tensor on {device}, got {got}")
        bias = bias.contiguous()
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != (m, n_out) or residual.device != device:
            got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise ValueError(f"gemm: residual must be a ({m}, {n_out}) tensor on {device}, got {got}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    if round_to is not None and round_to not in TL_FLOAT:
        raise ValueError(f"gemm_fp8_out: round_to must be None or one of {list(TL_FLOAT)}, got {round_to}")
    round_to = None if round_to is torch.float32 else round_to
    return _Epilogue(bias, residual, code, n_out, n // 2 if code == 4 else 0, out_dtype, fp8_state, round_to)


def _operand_matrix(op, name: str) -> torch.Tensor:
    if isinstance(op, ScaledOperand):
        return op.data
    if isinstance(op, torch.Tensor):
        if op.dim() != 2:
            raise ValueError(f"gemm: {name} must be 2-D (rows, K), got shape {tuple(op.shape)}")
        if op.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"gemm: plain operand {name} must be bf16, fp16 or fp32, got {op.dtype}")
        return op
    raise TypeError(f"gemm: {name} must be a ScaledOperand or a torch.Tensor, got {type(op).__name__}")


def _k_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _tma_ok(*mats: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row pitches."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in mats)


def _sources(a: torch.Tensor, b: torch.Tensor, t: Tiles) -> tuple[object, object, bool]:
    """The operands as TMA descriptors when the tiles ask for it and they allow it."""
    if t.use_tma and _tma_ok(a, b):
        return (TensorDescriptor.from_tensor(a, [t.block_m, t.block_k]),
                TensorDescriptor.from_tensor(b, [t.block_n, t.block_k]), True)
    return a, b, False


def _launch_common(epi: _Epilogue, out: torch.Tensor, dummy: torch.Tensor) -> tuple[list, dict]:
    res = epi.residual
    fp8 = epi.fp8_state is not None
    args = [epi.bias if epi.bias is not None else dummy, res if res is not None else dummy,
            out.view(torch.uint8) if fp8 else out, epi.fp8_state if fp8 else dummy]
    meta = dict(HAS_BIAS=epi.bias is not None, ACTIVATION=epi.activation, HAS_RESIDUAL=res is not None,
                OUT_DTYPE=(TL_FP8 if fp8 else TL_FLOAT)[epi.out_dtype], HW_FP8=fp8 and hw_fp8(out),
                ROUND_TO=None if epi.round_to is None else TL_FLOAT[epi.round_to])
    return args, dict(stride_rm=res.stride(0) if res is not None else 0, stride_om=out.stride(0), **meta)


def _grid(m: int, epi: _Epilogue, t: Tiles) -> tuple[int]:
    return (cdiv(m, t.block_m) * cdiv(epi.n_out, t.block_n),)


def _gemm_tensorwise(a, b, sa, sb, epi: _Epilogue, out: torch.Tensor, kind: tuple[str, str],
                     fast_accum: bool = False) -> None:
    """tensor/row scaled FP8 operands, or plain ones (``sa``/``sb`` None)."""
    m, k = a.shape
    t = _tiles(a.device, "tensor" if sa is not None else "plain", m, epi.n_out, k, epi.activation == 4)
    args, meta = _launch_common(epi, out, a)
    upcast = a.dtype == torch.bfloat16 and is_interpreted(a)
    precision = "ieee" if (a.dtype == torch.float32 or upcast) else None
    # FP8 products reach the fp32 accumulator every 128 of them (or every block, if
    # shorter), whatever the tile's depth: a 256-deep tile promotes twice per block
    promote = min(t.block_k, 128) if (a.dtype.itemsize == 1 and k >= t.block_k and not fast_accum) else None
    a_src, b_src, use_tma = _sources(a, b, t)
    launch(_fp8_gemm_tensorwise_kernel, _grid(m, epi, t),
        a_src, b_src, sa if sa is not None else out, sb if sb is not None else out, *args, m, epi.n_out, k,
        epi.half, a.stride(0), b.stride(0), SCALED=sa is not None, A_ROW_SCALES=kind[0] == Scaling.ROW,
        B_ROW_SCALES=kind[1] == Scaling.ROW, INPUT_PRECISION=precision, PROMOTE_EVERY=promote, UPCAST=upcast,
        USE_TMA=use_tma, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages, **meta)


def _gemm_blockwise(a: ScaledOperand, b: ScaledOperand, epi: _Epilogue, out: torch.Tensor) -> None:
    m, k = a.data.shape
    t = _tiles(a.data.device, "block", m, epi.n_out, k, epi.activation == 4)
    if t.block_k != 128:
        raise ValueError(f"gemm: block-scaled GEMMs need block_k == 128, got {t.block_k}")
    args, meta = _launch_common(epi, out, a.data)
    kernel = (_fp8_gemm_blockwise_1x128_128x128_kernel if b.scaling == Scaling.BLOCK_128X128
              else _fp8_gemm_blockwise_1x128_1x128_kernel)
    a_data, b_data = _k_major(a.data), _k_major(b.data)
    sa, sb = a.scale_inv.contiguous(), b.scale_inv.contiguous()
    a_src, b_src, use_tma = _sources(a_data, b_data, t)
    extra = {}
    if b.scaling == Scaling.BLOCK_128X128:  # one B scale per output tile when tiles nest in B's 128-row tiles
        extra["B_SCALAR"] = 128 % t.block_n == 0 and epi.half % 128 == 0
    kernel[_grid(m, epi, t)](
        a_src, b_src, sa, sb, *args, m, epi.n_out, k, epi.half, a_data.stride(0), b_data.stride(0),
        sa.stride(0), sb.stride(0), USE_TMA=use_tma, **extra, BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages, **meta)


# MXFP8 products through tl.dot_scaled (True) or through tiles scaled in registers
# and a bf16 dot (False); both exact. On an H200 with triton 3.6 the second ran
# 2.4x faster at 8192^3 (271 against 111 TFLOP/s, benchmarks/RESULTS.md).
MXFP8_DOT_SCALED = False


def _gemm_mxfp8(a: ScaledOperand, b: ScaledOperand, epi: _Epilogue, out: torch.Tensor) -> None:
    m, k = a.data.shape
    if k % 32:
        raise ValueError(f"gemm: MXFP8 operands need K % 32 == 0, got K={k}")
    t = _tiles(a.data.device, "mx", m, epi.n_out, k, epi.activation == 4)
    args, meta = _launch_common(epi, out, a.data)
    a_data, b_data = _k_major(a.data), _k_major(b.data)
    sa, sb = a.scale_inv.contiguous(), b.scale_inv.contiguous()
    a_src, b_src, use_tma = _sources(a_data, b_data, t)
    launch(_mxfp8_gemm_kernel, _grid(m, epi, t),
        a_src, b_src, sa, sb, *args, m, epi.n_out, k, epi.half, a_data.stride(0), b_data.stride(0),
        sa.stride(0), sb.stride(0), A_FORMAT=_FP8_NAMES[a.fp8_dtype], B_FORMAT=_FP8_NAMES[b.fp8_dtype],
        DOT_SCALED=MXFP8_DOT_SCALED, DOT_DTYPE=tl.float32 if is_interpreted(a_data) else tl.bfloat16,
        DECODE_SPECIALS=is_interpreted(a_data),
        USE_TMA=use_tma, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages, **meta)


def _pair(a, b) -> str:
    """Which kernel a pair of operands goes to."""
    sa = a.scaling if isinstance(a, ScaledOperand) else "plain"
    sb = b.scaling if isinstance(b, ScaledOperand) else "plain"
    if sa in (Scaling.TENSOR, Scaling.ROW) and sb in (Scaling.TENSOR, Scaling.ROW):
        return "tensorwise"
    if sa == Scaling.BLOCK_1X128 and sb in (Scaling.BLOCK_1X128, Scaling.BLOCK_128X128):
        return "blockwise"
    if sa == Scaling.MX_32 and sb == Scaling.MX_32:
        return "mxfp8"
    if sa == "plain" and sb == "plain":
        return "plain"
    return "dequantized"


def _checked_operands(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    a_mat, b_mat = _operand_matrix(a, "a"), _operand_matrix(b, "b")
    if a_mat.shape[1] != b_mat.shape[1]:
        raise ValueError(f"gemm: reduction dims differ: a is {tuple(a_mat.shape)}, b is {tuple(b_mat.shape)}")
    if a_mat.device != b_mat.device:
        raise ValueError(f"gemm: a is on {a_mat.device} but b is on {b_mat.device}")
    for op in (a, b):
        if isinstance(op, ScaledOperand):
            fp8_format(op.fp8_dtype)
    return a_mat, b_mat


def _run(a, b, a_mat: torch.Tensor, b_mat: torch.Tensor, epi: _Epilogue, out: torch.Tensor,
         fast_accum: bool = False) -> None:
    """Launch the kernel for this pair of operands into ``out``."""
    if out.numel() == 0:
        return
    if a_mat.shape[1] == 0:
        a, b = a_mat.float(), b_mat.float()  # an empty reduction: the epilogue of zeros
    pair = _pair(a, b)
    if pair == "tensorwise":
        _gemm_tensorwise(_k_major(a.data), _k_major(b.data), a.scale_inv.reshape(-1), b.scale_inv.reshape(-1),
                         epi, out, (a.scaling, b.scaling), fast_accum)
    elif pair == "blockwise":
        _gemm_blockwise(a, b, epi, out)
    elif pair == "mxfp8":
        _gemm_mxfp8(a, b, epi, out)
    else:
        a_hp, b_hp = _high_precision_pair(a, b, pair)
        _gemm_tensorwise(a_hp, b_hp, None, None, epi, out, ("plain", "plain"))


def gemm(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``activation(a (P, R) @ b (Q, R).T + bias (Q,)) + residual (P, Q')``, fp32
    accumulation, cast to ``out_dtype``; ``swiglu`` halves the columns (Q' = Q/2).
    ``fast_accum``: tensor- and row-scaled products are promoted to fp32 once, at
    the end of the K loop, instead of every BLOCK_K products."""
    a_mat, b_mat = _checked_operands(a, b)
    m, n = a_mat.shape[0], b_mat.shape[0]
    epi = _check_epilogue(bias, residual, activation, out_dtype, m, n, a_mat.device)
    out = torch.empty((m, epi.n_out), dtype=out_dtype, device=a_mat.device)
    _run(a, b, a_mat, b_mat, epi, out, fast_accum)
    return out


def gemm_fp8_out(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    out_scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    round_to: torch.dtype | None = None,
    fast_accum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gemm` whose epilogue also casts: returns ``(out (P, Q') in fp8_dtype,
    amax)``, where ``out`` is the saturating cast of the fp32 result times the 0-d
    fp32 ``out_scale`` and ``amax`` the max of |fp32 result| (a 0-d tensor, or
    ``amax_out`` filled), as ``quantize_tensorwise`` of ``gemm(..., torch.float32)``
    would give in a second pass. With ``round_to`` (bf16, fp16), the result is
    rounded to that dtype first: the cast and amax of ``gemm(..., round_to)``."""
    a_mat, b_mat = _checked_operands(a, b)
    fp8_format(fp8_dtype)
    if not isinstance(out_scale, torch.Tensor) or out_scale.numel() != 1 or out_scale.dtype != torch.float32:
        raise ValueError("gemm_fp8_out: out_scale must be a one-element float32 tensor")
    if out_scale.device != a_mat.device:
        raise ValueError(f"gemm_fp8_out: out_scale is on {out_scale.device} but a is on {a_mat.device}")
    state = torch.zeros(2, dtype=torch.int32, device=a_mat.device)  # scale bits, amax bits
    state[0] = out_scale.reshape(()).view(torch.int32)
    m, n = a_mat.shape[0], b_mat.shape[0]
    epi = _check_epilogue(bias, residual, activation, fp8_dtype, m, n, a_mat.device, state, round_to)
    out = torch.empty((m, epi.n_out), dtype=fp8_dtype, device=a_mat.device)
    _run(a, b, a_mat, b_mat, epi, out, fast_accum)
    amax = state[1:].view(torch.float32).reshape(())
    if amax_out is not None:
        return out, amax_out.copy_(amax.reshape(amax_out.shape))
    return out, amax


def _high_precision_pair(a, b, pair: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands as K-major tensors of one high-precision dtype."""
    if pair == "plain" and a.dtype == b.dtype:
        return _k_major(a), _k_major(b)
    a_hp = dequantize(a, torch.float32) if isinstance(a, ScaledOperand) else a.float()
    b_hp = dequantize(b, torch.float32) if isinstance(b, ScaledOperand) else b.float()
    return _k_major(a_hp), _k_major(b_hp)
