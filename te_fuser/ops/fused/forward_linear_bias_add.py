"""Forward ``BasicLinear [-> Bias] -> AddExtraInput``: the residual add in the GEMM epilogue."""

from __future__ import annotations

from ..basic.linear import linear_bias_add_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasAdd"]


class ForwardLinearBiasAdd(FusedOperation):
    """``y = x · wᵀ [+ b] + residual`` with bias and residual applied in fp32 before the
    one rounding to the compute dtype (TransformerEngine's ``ForwardLinearBiasAdd``,
    with or without its bias). With ``AddExtraInput(in_place=True)`` the sum is
    written into the residual's buffer."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        (residual,) = extra_inputs[-1]
        return linear_bias_add_forward(ctxs, self._basic_ops, x, residual), self.no_extras
