"""Forward ``BasicLinear -> Bias [-> activation] -> BasicLinear [-> Bias [-> activation | AddExtraInput]]``:
the first GEMM's epilogue writes the second linear's FP8 input.

The first GEMM adds the bias (and applies the activation), rounds the fp32 result
to the compute dtype and casts it to FP8 with the scale of the second linear's
input quantizer, reducing its amax in the same pass; the second linear runs its
GEMM on that FP8 input (its own bias and activation or residual add in its
epilogue, as :class:`ForwardLinearBiasActivation` and :class:`ForwardLinearBiasAdd` do). The high-precision hidden tensor is
never written, nor read back by a separate cast.

Numerics: the rounding to the compute dtype before the cast makes the FP8 bytes,
the amax and hence the scaling state exactly those of the separate cast of the
rounded GEMM output: the fused op equals ``ForwardLinearBiasActivation`` followed
by the second linear, bit for bit.

It applies where the input quantizer knows its scale before the tensor exists
(:meth:`~te_fuser.quantization.Quantizer.epilogue_cast`: delayed scaling, once
seeded). A call that cannot hand FP8 over runs the unfused equivalent: a fresh
delayed-scaling quantizer (its first tensor seeds the scale), an activation
whose backward needs the pre-activation, a second linear whose backward wants
its input in high precision (``backward_override='high_precision'``). The
column-wise copy the second linear's wgrad needs is the transpose of the FP8
bytes (one per-tensor scale), not a second cast.

Under current scaling, in training (the ``forward_activation_amax_*`` rules), the
activation runs as its own kernel after the GEMM (its backward needs the
pre-activation) and reduces the amax of its output as it writes it
(:meth:`~te_fuser.ops.basic.activation.Activation.forward_reducing_amax`); the
second linear's input quantizer then casts with that amax given
(:meth:`~te_fuser.quantization.Float8CurrentScalingQuantizer.cast_given_amax`),
its second pass alone: the hidden tensor is read once by the cast instead of
twice. The same amax, scale and bytes as the separate cast, bit for bit.
"""

from __future__ import annotations

import torch

from ..basic.extra import AddExtraInput
from ..basic.linear import (BasicLinear, input_needs_columnwise, linear_bias_activation_forward,
                            linear_bias_add_forward, linear_forward)
from ..op import FusedOperation

__all__ = ["ForwardLinearBiasLinear"]


class ForwardLinearBiasLinear(FusedOperation):
    """``y = tail(head(x))``: ``head`` = [linear, bias, activation?] hands its output
    to ``tail`` = [linear, bias?, activation? | add?] as FP8 cast in its GEMM's epilogue."""

    def __init__(self, basic_ops) -> None:
        super().__init__(basic_ops)
        self._split = next(i for i in range(1, len(basic_ops)) if isinstance(basic_ops[i], BasicLinear))

    def fuser_forward(self, ctxs, x, extra_inputs):
        n = self._split
        head, tail = self._basic_ops[:n], self._basic_ops[n:]
        hidden = _hand_off(ctxs[:n], head, ctxs[n], tail[0], x)
        if hidden is None:
            hidden = _amax_hand_off(ctxs[:n], head, ctxs[n], tail[0], x)
        if hidden is None:  # this call can hand neither FP8 nor an amax over: the unfused equivalent
            hidden = linear_bias_activation_forward(ctxs[:n], head, x)
        if isinstance(tail[-1], AddExtraInput):
            (residual,) = extra_inputs[-1]
            y = linear_bias_add_forward(ctxs[n:], tail, hidden, residual)
        else:
            y = linear_bias_activation_forward(ctxs[n:], tail, hidden)
        return y, self.no_extras


def _hand_off(ctxs, head, ctx_next, linear_next, x):
    """The head's output as the next linear's quantized input, cast in the head
    GEMM's epilogue; ``None`` when this call cannot do so."""
    run = ctx_next.run
    act = head[2] if len(head) > 2 else None
    if not run.quantizing:
        return None
    if run.needs_backward and (act is not None or run.backward_override == "high_precision"):
        return None  # the backward needs the pre-activation, or the input in high precision
    quantizer = ctx_next.quantizers.get("input")
    cast = quantizer.epilogue_cast(x.device)
    if cast is None:
        return None
    data = linear_forward(ctxs[0], head[0], x, bias=head[1].bias_as(run.compute_dtype),
                          activation=None if act is None else act.kind, out_cast=cast)  # (M, N) FP8
    shape = (*x.shape[:-1], data.shape[-1])
    return quantizer.adopt_epilogue_cast(cast, data, shape, run.compute_dtype,
                                         columnwise=input_needs_columnwise(ctx_next, linear_next))


def _amax_hand_off(ctxs, head, ctx_next, linear_next, x):
    """The head's activation output as the next linear's quantized input, cast with the
    amax the activation kernel reduced (the cast's second pass alone); ``None`` when
    this call cannot: no activation, no backward (the GEMM's epilogue then applies
    the activation, so no kernel writes its output apart), a backward that wants
    the input in high precision, or an input quantizer that takes no given amax."""
    run = ctx_next.run
    if len(head) < 3 or not run.quantizing or not run.needs_backward or run.backward_override == "high_precision":
        return None
    cast_given_amax = getattr(ctx_next.quantizers.get("input"), "cast_given_amax", None)
    if cast_given_amax is None:
        return None
    pre = linear_forward(ctxs[0], head[0], x, bias=head[1].bias_as(run.compute_dtype))
    amax = torch.empty(1, dtype=torch.float32, device=pre.device)
    hidden = head[2].forward_reducing_amax(ctxs[2], pre, amax)
    return cast_given_amax(hidden, amax, rowwise=True, columnwise=input_needs_columnwise(ctx_next, linear_next))
