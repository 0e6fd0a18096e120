"""Forward ``BasicLinear [-> Bias] -> DotProductAttention [-> BasicLinear [-> Bias [-> AddExtraInput]]]``
under ``fp8_mha``: the QKV GEMM's epilogue writes attention's FP8 Q, K, V (and
attention hands its FP8 O to the output projection's GEMM).

The QKV GEMM adds the bias, rounds the fp32 result to the compute dtype and casts
it to E4M3 with the scale of attention's ``qkv`` quantizer, reducing its amax in
the same pass (:meth:`~te_fuser.quantization.Quantizer.epilogue_cast`); attention
reads those bytes (q, k, v sliced out of them) instead of a high-precision QKV
tensor that a separate cast reads back. With the projection in the pattern, O
goes on as in ``forward_dpa_linear.py`` (``attention_linear_forward``).

Numerics: the rounding to the compute dtype before the cast makes the FP8 bytes,
the amax and the scaling state those of the separate cast: the fused op equals
the unfused ops bit for bit up to the projection's input (which it casts once,
with attention's ``o`` quantizer, where the unfused ops hand O dequantized to the
projection's own cast).

It applies where the ``qkv`` quantizer knows its scale before the tensor exists:
delayed scaling, once seeded (a fresh quantizer's first tensor seeds the scale:
that call runs the unfused equivalent). A rotary embedding between the QKV
projection and attention stops the hand-off (RoPE rotates q and k in high
precision between the GEMM and the cast, which this epilogue does not do):
there, ``Linear -> Bias`` runs its own fused GEMM and attention casts the
rotated tensor.
"""

from __future__ import annotations

from ..basic.attention import DotProductAttention, attention_forward, attention_linear_forward, fp8_attention
from ..basic.extra import AddExtraInput
from ..basic.linear import linear_bias_activation_forward, linear_forward
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasDPALinear"]


class ForwardLinearBiasDPALinear(FusedOperation):
    """``y = proj(attention(qkv(x)))``: ``qkv`` = [linear, bias?] hands attention its
    input as FP8 cast in its GEMM's epilogue; ``proj`` = [linear, bias?, add?] or nothing."""

    def __init__(self, basic_ops) -> None:
        super().__init__(basic_ops)
        self._split = next(i for i, op in enumerate(basic_ops) if isinstance(op, DotProductAttention))

    def fuser_forward(self, ctxs, x, extra_inputs):
        n = self._split
        head, tail = self._basic_ops[:n], self._basic_ops[n:]
        qkv = _qkv_hand_off(ctxs[:n], head, ctxs[n], x)
        if qkv is None:  # this call cannot cast in the epilogue: the unfused equivalent
            qkv = linear_bias_activation_forward(ctxs[:n], head, x)
        if len(tail) == 1:
            y = attention_forward(ctxs[n], tail[0], qkv)
        else:
            residual = extra_inputs[-1][0] if isinstance(tail[-1], AddExtraInput) else None
            y = attention_linear_forward(ctxs[n:], tail, qkv, residual)
        return y, self.no_extras


def _qkv_hand_off(ctxs, head, ctx_attention, x):
    """The QKV GEMM's output as attention's ``qkv``-quantized input, cast in the
    GEMM's epilogue; ``None`` when this call cannot do so."""
    run = ctx_attention.run
    if not (run.quantizing and fp8_attention(ctx_attention.quantizers)):
        return None
    if run.needs_backward and run.backward_override == "high_precision":
        return None  # attention's backward reads the high-precision q, k, v
    quantizer = ctx_attention.quantizers["qkv"]
    cast = quantizer.epilogue_cast(x.device)
    if cast is None:
        return None
    bias = head[1].bias_as(run.compute_dtype) if len(head) > 1 else None
    data = linear_forward(ctxs[0], head[0], x, bias=bias, out_cast=cast)  # (M, W) E4M3
    shape = (*x.shape[:-1], data.shape[-1])
    return quantizer.adopt_epilogue_cast(cast, data, shape, run.compute_dtype)
