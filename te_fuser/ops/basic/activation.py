"""Activations with TransformerEngine's names and meanings: GELU (the tanh
approximation), QGELU (``x·sigmoid(1.702x)``), ReLU, SReLU (``max(x, 0)²``), SiLU,
and the gated ones, which split the last dim into halves ``a, b`` and return
``gate(a) * b`` (the gate on the first half, as TE; torch's ``nn.GLU`` gates the
second): GLU (sigmoid), GEGLU (gelu), QGEGLU (qgelu), ReGLU (relu), SReGLU
(srelu), SwiGLU (silu)."""

from __future__ import annotations

import torch

from ... import backend
from ...kernels.formats import GLU_GATES
from ...quantization import Float8CurrentScalingQuantizer
from ..gemm import activation_backward, apply_activation
from ..op import BasicOperation

__all__ = ["Activation", "GELU", "QGELU", "ReLU", "SReLU", "SiLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU",
           "SwiGLU", "activation_bias_backward", "saved_input"]


class Activation(BasicOperation):
    """Elementwise activation ``kind``; saves its input for the backward.

    ``cache_quantized_input`` (TransformerEngine's argument): the input is kept for
    the backward as an FP8 E4M3 current-scaling cast (a quarter of fp32's bytes) and
    the derivative is taken at its dequantized value, so the gradient carries that
    rounding. Inside ``ForwardLinearBiasActivation`` the fused forward keeps the
    pre-activation in high precision instead.

    ``glu_interleave_size`` (gated kinds only, TransformerEngine's argument): the last
    dim holds gate and up blocks of that many columns in turn, ``[g0, u0, g1, u1,
    ...]``, instead of the two halves ``[g | u]`` (weights of a fused gate/up linear
    laid out block-interleaved).
    """

    module_type = "activation"
    kind: str = ""

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: int | None = None,
                 name: str | None = None) -> None:
        super().__init__(name)
        if not isinstance(cache_quantized_input, bool):
            raise TypeError(f"{type(self).__name__}.cache_quantized_input: must be a bool, "
                            f"got {cache_quantized_input!r}")
        if glu_interleave_size is not None:
            if self.kind not in GLU_GATES:
                raise ValueError(f"{type(self).__name__}.glu_interleave_size: only gated activations take it")
            if isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int) \
                    or glu_interleave_size <= 0:
                raise ValueError(f"{type(self).__name__}.glu_interleave_size: must be a positive integer, "
                                 f"got {glu_interleave_size!r}")
        self.cache_quantized_input = cache_quantized_input
        self.glu_interleave_size = glu_interleave_size

    def check_shapes(self, in_shape, quantizers):
        if self.kind in GLU_GATES:
            if in_shape[-1] % 2:
                raise ValueError(f"{self.describe()}: input's last dim ({in_shape[-1]}) must be even (gate and up halves)")
            size = self.glu_interleave_size
            if size is not None and in_shape[-1] % (2 * size):
                raise ValueError(f"{self.describe()}: input's last dim ({in_shape[-1]}) must be a multiple of "
                                 f"2 * glu_interleave_size ({2 * size})")
            return in_shape[:-1] + (in_shape[-1] // 2,)
        return in_shape

    def _halves(self, x):
        """``x`` with interleaved gate/up blocks as ``[gate | up]`` halves."""
        size = self.glu_interleave_size
        if size is None:
            return x
        lead, n = x.shape[:-1], x.shape[-1]
        return x.reshape(*lead, n // (2 * size), 2, size).transpose(-3, -2).reshape(*lead, n)

    def _interleaved(self, dx):
        """The inverse of :meth:`_halves`."""
        size = self.glu_interleave_size
        if size is None:
            return dx
        lead, n = dx.shape[:-1], dx.shape[-1]
        return dx.reshape(*lead, 2, n // (2 * size), size).transpose(-3, -2).reshape(*lead, n)

    def op_forward(self, ctx, x, extra_inputs):
        run = ctx.run
        if x.dtype is not run.compute_dtype:
            x = x.to(run.compute_dtype)
        x = self._halves(x)
        if run.needs_backward:
            if self.cache_quantized_input:
                ctx.saved["x_fp8"] = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
            else:
                ctx.saved["x"] = x
        return apply_activation(x, self.kind), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return self._interleaved(activation_backward(dy, saved_input(ctx), self.kind)), [], []


def saved_input(ctx) -> torch.Tensor:
    """The activation's input as its forward kept it (dequantized when cached in FP8)."""
    saved = ctx.saved
    return saved["x"] if "x" in saved else saved["x_fp8"].dequantize()


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
    x = saved_input(ctx_act)
    dx, db = backend.resolve("dact_dbias", x.device).fn(dy.to(x.dtype), x, ctx_act.op.kind)
    return ctx_act.op._interleaved(dx), db.to(bias_op.bias.dtype)
