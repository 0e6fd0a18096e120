"""Activations: GELU (tanh approximation), ReLU, SiLU, and SwiGLU (gated halves)."""

from __future__ import annotations

from ... import backend
from ..gemm import activation_backward, apply_activation
from ..op import BasicOperation

__all__ = ["Activation", "GELU", "ReLU", "SiLU", "SwiGLU", "activation_bias_backward"]


class Activation(BasicOperation):
    """Elementwise activation ``kind``; saves its input for the backward."""

    module_type = "activation"
    kind: str = ""

    def check_shapes(self, in_shape, quantizers):
        if self.kind == "swiglu":
            if in_shape[-1] % 2:
                raise ValueError(f"{self.describe()}: input's last dim ({in_shape[-1]}) must be even (gate and up halves)")
            return in_shape[:-1] + (in_shape[-1] // 2,)
        return in_shape

    def op_forward(self, ctx, x, extra_inputs):
        run = ctx.run
        if x.dtype is not run.compute_dtype:
            x = x.to(run.compute_dtype)
        if run.needs_backward:
            ctx.saved["x"] = x
        return apply_activation(x, self.kind), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return activation_backward(dy, ctx.saved["x"], self.kind), [], []


class GELU(Activation):
    kind = "gelu"


class ReLU(Activation):
    kind = "relu"


class SiLU(Activation):
    kind = "silu"


class SwiGLU(Activation):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d`` half the last dim."""

    kind = "swiglu"


def activation_bias_backward(ctx_act, bias_op, dy):
    """``(d pre-activation, dbias)`` of ``Bias -> activation`` in one pass, from the
    activation's saved input (for the fused ops that run the two together)."""
    x = ctx_act.saved["x"]
    dx, db = backend.resolve("dact_dbias", x.device).fn(dy.to(x.dtype), x, ctx_act.op.kind)
    return dx, db.to(bias_op.bias.dtype)
