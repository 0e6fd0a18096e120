"""Activations with TransformerEngine's names and meanings: GELU (the tanh
approximation), QGELU (``x·sigmoid(1.702x)``), ReLU, SReLU (``max(x, 0)²``), SiLU,
and the gated ones, which split the last dim into halves ``a, b`` and return
``gate(a) * b`` (the gate on the first half, as TE; torch's ``nn.GLU`` gates the
second): GLU (sigmoid), GEGLU (gelu), QGEGLU (qgelu), ReGLU (relu), SReGLU
(srelu), SwiGLU (silu)."""

from __future__ import annotations

from ... import backend
from ...kernels.formats import GLU_GATES
from ..gemm import activation_backward, apply_activation
from ..op import BasicOperation

__all__ = ["Activation", "GELU", "QGELU", "ReLU", "SReLU", "SiLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU",
           "SwiGLU", "activation_bias_backward"]


class Activation(BasicOperation):
    """Elementwise activation ``kind``; saves its input for the backward."""

    module_type = "activation"
    kind: str = ""

    def check_shapes(self, in_shape, quantizers):
        if self.kind in GLU_GATES:
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
    """``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``: the tanh approximation, as
    TransformerEngine's GELU (torch's ``gelu(x, approximate="tanh")``)."""

    kind = "gelu"


class QGELU(Activation):
    """Quick GELU, ``x·sigmoid(1.702·x)``."""

    kind = "qgelu"


class ReLU(Activation):
    kind = "relu"


class SReLU(Activation):
    """Squared ReLU, ``max(x, 0)²``."""

    kind = "srelu"


class SiLU(Activation):
    kind = "silu"


class GLU(Activation):
    """``sigmoid(x[..., :d]) * x[..., d:]`` with ``d`` half the last dim (torch's
    ``nn.GLU`` gates the second half instead)."""

    kind = "glu"


class GEGLU(Activation):
    """``gelu(x[..., :d]) * x[..., d:]``, the tanh GELU."""

    kind = "geglu"


class QGEGLU(Activation):
    """``qgelu(x[..., :d]) * x[..., d:]``."""

    kind = "qgeglu"


class ReGLU(Activation):
    """``relu(x[..., :d]) * x[..., d:]``."""

    kind = "reglu"


class SReGLU(Activation):
    """``srelu(x[..., :d]) * x[..., d:]``."""

    kind = "sreglu"


class SwiGLU(Activation):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d`` half the last dim."""

    kind = "swiglu"


def activation_bias_backward(ctx_act, bias_op, dy):
    """``(d pre-activation, dbias)`` of ``Bias -> activation`` in one pass, from the
    activation's saved input (for the fused ops that run the two together)."""
    x = ctx_act.saved["x"]
    dx, db = backend.resolve("dact_dbias", x.device).fn(dy.to(x.dtype), x, ctx_act.op.kind)
    return dx, db.to(bias_op.bias.dtype)
