"""Backward ``Bias -> activation``: activation gradient and bias gradient in one pass."""

from __future__ import annotations

from ..basic.activation import activation_bias_backward
from ..op import FusedOperation

__all__ = ["BackwardActivationBias"]


class BackwardActivationBias(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        bias = self._basic_ops[0]
        dx, db = activation_bias_backward(ctxs[1], bias, dy)
        return dx, [[db], []], self.no_extras
