"""LayerNorm and RMSNorm over the last dim, computed in fp32.

RMSNorm runs the backend's ``rms_norm`` / ``rms_norm_grad`` kernels (on the GPU
one Triton pass each, forward and backward; the reference in fp32 torch ops).
LayerNorm runs torch's own fp32 kernels: ``native_layer_norm`` forward (which
also returns the rows' mean and reciprocal standard deviation, saved for the
backward) and ``native_layer_norm_backward`` (dx, dweight and dbias from those
statistics, without recomputing them): one kernel each way on the GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import backend
from ..op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm", "rms_norm_backward"]


class _Norm(BasicOperation):
    module_type = "norm"

    def __init__(self, size: int, eps: float, bias: bool, device, dtype, name) -> None:
        super().__init__(name)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{type(self).__name__}.size: must be a positive integer, got {size!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"{type(self).__name__}.eps: must be a positive float, got {eps!r}")
        self.size, self.eps = size, float(eps)
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}"

    def check_shapes(self, in_shape, quantizers):
        if in_shape[-1] != self.size:
            raise ValueError(f"{self.describe()}: input's last dim is {in_shape[-1]}, expected {self.size}")
        return in_shape


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias``, as torch.nn.LayerNorm."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device=None, dtype=None, name=None) -> None:
        super().__init__(normalized_shape, eps, True, device, dtype, name)

    def op_forward(self, ctx, x, extra_inputs):
        dtype = ctx.run.compute_dtype
        y, mean, rstd = torch.native_layer_norm(x.float(), (self.size,), self.weight.float(), self.bias.float(),
                                                self.eps)  # fp32; the statistics (..., 1)
        if ctx.run.needs_backward:
            ctx.saved["x"], ctx.saved["stats"] = x, (mean, rstd)
        return (y if y.dtype is dtype else y.to(dtype)), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        """torch's LayerNorm gradient in fp32 from the saved input and statistics (no
        autograd: it also runs inside custom ops, below it)."""
        x, (mean, rstd) = ctx.saved["x"], ctx.saved["stats"]
        weight, bias = self.weight, self.bias
        need_w, need_b = ctx.param_needs_grad or (weight.requires_grad, bias.requires_grad)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy.float(), x.float(), (self.size,), mean, rstd, weight.float(), bias.float(), [True, need_w, need_b])
        pgrads = [g if g is None or g.dtype is p.dtype else g.to(p.dtype) for g, p in ((dw, weight), (db, bias))]
        return (dx if dx.dtype is x.dtype else dx.to(x.dtype)), pgrads, []


class RMSNorm(_Norm):
    """``x / sqrt(mean(x**2) + eps) * weight``, as torch.nn.RMSNorm."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device=None, dtype=None, name=None) -> None:
        super().__init__(normalized_shape, eps, False, device, dtype, name)

    def op_forward(self, ctx, x, extra_inputs):
        x2d = x.reshape(-1, self.size)  # (M, N)
        y2d, rstd = backend.resolve("rms_norm", x.device).fn(x2d, self.weight, self.eps, ctx.run.compute_dtype)
        if ctx.run.needs_backward:
            ctx.saved["x"], ctx.saved["rstd"] = x, rstd
        return y2d.reshape(x.shape), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        dx, dw = rms_norm_backward(ctx, self, dy)
        return dx, [dw], []


def rms_norm_backward(ctx, op: RMSNorm, dy: torch.Tensor, grad_add: torch.Tensor | None = None):
    """``(dx, dweight)`` of ``op``; with ``grad_add`` (the gradient of a branch taken
    before the norm, ``MakeExtraOutput -> RMSNorm``) dx is the norm's gradient plus
    it, summed in fp32 and rounded once to x's dtype: the two terms may cancel, and
    a norm gradient rounded first would leave that rounding's error in the sum."""
    x, rstd = ctx.saved["x"], ctx.saved["rstd"]
    x2d = x.reshape(-1, op.size)  # (M, N)
    dy2d = dy.reshape(-1, op.size)
    grad = backend.resolve("rms_norm_grad", x.device).fn
    if grad_add is None:
        dx2d, dw = grad(dy2d, x2d, op.weight, rstd, op.eps)
    else:
        dx2d, dw = grad(dy2d, x2d.float(), op.weight, rstd, op.eps)  # dx in fp32
        dx2d = (dx2d + grad_add.reshape(-1, op.size)).to(x.dtype)
    return dx2d.reshape(x.shape), dw.to(op.weight.dtype)
