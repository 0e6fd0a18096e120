"""Backward ``BasicLinear -> Bias``: the bias gradient from the read of the output
gradient that its FP8 cast makes anyway, then the dgrad and wgrad GEMMs.

Unfused, the bias sums the gradient in one pass and the linear's grad-output
quantizer reads it again (under current scaling, twice: amax, then cast). A
quantizer whose cast reads the tensor anyway returns the column sums with it
(``Quantizer.quantize_with_column_sums``: current scaling from its amax pass,
delayed scaling from its one-pass cast); the others sum in a pass of their own,
which is the unfused computation. A dy that arrives in another dtype than the
compute dtype (fp32 from a residual stream kept in fp32) is summed as it came,
as the unfused bias sums it, and cast as the compute dtype would hold it: the
per-tensor schemes round it to bf16 as they read it, with no converted copy.
"""

from __future__ import annotations

import torch

from ..basic.bias import bias_grad
from ..basic.linear import linear_backward, linear_backward_with_column_sums
from ..op import FusedOperation

__all__ = ["BackwardLinearBias"]


class BackwardLinearBias(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        linear, bias = self._basic_ops
        needs = ctxs[1].param_needs_grad
        need_db = not needs or needs[0]
        run = ctxs[0].run
        if not need_db or (dy.dtype is not run.compute_dtype and not run.fp8_backward):
            # the unfused bias sums dy as it arrives, before the cast to the compute dtype;
            # with an FP8 backward the dy cast does too (its sums of dy as it came)
            db = bias_grad(dy, bias.bias.dtype) if need_db else None
            dx, dw = linear_backward(ctxs[0], linear, dy)
        else:
            # a bf16 bias's gradient comes out rounded where the sums are added up (no conversion after)
            b_dtype = bias.bias.dtype
            dx, dw, sums = linear_backward_with_column_sums(
                ctxs[0], linear, dy, sums_dtype=torch.bfloat16 if b_dtype is torch.bfloat16 else torch.float32)
            db = sums if sums.dtype is b_dtype else sums.to(b_dtype)
        return dx, [[dw], [db]], self.no_extras
