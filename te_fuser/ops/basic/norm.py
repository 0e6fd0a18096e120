"""LayerNorm and RMSNorm over the last dim, computed in fp32.

RMSNorm runs the backend's ``rms_norm`` / ``rms_norm_grad`` kernels (on the GPU
one Triton pass each, forward and backward; the reference in fp32 torch ops).
LayerNorm runs torch's ``layer_norm`` in fp32 forward, and its backward the
closed-form gradient in fp32 from the saved input (see ``op_backward``).
"""

from __future__ import annotations

import torch
from torch import nn

from ... import backend
from ..op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm"]


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

    def _normalize(self, x32: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _params(self) -> list[nn.Parameter]:
        """The parameters in ``parameters()`` order, without walking the module tree."""
        bias = self.bias
        return [self.weight] if bias is None else [self.weight, bias]

    def op_forward(self, ctx, x, extra_inputs):
        dtype = ctx.run.compute_dtype
        if ctx.run.needs_backward:
            ctx.saved["x"] = x
        params = [p.float() for p in self._params()]
        y = self._normalize(x.float(), params)
        return (y if y.dtype is dtype else y.to(dtype)), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        """The closed form of LayerNorm's gradient in fp32, from the saved input
        (no autograd: it also runs inside custom ops, below it):

            xhat = (x - mean) * rstd,   g = dy * weight
            dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
            dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy)"""
        x = ctx.saved["x"]
        n = self.size
        x32, dy32 = x.float().reshape(-1, n), dy.float().reshape(-1, n)  # (M, N)
        mean = x32.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x32.var(-1, unbiased=False, keepdim=True) + self.eps)
        xhat = (x32 - mean) * rstd
        g = dy32 * self.weight.float()
        dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        weight, bias = self.weight, self.bias
        pgrads = [(dy32 * xhat).sum(0).to(weight.dtype)] + ([dy32.sum(0).to(bias.dtype)] if bias is not None else [])
        return dx.reshape(x.shape).to(x.dtype), pgrads, []


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias``, as torch.nn.LayerNorm."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device=None, dtype=None, name=None) -> None:
        super().__init__(normalized_shape, eps, True, device, dtype, name)

    def _normalize(self, x32, params):
        weight, bias = params
        return torch.nn.functional.layer_norm(x32, (self.size,), weight, bias, self.eps)


class RMSNorm(_Norm):
    """``x / sqrt(mean(x**2) + eps) * weight``, as torch.nn.RMSNorm."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device=None, dtype=None, name=None) -> None:
        super().__init__(normalized_shape, eps, False, device, dtype, name)

    def _normalize(self, x32, params):
        (weight,) = params
        return torch.nn.functional.rms_norm(x32, (self.size,), weight, self.eps)

    def op_forward(self, ctx, x, extra_inputs):
        x2d = x.reshape(-1, self.size)  # (M, N)
        y2d, rstd = backend.resolve("rms_norm", x.device).fn(x2d, self.weight, self.eps, ctx.run.compute_dtype)
        if ctx.run.needs_backward:
            ctx.saved["x"], ctx.saved["rstd"] = x, rstd
        return y2d.reshape(x.shape), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x, rstd = ctx.saved["x"], ctx.saved["rstd"]
        x2d = x.reshape(-1, self.size)  # (M, N)
        dy2d = dy.reshape(-1, self.size)
        dx2d, dw = backend.resolve("rms_norm_grad", x.device).fn(dy2d, x2d, self.weight, rstd, self.eps)
        return dx2d.reshape(x.shape), [dw.to(self.weight.dtype)], []
