"""Forward ``BasicLinear -> Bias -> AddExtraInput``: the residual add in the GEMM epilogue."""

from __future__ import annotations

from ..basic.linear import linear_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasAdd", "linear_bias_add_forward"]


def linear_bias_add_forward(ctxs, ops, x, residual):
    """``x · wᵀ + b + residual`` for ``ops`` = [linear, bias, add]; ``x`` may be a
    QuantizedTensor (see ``linear_forward``)."""
    linear, bias, add = ops
    out_shape = (*x.shape[:-1], linear.out_features)
    if tuple(residual.shape) != out_shape:
        raise ValueError(f"{add.describe()}: extra input shape {tuple(residual.shape)} != {out_shape}")
    return linear_forward(ctxs[0], linear, x, bias=bias.bias_as(ctxs[0].run.compute_dtype), residual=residual)


class ForwardLinearBiasAdd(FusedOperation):
    """``y = x · wᵀ + b + residual`` with bias and residual applied in fp32 before the
    one rounding to the compute dtype."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        (residual,) = extra_inputs[2]
        return linear_bias_add_forward(ctxs, self.basic_ops, x, residual), [[] for _ in ctxs]
