"""Backward ``Bias -> activation``: activation gradient and bias gradient in one pass."""

from __future__ import annotations

from ... import backend
from ..op import FusedOperation

__all__ = ["BackwardActivationBias", "dact_dbias"]


def dact_dbias(ctx_act, bias_op, dy):
    """``(d pre-activation, dbias)`` from the activation's saved input."""
    x = ctx_act.saved["x"]
    dx, db = backend.resolve("dact_dbias", x.device).fn(dy.to(x.dtype), x, ctx_act.op.kind)
    return dx, db.to(bias_op.bias.dtype)


class BackwardActivationBias(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        bias = self.basic_ops[0]
        dx, db = dact_dbias(ctxs[1], bias, dy)
        return dx, [[db], []], [[] for _ in ctxs]
