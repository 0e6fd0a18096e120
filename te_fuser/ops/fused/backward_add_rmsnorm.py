"""Backward ``MakeExtraOutput -> RMSNorm``: the norm's input gradient and the
branch's gradient summed in fp32, rounded once."""

from __future__ import annotations

from ..basic.norm import rms_norm_backward
from ..op import FusedOperation

__all__ = ["BackwardAddRMSNorm"]


class BackwardAddRMSNorm(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        (d_branch,) = grad_extra_outputs[0]
        _, norm = self._basic_ops
        dx, dw = rms_norm_backward(ctxs[1], norm, dy, grad_add=d_branch)
        return dx, [[], [dw]], self.no_extras
