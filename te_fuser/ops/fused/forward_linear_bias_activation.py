"""Forward ``BasicLinear -> Bias [-> activation]`` as one GEMM with an epilogue."""

from __future__ import annotations

from ..basic.linear import linear_bias_activation_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasActivation"]


class ForwardLinearBiasActivation(FusedOperation):
    """``y = act(x · wᵀ + b)``: the bias (and, when no backward needs the
    pre-activation, the activation too) is applied in the GEMM's fp32 epilogue."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        return linear_bias_activation_forward(ctxs, self._basic_ops, x), self.no_extras
