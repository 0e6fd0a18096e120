"""Backward ``MakeExtraOutput -> BasicLinear``: the branch's gradient is added to the
dgrad GEMM's output in its epilogue."""

from __future__ import annotations

from ..basic.linear import linear_backward
from ..op import FusedOperation

__all__ = ["BackwardLinearAdd"]


class BackwardLinearAdd(FusedOperation):
    """``dx = dy · w + d_branch`` and ``dw = dyᵀ · x``."""

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        _branch, linear = self._basic_ops
        (d_branch,) = grad_extra_outputs[0]
        dx, dw = linear_backward(ctxs[1], linear, dy, grad_residual=d_branch)
        if dx is None:  # the fuser asked for no input gradient
            dx = d_branch
        return dx, [[], [dw]], self.no_extras
