"""Residual branches: AddExtraInput adds a second input; MakeExtraOutput emits a copy."""

from __future__ import annotations

import torch

from ..op import BasicOperation

__all__ = ["AddExtraInput", "MakeExtraOutput"]


class AddExtraInput(BasicOperation):
    """``y = x + extra`` where ``extra`` is passed to the Sequential call after ``x``.

    The sum has torch's promoted dtype: under ``torch.autocast`` a residual stream
    kept in fp32 stays fp32 (``bf16 x + fp32 extra`` is fp32), as in plain torch."""

    module_type = "add"
    num_extra_inputs = 1

    def check_shapes(self, in_shape, quantizers):
        return in_shape

    def output_dtype(self, in_dtype, compute_dtype, extra_dtypes):
        return torch.promote_types(in_dtype, extra_dtypes[0])

    def op_forward(self, ctx, x, extra_inputs):
        (extra,) = extra_inputs
        if extra.shape != x.shape:
            raise ValueError(f"{self.describe()}: extra input shape {tuple(extra.shape)} != input shape {tuple(x.shape)}")
        return x + extra, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy, [], [dy]


class MakeExtraOutput(BasicOperation):
    """``y = x`` and ``x`` is also returned by the Sequential call (a residual branch)."""

    module_type = "branch"
    num_extra_outputs = 1

    def output_dtype(self, in_dtype, compute_dtype, extra_dtypes):
        return in_dtype

    def op_forward(self, ctx, x, extra_inputs):
        return x, [x]

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (dextra,) = grad_extra_outputs
        return (dy if dextra is None else dy + dextra), [], []
