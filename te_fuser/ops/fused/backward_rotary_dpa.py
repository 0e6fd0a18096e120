"""Backward ``RotaryEmbedding -> DotProductAttention``: the inverse rotation in place on attention's input gradient."""

from __future__ import annotations

from ..op import FusedOperation

__all__ = ["BackwardRotaryDPA"]


class BackwardRotaryDPA(FusedOperation):
    """dx = rope⁻¹(attention's dqkv): attention's backward writes dq, dk and dv into a
    fresh fused tensor that no other op holds, so the inverse rotation writes the q
    and k heads' gradients back into it and leaves dv where the kernel wrote it (the
    unfused rotation reads and writes every head into a copy). The same bits as the
    unfused ops."""

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        rope, attention = self._basic_ops
        dqkv, _, _ = attention.op_backward(ctxs[1], dy, grad_extra_outputs[1])  # (..., (H + 2 Hkv) * D)
        return rope.rotate_fresh(ctxs[0], dqkv, inverse=True), [[], []], self.no_extras
