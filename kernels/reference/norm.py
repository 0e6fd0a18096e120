"""Reference RMSNorm forward and backward over the last dim, in fp32.

``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row. The
backward recomputes ``rstd`` in fp32 from the saved input and applies the
gradient's closed form (no autograd: it also runs inside custom ops, below it):

    dweight = sum_rows(dy * x * rstd)
    dx      = rstd * (dy * weight) - x * rstd**3 * mean(dy * weight * x)
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm_reference", "rms_norm_grad_reference"]


def _check(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{kernel}: x must be 2-D (rows, N), got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{kernel}: weight must have shape ({x.shape[1]},), got {tuple(weight.shape)}")


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y (rows, N) in out_dtype (default x.dtype), rstd (rows,) fp32)`` for x (rows, N)."""
    _check(x, weight, "rms_norm")
    x32 = x.float()
    y = torch.nn.functional.rms_norm(x32, (x.shape[1],), weight.float(), eps)
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return y.to(out_dtype or x.dtype), rstd


def rms_norm_grad_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx (rows, N) in x.dtype, dweight (N,) fp32)``; ``rstd`` is the forward's
    (the fast backends read it; this one recomputes everything from ``x``)."""
    _check(x, weight, "rms_norm_grad")
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm_grad: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    x32, g = x.float(), dy.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (rows, 1)
    dw = (g * x32 * r).sum(0)
    gw = g * weight.float()
    dx = r * gw - x32 * r.pow(3) * (gw * x32).mean(-1, keepdim=True)
    return dx.to(x.dtype), dw
