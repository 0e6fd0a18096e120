"""Small ops: Quantize, Identity, Reshape, Dropout, ConstantScale."""

from __future__ import annotations

import math

import torch

from ...quantization.float8_tensor import Float8Tensor
from ..op import BasicOperation

__all__ = ["Quantize", "Identity", "Reshape", "Dropout", "ConstantScale"]


class Quantize(BasicOperation):
    """Casts the tensor to the recipe's FP8 format: with ``forward`` the output is
    a :class:`~te_fuser.quantization.float8_tensor.Float8Tensor` (FP8 values of the
    compute dtype, which a following linear takes as its FP8 input and every other
    function reads dequantized); with ``backward`` the gradient is cast too, and
    handed on as a Float8Tensor (the input's ``.grad`` is one when Quantize is the
    first op). Without a recipe it passes tensors through, and a recipe's
    ``backward_override`` keeps the gradient in high precision (as
    TransformerEngine's ``Quantize``). An input that is already FP8 is passed on."""

    module_type = "quantize"
    accepts_fp8_input = True
    forward_roles = ("input",)
    backward_roles = ("grad_output",)

    def __init__(self, forward: bool = True, backward: bool = False, *, name=None) -> None:
        super().__init__(name)
        if not isinstance(forward, bool) or not isinstance(backward, bool):
            raise TypeError("Quantize(forward=..., backward=...): must be True or False")
        self.quantize_forward, self.quantize_backward = forward, backward

    def check_shapes(self, in_shape, quantizers):
        rows = math.prod(in_shape[:-1])
        for tensor_type, wanted in (("input", self.quantize_forward), ("grad_output", self.quantize_backward)):
            if wanted and tensor_type in quantizers:
                quantizers[tensor_type].check_shape((rows, in_shape[-1]), rowwise=True, columnwise=False)
        return in_shape

    def op_forward(self, ctx, x, extra_inputs):
        if type(x) is Float8Tensor and self.quantize_forward and ctx.run.quantizing:
            return x, []
        x = x.to(ctx.run.compute_dtype)
        if self.quantize_forward and ctx.run.quantizing:
            return _float8(ctx.quantizer("input"), x), []
        if self.quantize_forward and ctx.run.calibrating:
            ctx.quantizer("input").observe(x.reshape(-1, x.shape[-1]))
        return x, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        if self.quantize_backward and ctx.run.fp8_backward and type(dy) is not Float8Tensor:
            return _float8(ctx.quantizer("grad_output"), dy), [], []
        return dy, [], []


def _float8(quantizer, t: torch.Tensor) -> torch.Tensor:
    """``t`` cast by ``quantizer`` (its row-wise copy), as a Float8Tensor of ``t``'s shape."""
    q = quantizer.cast(t, rowwise=True, columnwise=False)
    return q if isinstance(q, torch.Tensor) else Float8Tensor.from_quantized(q)


class _PassesDtype(BasicOperation):
    """An op whose output keeps its input's dtype."""

    def output_dtype(self, in_dtype, compute_dtype, extra_dtypes):
        return in_dtype


class Identity(_PassesDtype):
    module_type = "identity"
    accepts_fp8_input = True

    def op_forward(self, ctx, x, extra_inputs):
        return x, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy, [], []


class Reshape(_PassesDtype):
    """``x.reshape(shape)``; ``-1`` allowed once."""

    module_type = "reshape"
    accepts_fp8_input = True

    def __init__(self, shape, *, name=None) -> None:
        super().__init__(name)
        shape = tuple(shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s == 0 or s < -1 for s in shape):
            raise ValueError(f"Reshape.shape: must be positive ints and at most one -1, got {shape!r}")
        if shape.count(-1) > 1:
            raise ValueError(f"Reshape.shape: at most one -1, got {shape!r}")
        self.shape = shape

    def check_shapes(self, in_shape, quantizers):
        numel = math.prod(in_shape)
        known = math.prod(s for s in self.shape if s != -1)
        if (-1 in self.shape and numel % known) or (-1 not in self.shape and numel != known):
            raise ValueError(f"{self.describe()}: cannot reshape {tuple(in_shape)} to {self.shape}")
        return torch.Size(numel // known if s == -1 else s for s in self.shape)

    def op_forward(self, ctx, x, extra_inputs):
        ctx.saved["shape"] = x.shape
        return x.reshape(self.shape), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy.reshape(ctx.saved["shape"]), [], []


class Dropout(_PassesDtype):
    """Zeroes elements with probability ``p`` in training mode, scaling the rest by
    ``1 / (1 - p)``; the identity in eval mode."""

    module_type = "dropout"
    accepts_fp8_input = True  # the identity in eval mode; in training torch's mul reads it dequantized

    def __init__(self, p: float, *, name=None) -> None:
        super().__init__(name)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout.p: must be in [0, 1), got {p!r}")
        self.p = float(p)

    def op_forward(self, ctx, x, extra_inputs):
        if not self.training or self.p == 0.0:
            ctx.saved["mask"] = None
            return x, []
        keep = (torch.rand(x.shape, device=x.device) >= self.p).to(x.dtype) / (1.0 - self.p)
        ctx.saved["mask"] = keep
        return x * keep, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        keep = ctx.saved["mask"]
        return (dy if keep is None else dy * keep), [], []


class ConstantScale(_PassesDtype):
    """``y = scale * x``."""

    module_type = "scale"

    def __init__(self, scale: float, *, name=None) -> None:
        super().__init__(name)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"ConstantScale.scale: must be a finite number, got {scale!r}")
        self.scale = float(scale)

    def op_forward(self, ctx, x, extra_inputs):
        return x * self.scale, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy * self.scale, [], []
