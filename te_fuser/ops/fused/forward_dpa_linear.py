"""Forward ``DotProductAttention -> BasicLinear [-> Bias [-> AddExtraInput]]`` under ``fp8_mha``:
attention hands its FP8 output to the output projection's GEMM (bias and
residual in its epilogue, as ``ForwardLinearBiasActivation`` and
``ForwardLinearBiasAdd`` do).

Unfused, FP8 attention casts O with its ``o`` quantizer and hands it on
dequantized, and the projection casts it again with its input quantizer. Fused,
the projection's GEMM reads the ``o`` quantizer's bytes as they are (with their
transposed copy for the wgrad GEMM, one per-tensor scale): one cast and no
high-precision O between the two. The projection's own input quantizer is not
used meanwhile; its state stays as it was.

Numerics: the fused op skips a dequantization and a second cast, so the
projection's input differs from the unfused one by at most one step of the FP8
grid (the unfused one is rounded twice). It applies where both quantizers scale
per tensor (delayed or current scaling), and where the projection's backward may
read its input in FP8 (not ``backward_override='high_precision'``); elsewhere
the call runs the unfused equivalent.
"""

from __future__ import annotations

from ..basic.attention import attention_linear_forward
from ..basic.extra import AddExtraInput
from ..op import FusedOperation

__all__ = ["ForwardDPALinear"]


class ForwardDPALinear(FusedOperation):
    """``y = linear(attention(x)) [+ b] [+ residual]`` with attention's FP8 O as the linear's input."""

    def fuser_forward(self, ctxs, x, extra_inputs):
        residual = extra_inputs[-1][0] if isinstance(self._basic_ops[-1], AddExtraInput) else None
        return attention_linear_forward(ctxs, self._basic_ops, x, residual), self.no_extras
