"""Backward ``BasicLinear -> ConstantScale``: the scale in the dgrad and wgrad GEMMs."""

from __future__ import annotations

from ..basic.linear import linear_backward
from ..op import FusedOperation

__all__ = ["BackwardLinearScale"]


class BackwardLinearScale(FusedOperation):
    """``dx = scale · (dy · w)`` and ``dw = scale · (dyᵀ · x)`` (TransformerEngine's
    ``BackwardLinearScale``): a stateless per-tensor FP8 cast of dy takes the scale
    into its dequantization scales, so both GEMMs apply it in their fp32 epilogue
    and no scaled copy of dy is written; elsewhere (high precision, delayed
    scaling, block and MX scaling) dy is scaled once before the linear's backward,
    as the unfused ops do."""

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        linear, scale = self._basic_ops
        dx, dw = linear_backward(ctxs[0], linear, dy, dy_scale=scale.scale)
        return dx, [[dw], []], self.no_extras
