"""Backward ``BasicLinear -> Bias -> activation``: activation and bias gradients in one
pass whose output goes straight to the linear's grad-output quantizer, then the
dgrad and wgrad GEMMs."""

from __future__ import annotations

from ..basic.linear import linear_backward
from ..op import FusedOperation
from ..basic.activation import activation_bias_backward

__all__ = ["BackwardLinearBiasActivation"]


class BackwardLinearBiasActivation(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        linear, bias, _act = self._basic_ops
        d_pre, db = activation_bias_backward(ctxs[2], bias, dy)
        dx, dw = linear_backward(ctxs[0], linear, d_pre)
        return dx, [[dw], [db], []], self.no_extras
