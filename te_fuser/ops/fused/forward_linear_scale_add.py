"""Forward ``BasicLinear -> ConstantScale -> AddExtraInput``: scale and residual in the GEMM epilogue."""

from __future__ import annotations

from ..basic.linear import linear_bias_add_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearScaleAdd"]


class ForwardLinearScaleAdd(FusedOperation):
    """``y = scale · (x · wᵀ) + residual`` rounded once (TransformerEngine's
    ``ForwardLinearScaleAdd``): FP8 per-tensor GEMMs take the scale into the
    weight's dequantization scale and add the residual in their epilogue; other
    GEMMs write fp32 and the scale and residual follow in fp32. With
    ``AddExtraInput(in_place=True)`` the sum is written into the residual's buffer.
    The unfused ops round ``x · wᵀ`` and its scaled copy to the compute dtype
    first."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        _linear, scale, _add = self._basic_ops
        (residual,) = extra_inputs[2]
        return linear_bias_add_forward(ctxs, self._basic_ops, x, residual, scale=scale.scale), self.no_extras
