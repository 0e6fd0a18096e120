"""Backward ``BasicLinear -> Bias -> activation``: activation and bias gradients in one
pass whose output goes straight to the linear's grad-output quantizer, then the
dgrad and wgrad GEMMs.

Under current scaling the pass also reduces the amax of the gradient it writes
(``dact_dbias``'s ``amax_out``), and the grad-output quantizer casts with that
amax given (:meth:`~te_fuser.quantization.Float8CurrentScalingQuantizer.cast_given_amax`):
the cast's second pass alone, so the gradient, the widest tensor of an MLP's
backward, is read once by the cast instead of twice. The same amax, scale and
bytes as the separate cast, bit for bit.
"""

from __future__ import annotations

import torch

from ..basic.activation import activation_bias_backward
from ..basic.linear import linear_backward
from ..op import FusedOperation

__all__ = ["BackwardLinearBiasActivation"]


class BackwardLinearBiasActivation(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        linear, bias, _act = self._basic_ops
        amax = _grad_amax_slot(ctxs[0], dy)
        d_pre, db = activation_bias_backward(ctxs[2], bias, dy, amax)
        dx, dw = linear_backward(ctxs[0], linear, d_pre, dy_amax=amax)
        return dx, [[dw], [db], []], self.no_extras


def _grad_amax_slot(ctx_linear, dy: torch.Tensor) -> torch.Tensor | None:
    """A one-element fp32 tensor for the gradient's amax where the linear's FP8
    backward casts its grad output with the amax given (current scaling), else None."""
    if not ctx_linear.run.fp8_backward:
        return None
    if getattr(ctx_linear.quantizers.get("grad_output"), "cast_given_amax", None) is None:
        return None
    return torch.empty(1, dtype=torch.float32, device=dy.device)
