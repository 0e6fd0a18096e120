"""Rotary position embedding in one pass: ``rotary`` (the contract of
:func:`te_fuser.kernels.reference.rotary_reference`), bit for bit the reference
(a zero result may carry the other sign).

One program per token and block of heads: it loads the token's cos/sin row once
and both halves of each head, rotates the leading ``rotated_heads`` heads, copies
the others and writes the token's row of the output. In place, the programs
cover the rotated heads only and write them back where they read them. The products and the sum
round in fp32 as in the reference: the launch turns off the compiler's fusion of
a multiply and an add into one rounding (``enable_fp_fusion=False``). Float64
goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.rotary import check_rotary
from ._launch import launch
from ._common import TL_FLOAT, cdiv, check_input, is_interpreted, next_power_of_2, to_output

__all__ = ["rotary", "rotary_unsupported_reason"]


@triton.jit
def _rotary_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, T, heads, rotated_heads, covered, sign,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, OUT_DTYPE: tl.constexpr):
    row = tl.program_id(0)  # the token (b, t)
    t = row % T
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    h_ok = offs_h < covered  # every head, or the rotated ones alone (in place)
    base = row.to(tl.int64) * heads * (2 * HALF)
    first = base + offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # (BLOCK_H, HALF): the first halves
    x1 = tl.load(x_ptr + first, mask=h_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + HALF, mask=h_ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * (2 * HALF) + offs_d)[None, :]  # the halves of a row repeat the same angles
    s = tl.load(sin_ptr + t * (2 * HALF) + offs_d)[None, :] * sign
    rotate = (offs_h < rotated_heads)[:, None]
    y1 = tl.where(rotate, x1 * c + (-x2) * s, x1)
    y2 = tl.where(rotate, x2 * c + x1 * s, x2)
    tl.store(y_ptr + first, to_output(y1, OUT_DTYPE), mask=h_ok[:, None])
    tl.store(y_ptr + first + HALF, to_output(y2, OUT_DTYPE), mask=h_ok[:, None])


def rotary_unsupported_reason(x: torch.Tensor, cos: torch.Tensor) -> str | None:
    """Why :func:`rotary` would not run ``x`` (None: it runs)."""
    if x.dtype not in TL_FLOAT:
        return f"the triton rotary kernel takes bf16, fp16 or fp32, not {x.dtype}"
    half = x.shape[-1] // 2 if x.dim() == 4 else 0
    if half < 1 or half & (half - 1):
        return f"the triton rotary kernel takes head dims of twice a power of two, not {x.shape[-1] if x.dim() else 0}"
    return None


def rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place: bool = False):
    """RoPE as :func:`rotary_reference`, in one pass over ``x`` (over its rotated
    heads alone, written back into ``x``, when ``in_place``)."""
    check_rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place)
    reason = rotary_unsupported_reason(x, cos)
    if reason is not None or out_dtype not in TL_FLOAT:
        raise ValueError(f"rotary: {reason or f'out_dtype {out_dtype} is not bf16, fp16 or fp32'}")
    check_input(x, "rotary", dims=4)
    B, T, heads, D = x.shape
    x = x.contiguous()
    interpreted = is_interpreted(x)
    # the interpreter's own bf16 conversion is not trusted: there the kernel stores
    # fp32 and torch rounds it (to_output already rounds bf16 exactly on the GPU)
    store = torch.float32 if interpreted and out_dtype == torch.float16 else out_dtype
    if in_place and store != out_dtype:  # fp16 under the interpreter: the copy, then back into x
        return x.copy_(rotary(x, cos, sin, rotated_heads, inverse, out_dtype))
    y = x if in_place else torch.empty((B, T, heads, D), dtype=store, device=x.device)
    covered = rotated_heads if in_place else heads
    if y.numel() and covered:
        block_h = min(next_power_of_2(covered), max(1, 2048 // D))
        options = {} if interpreted else {"enable_fp_fusion": False}
        launch(_rotary_kernel, (B * T, cdiv(covered, block_h)),
            x, y, cos.contiguous(), sin.contiguous(), T, heads, rotated_heads, covered, -1.0 if inverse else 1.0,
            HALF=D // 2, BLOCK_H=block_h, OUT_DTYPE=TL_FLOAT[store], num_warps=4, **options)
    return y if y.dtype == out_dtype else y.to(out_dtype)
