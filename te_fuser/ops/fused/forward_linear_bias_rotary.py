"""Forward ``BasicLinear [-> Bias] -> RotaryEmbedding``: the rotation in place on the GEMM's output."""

from __future__ import annotations

from ..basic.linear import linear_bias_activation_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasRotary"]


class ForwardLinearBiasRotary(FusedOperation):
    """``y = rope(x · wᵀ [+ b])``: the GEMM's output is a fresh tensor that no other
    op holds, so the rotation writes the q and k heads back into it and leaves the v
    heads where the GEMM wrote them (the unfused rotation reads and writes every
    head into a copy). The same bits as the unfused ops."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        *linear_ops, rope = self._basic_ops
        y = linear_bias_activation_forward(ctxs[:-1], linear_ops, x)  # (..., (H + 2 Hkv) * D)
        return rope.rotate_fresh(ctxs[-1], y), self.no_extras
