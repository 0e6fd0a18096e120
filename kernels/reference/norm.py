"""Reference RMSNorm forward and backward over the last dim, in fp32.

``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row. The
backward recomputes the normalisation in fp32 from the saved input and
differentiates it with autograd, so forward and backward numerics live in one
place (torch's ``rms_norm``).
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
    with torch.enable_grad():
        x32 = x.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(True)
        y = torch.nn.functional.rms_norm(x32, (x.shape[1],), w32, eps)
        dx, dw = torch.autograd.grad(y, [x32, w32], dy.float())
    return dx.to(x.dtype), dw
