"""Forward ``BasicLinear -> Bias [-> activation]`` as one GEMM with an epilogue."""

from __future__ import annotations

from ..basic.linear import linear_forward
from ..gemm import apply_activation
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasActivation", "linear_bias_activation_forward"]


def linear_bias_activation_forward(ctxs, ops, x):
    """``act(x · wᵀ + b)`` for ``ops`` = [linear, bias?, activation?]: the bias (and,
    when no backward needs the pre-activation, the activation too) in the GEMM's
    fp32 epilogue; ``x`` may be a QuantizedTensor (see ``linear_forward``)."""
    linear = ops[0]
    if len(ops) == 1:
        return linear_forward(ctxs[0], linear, x)
    run = ctxs[0].run
    b = ops[1].bias_as(run.compute_dtype)
    act = ops[2] if len(ops) > 2 else None
    if act is None:
        return linear_forward(ctxs[0], linear, x, bias=b)
    if not run.needs_backward:
        return linear_forward(ctxs[0], linear, x, bias=b, activation=act.kind)
    pre = linear_forward(ctxs[0], linear, x, bias=b)
    ctxs[2].saved["x"] = pre  # what the activation's own backward reads
    return apply_activation(pre, act.kind)


class ForwardLinearBiasActivation(FusedOperation):
    """``y = act(x · wᵀ + b)``: the bias (and, when no backward needs the
    pre-activation, the activation too) is applied in the GEMM's fp32 epilogue."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        return linear_bias_activation_forward(ctxs, self.basic_ops, x), [[] for _ in ctxs]
