"""Bias: ``y = x + b`` over the last dim."""

from __future__ import annotations

import torch
from torch import nn

from ..op import BasicOperation

__all__ = ["Bias", "bias_grad"]


def bias_grad(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of ``dy`` over every dim but the last, accumulated in fp32."""
    dy2d = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
    db = dy2d.sum(dim=0, dtype=torch.float32)  # no fp32 copy of dy
    return db if db.dtype is dtype else db.to(dtype)


class Bias(BasicOperation):
    """``y = x + b``. ``init_bound``: b starts uniform within ``±init_bound`` (a
    Linear's bias: ``1 / sqrt(in_features)``, as ``torch.nn.Linear``); None: zeros."""

    module_type = "bias"

    def __init__(self, size: int, *, device=None, dtype=None, name=None, init_bound: float | None = None) -> None:
        super().__init__(name)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"Bias.size: must be a positive integer, got {size!r}")
        if init_bound is not None and (isinstance(init_bound, bool) or not isinstance(init_bound, (int, float))
                                       or not init_bound >= 0):
            raise ValueError(f"Bias.init_bound: must be None or a non-negative number, got {init_bound!r}")
        self.init_bound = None if init_bound is None else float(init_bound)
        self.bias = nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the bias again as construction did, in place (after ``to_empty``, or to start over)."""
        with torch.no_grad():
            if self.init_bound is None:
                self.bias.zero_()
            else:
                self.bias.uniform_(-self.init_bound, self.init_bound)

    def check_shapes(self, in_shape, quantizers):
        if in_shape[-1] != self.bias.shape[0]:
            raise ValueError(f"{self.describe()}: input's last dim is {in_shape[-1]}, expected {self.bias.shape[0]}")
        return in_shape

    def bias_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The bias in ``dtype`` (itself when it already is)."""
        bias = self.bias
        return bias if bias.dtype is dtype else bias.to(dtype)

    def op_forward(self, ctx, x, extra_inputs):
        dtype = ctx.run.compute_dtype
        return (x if x.dtype is dtype else x.to(dtype)) + self.bias_as(dtype), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        db = bias_grad(dy, self.bias.dtype) if (not ctx.param_needs_grad or ctx.param_needs_grad[0]) else None
        return dy, [db], []
