"""LayerNorm and RMSNorm over the last dim, computed in fp32.

RMSNorm runs the backend's ``rms_norm`` / ``rms_norm_grad`` kernels (on the GPU
one Triton pass each, forward and backward; the reference recomputes torch's
``rms_norm`` in fp32 and differentiates it). LayerNorm's backward recomputes the
normalisation in fp32 from the saved input and differentiates it, which keeps
forward and backward numerics in one place.
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
        x = ctx.saved["x"]
        with torch.enable_grad():
            x32 = x.detach().float().requires_grad_(True)
            own = self._params()
            params = [p.detach().float().requires_grad_(True) for p in own]
            y = self._normalize(x32, params)
            grads = torch.autograd.grad(y, [x32, *params], dy.float())
        dx = grads[0].to(x.dtype)
        pgrads = [g.to(p.dtype) for g, p in zip(grads[1:], own)]
        return dx, pgrads, []


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
