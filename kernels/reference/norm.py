"""Reference LayerNorm and RMSNorm, forward and backward over the last dim, in fp32.

LayerNorm: ``y = (x - mean) * rstd * weight + bias`` with ``rstd = 1 / sqrt(var +
eps)`` per row (the biased variance), as torch's own fp32 kernels compute it
(``native_layer_norm`` and ``native_layer_norm_backward``, which reads the
forward's mean and rstd), each operand taken to fp32 first and the result rounded
once to its dtype.

RMSNorm: ``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` per
row. The backward recomputes ``rstd`` in fp32 from the saved input and applies the
gradient's closed form (no autograd: it also runs inside custom ops, below it):

    dweight = sum_rows(dy * x * rstd)
    dx      = rstd * (dy * weight) - x * rstd**3 * mean(dy * weight * x)
"""

from __future__ import annotations

import torch

__all__ = ["layer_norm_reference", "layer_norm_grad_reference", "rms_norm_reference", "rms_norm_grad_reference",
           "check_layer_norm"]


def _check(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{kernel}: x must be 2-D (rows, N), got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{kernel}: weight must have shape ({x.shape[1]},), got {tuple(weight.shape)}")


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 else t.float()


def check_layer_norm(x: torch.Tensor, weight: torch.Tensor, kernel: str, mean=None, rstd=None) -> None:
    """Raise naming the argument unless x is (rows, N), weight (N,) and the statistics
    (when given) fp32 (rows,): the checks every backend's LayerNorm runs first."""
    _check(x, weight, kernel)
    for name, stat in (("mean", mean), ("rstd", rstd)):
        if stat is not None and (stat.shape != (x.shape[0],) or stat.dtype != torch.float32):
            raise ValueError(f"{kernel}: {name} must be float32 of shape ({x.shape[0]},), "
                             f"got {stat.dtype} {tuple(stat.shape)}")


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y (rows, N) in out_dtype (default x.dtype), mean (rows,), rstd (rows,))``
    for x (rows, N), weight and bias (N,); the statistics in fp32."""
    check_layer_norm(x, weight, "layer_norm")
    if bias.shape != weight.shape:
        raise ValueError(f"layer_norm: bias must have shape {tuple(weight.shape)}, got {tuple(bias.shape)}")
    y, mean, rstd = torch.native_layer_norm(_fp32(x), (x.shape[1],), _fp32(weight), _fp32(bias), eps)
    out_dtype = out_dtype or x.dtype
    return (y if y.dtype is out_dtype else y.to(out_dtype)), mean.reshape(-1), rstd.reshape(-1)


def check_grad_add(grad_add, x: torch.Tensor, kernel: str) -> None:
    """``grad_add`` (when given) is a float tensor of x's shape on x's device."""
    if grad_add is None:
        return
    if not isinstance(grad_add, torch.Tensor):
        raise TypeError(f"{kernel}: grad_add must be a tensor or None, got {type(grad_add).__name__}")
    if grad_add.shape != x.shape or not grad_add.dtype.is_floating_point or grad_add.device != x.device:
        raise ValueError(f"{kernel}: grad_add must be a float tensor of x's shape {tuple(x.shape)} on {x.device}, "
                         f"got {grad_add.dtype} {tuple(grad_add.shape)} on {grad_add.device}")


def layer_norm_grad_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    grad_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx (rows, N) in x.dtype, dweight (N,), dbias (N,))`` from the forward's
    ``mean`` and ``rstd``; the parameter gradients in fp32. With ``grad_add`` (x's
    shape: the gradient of another use of x), dx is the norm's gradient plus it,
    added in fp32 and rounded once to x's dtype."""
    check_layer_norm(x, weight, "layer_norm_grad", mean, rstd)
    if dy.shape != x.shape:
        raise ValueError(f"layer_norm_grad: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    check_grad_add(grad_add, x, "layer_norm_grad")
    w32 = _fp32(weight)
    # the bias does not enter the gradient: torch reads only its shape and dtype, for dbias
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        _fp32(dy).contiguous(), _fp32(x), (x.shape[1],), mean.reshape(-1, 1), rstd.reshape(-1, 1), w32, w32,
        [True, True, True])
    if grad_add is not None:
        dx = dx + _fp32(grad_add)
    return (dx if dx.dtype is x.dtype else dx.to(x.dtype)), dw, db


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
