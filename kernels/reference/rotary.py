"""Rotary position embedding (RoPE) of the leading heads of a (B, T, heads, D) tensor.

The "rotate half" form: with ``cos`` and ``sin`` (T, D) tables whose two halves
repeat the same angles (``te_fuser.ops.RotaryEmbedding`` builds them),

    y = x · cos + rotate_half(x) · sin,   rotate_half(x) = (-x[D/2:], x[:D/2])

for the first ``rotated_heads`` heads (the query and key heads of a fused QKV
tensor), the other heads (the value heads) copied; ``inverse`` rotates by the
opposite angle (the backward). Each product and the sum round in fp32 (float64
for float64 input), the result rounds once to ``out_dtype``. ``in_place``: the
rotated heads are written back into ``x`` (contiguous, already ``out_dtype``),
which is returned; the other heads are neither read nor written (the same bits
as the copy).
"""

from __future__ import annotations

import torch

__all__ = ["rotary_reference", "check_rotary"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place: bool = False) -> None:
    """The checks every backend runs before a rotary launch (``ValueError`` naming the argument)."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rotary: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 4 or x.dtype not in _FLOATS:
        raise ValueError(f"rotary: x must be a (B, T, heads, D) float tensor, got {tuple(x.shape)} {x.dtype}")
    B, T, heads, D = x.shape
    if D % 2:
        raise ValueError(f"rotary: the head dim must be even (the rotation pairs its halves), got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (T, D) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"rotary: {name} must be a ({T}, {D}) float32 table on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if isinstance(rotated_heads, bool) or not isinstance(rotated_heads, int) or not 0 <= rotated_heads <= heads:
        raise ValueError(f"rotary: rotated_heads must be an integer in [0, {heads}], got {rotated_heads!r}")
    if not isinstance(inverse, bool):
        raise ValueError(f"rotary: inverse must be a bool, got {inverse!r}")
    if out_dtype not in _FLOATS:
        raise ValueError(f"rotary: out_dtype must be one of {[str(d) for d in _FLOATS]}, got {out_dtype}")
    if in_place and (out_dtype != x.dtype or not x.is_contiguous()):
        raise ValueError(f"rotary(in_place=True): x must be contiguous and of out_dtype {out_dtype}, got "
                         f"{x.dtype}{'' if x.is_contiguous() else ', not contiguous'}")


def rotary_reference(x, cos, sin, rotated_heads, inverse, out_dtype, in_place: bool = False):
    """``y`` (B, T, heads, D) in ``out_dtype``: the leading ``rotated_heads`` heads
    rotated (into ``x`` itself when ``in_place``)."""
    check_rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(compute)[:, None, :]  # (T, 1, D)
    s = (-sin if inverse else sin).to(compute)[:, None, :]
    q = x[:, :, :rotated_heads].to(compute)  # (B, T, rotated, D)
    half = x.shape[-1] // 2
    y = q * c + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * s
    if in_place:
        x[:, :, :rotated_heads] = y.to(out_dtype)
        return x
    return torch.cat([y, x[:, :, rotated_heads:].to(compute)], dim=2).to(out_dtype)
