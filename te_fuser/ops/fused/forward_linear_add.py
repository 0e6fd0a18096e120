"""Forward ``BasicLinear -> AddExtraInput`` (no bias): the residual add in the GEMM epilogue."""

from __future__ import annotations

from ..basic.linear import linear_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearAdd"]


class ForwardLinearAdd(FusedOperation):
    """``y = x · wᵀ + residual``, the residual added in fp32 before the one rounding
    (TransformerEngine's ``ForwardLinearBiasAdd`` without a bias)."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        linear, add = self.basic_ops
        (residual,) = extra_inputs[1]
        out_shape = (*x.shape[:-1], linear.out_features)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"{add.describe()}: extra input shape {tuple(residual.shape)} != {out_shape}")
        return linear_forward(ctxs[0], linear, x, residual=residual), [[] for _ in ctxs]
