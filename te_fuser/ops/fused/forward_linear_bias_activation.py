"""Forward ``BasicLinear -> Bias [-> activation]`` as one GEMM with an epilogue."""

from __future__ import annotations

from ..basic.linear import linear_forward
from ..gemm import apply_activation
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasActivation"]


class ForwardLinearBiasActivation(FusedOperation):
    """``y = act(x · wᵀ + b)``: the bias (and, when no backward needs the
    pre-activation, the activation too) is applied in the GEMM's fp32 epilogue."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        linear, bias = self.basic_ops[0], self.basic_ops[1]
        act = self.basic_ops[2] if len(self.basic_ops) > 2 else None
        run = ctxs[0].run
        b = bias.bias
        if b.dtype is not run.compute_dtype:
            b = b.to(run.compute_dtype)
        if act is None:
            return linear_forward(ctxs[0], linear, x, bias=b), [[] for _ in ctxs]
        if not run.needs_backward:
            return linear_forward(ctxs[0], linear, x, bias=b, activation=act.kind), [[] for _ in ctxs]
        pre = linear_forward(ctxs[0], linear, x, bias=b)
        ctxs[2].saved["x"] = pre  # what the activation's own backward reads
        return apply_activation(pre, act.kind), [[] for _ in ctxs]
