"""Forward ``BasicLinear -> Bias -> AddExtraInput``: the residual add in the GEMM epilogue."""

from __future__ import annotations

from ..basic.linear import linear_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasAdd"]


class ForwardLinearBiasAdd(FusedOperation):
    """``y = x · wᵀ + b + residual`` with bias and residual applied in fp32 before the
    one rounding to the compute dtype."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        linear, bias, _add = self.basic_ops
        (residual,) = extra_inputs[2]
        out_shape = (*x.shape[:-1], linear.out_features)
        if tuple(residual.shape) != out_shape:
            raise ValueError(
                f"{self.basic_ops[2].describe()}: extra input shape {tuple(residual.shape)} != {out_shape}"
            )
        b = bias.bias.to(ctxs[0].run.compute_dtype)
        y = linear_forward(ctxs[0], linear, x, bias=b, residual=residual)
        return y, [[] for _ in ctxs]
