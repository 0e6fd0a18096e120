"""``Float8Quantizer``: TransformerEngine's per-tensor FP8 cast with a scale the caller owns."""

from __future__ import annotations

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand
from .base import Quantizer
from .role import QuantizerRole

__all__ = ["Float8Quantizer"]


class Float8Quantizer(Quantizer):
    """``Float8Quantizer(scale, amax, fp8_dtype)``: casts ``x * scale`` (saturating) and
    raises ``amax`` (a one-element fp32 tensor) to ``max(amax, amax(|x|))``, as
    TransformerEngine's quantizer of that name does. Both tensors belong to the caller
    and are read at every cast, so a scale written in place takes effect at the next
    one; nothing here updates the scale (a recipe's delayed scaling is
    :class:`DelayedScalingQuantizer`, which keeps its own history).
    """

    scaling = Scaling.TENSOR

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                 role: QuantizerRole | None = None, *, rowwise: bool = True, columnwise: bool = False) -> None:
        super().__init__(fp8_dtype, role, rowwise=rowwise, columnwise=columnwise, device=scale.device)
        for field, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise ValueError(f"Float8Quantizer.{field}: must be a one-element float32 tensor, got {t!r}")
        self.scale, self.amax = scale, amax

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        device = x_hp.device
        scale = self.scale.reshape(()).to(device)
        amax = torch.empty(1, dtype=torch.float32, device=device)  # the cast writes (not accumulates) it
        x_fp8, x_fp8_t, _ = backend.resolve("quantize_tensorwise", device).fn(
            x_hp, scale, self.fp8_dtype, rowwise=rowwise, columnwise=columnwise, amax_out=amax)
        with torch.no_grad():
            self.amax.copy_(torch.maximum(self.amax, amax.to(self.amax.device).reshape(self.amax.shape)))
        scale_inv = torch.reciprocal(scale)
        rowwise_op = ScaledOperand(x_fp8, scale_inv, Scaling.TENSOR) if rowwise else None  # (M, K)
        columnwise_op = ScaledOperand(x_fp8_t, scale_inv, Scaling.TENSOR) if columnwise else None  # (K, M)
        return rowwise_op, columnwise_op

    def describe(self) -> str:
        return f"given scale({short_name(self.fp8_dtype)})"
