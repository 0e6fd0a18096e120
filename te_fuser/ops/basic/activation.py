"""Activations with TransformerEngine's names and meanings: GELU (the tanh
approximation), QGELU (``x·sigmoid(1.702x)``), ReLU, SReLU (``max(x, 0)²``), SiLU,
and the gated ones, which split the last dim into halves ``a, b`` and return
``gate(a) * b`` (the gate on the first half, as TE; torch's ``nn.GLU`` gates the
second): GLU (sigmoid), GEGLU (gelu), QGEGLU (qgelu), ReGLU (relu), SReGLU
(srelu), SwiGLU (silu); ClampedSwiGLU (GPT-OSS's) and SiTUGLU (Kimi K3's), which
take parameters and transform the up half too; and the post-scaled ones, whose
output is multiplied by a second input of per-row scales (``y = scales[..., None] *
act(x)``, the scales a differentiable extra input of the call, ``op(x, scales)``):
ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU, ScaledSReLU."""

from __future__ import annotations

import math

import torch

from ... import backend
from ...kernels.formats import GLU_GATES
from ...quantization import Float8CurrentScalingQuantizer
from ..op import BasicOperation

__all__ = ["Activation", "GELU", "QGELU", "ReLU", "SReLU", "SiLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU",
           "SwiGLU", "ClampedSwiGLU", "SiTUGLU", "ScaledActivation", "ScaledSwiGLU", "ScaledSiTUGLU",
           "ScaledClampedQGeGLU", "ScaledSReLU", "activation_bias_backward", "saved_input"]


def _check_interleave(owner: str, kind: str, glu_interleave_size) -> None:
    if glu_interleave_size is None:
        return
    if kind not in GLU_GATES:
        raise ValueError(f"{owner}.glu_interleave_size: only gated activations take it")
    if isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int) or glu_interleave_size <= 0:
        raise ValueError(f"{owner}.glu_interleave_size: must be a positive integer, got {glu_interleave_size!r}")


def _out_shape(op, in_shape):
    """The output shape of ``op`` (an activation, plain or scaled) for ``in_shape``."""
    if op.kind in GLU_GATES:
        if in_shape[-1] % 2:
            raise ValueError(f"{op.describe()}: input's last dim ({in_shape[-1]}) must be even (gate and up halves)")
        size = op.glu_interleave_size
        if size is not None and in_shape[-1] % (2 * size):
            raise ValueError(f"{op.describe()}: input's last dim ({in_shape[-1]}) must be a multiple of "
                             f"2 * glu_interleave_size ({2 * size})")
        return in_shape[:-1] + (in_shape[-1] // 2,)
    return in_shape


def _halves(x, size):
    """``x`` with interleaved gate/up blocks of ``size`` columns as ``[gate | up]`` halves."""
    if size is None:
        return x
    lead, n = x.shape[:-1], x.shape[-1]
    return x.reshape(*lead, n // (2 * size), 2, size).transpose(-3, -2).reshape(*lead, n)


def _interleaved(dx, size):
    """The inverse of :func:`_halves`."""
    if size is None:
        return dx
    lead, n = dx.shape[:-1], dx.shape[-1]
    return dx.reshape(*lead, 2, n // (2 * size), size).transpose(-3, -2).reshape(*lead, n)


def _act(x, kind, params, out_dtype, amax_out=None):
    """``kind(x)`` by the backend kernel: fp32 (fp64 for fp64 input) or rounded once to ``out_dtype``;
    with ``amax_out``, amax(|result|) written there in the same pass."""
    return backend.resolve("activation", x.device).fn(x, kind, out_dtype=out_dtype, params=params, amax_out=amax_out)


def _act_grad(dy, x, kind, params):
    """The input gradient, in fp32 (fp64 for fp64 input)."""
    return backend.resolve("activation_grad", x.device).fn(dy, x, kind, params=params)


def _finite(owner: str, name: str, value, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"{owner}: {name} must be finite{' and positive' if positive else ''}, got {value!r}")
    return float(value)


class _ClampedGLUArgs:
    """The clamped SwiGLU's arguments (``limit`` finite and positive, ``alpha``,
    ``glu_linear_offset`` finite), checked, and the kernel parameters they make:
    shared by :class:`ClampedSwiGLU` and :class:`ScaledClampedQGeGLU`."""

    def _set_clamp(self, limit, alpha, glu_linear_offset) -> None:
        owner = type(self).__name__
        self.limit = _finite(owner, "limit", limit, positive=True)
        self.alpha = _finite(owner, "alpha", alpha)
        self.glu_linear_offset = _finite(owner, "glu_linear_offset", glu_linear_offset)

    @property
    def params(self) -> tuple[float, ...]:
        return (self.limit, self.alpha, self.glu_linear_offset)


class _SoftCapArgs:
    """SiTUGLU's soft caps ``beta1``, ``beta2`` (finite and positive), checked, and
    its kernel parameters: shared by :class:`SiTUGLU` and :class:`ScaledSiTUGLU`."""

    def _set_caps(self, beta1, beta2) -> None:
        owner = type(self).__name__
        self.beta1 = _finite(owner, "beta1", beta1, positive=True)
        self.beta2 = _finite(owner, "beta2", beta2, positive=True)

    @property
    def params(self) -> tuple[float, ...]:
        return (self.beta1, self.beta2)


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
        _check_interleave(type(self).__name__, self.kind, glu_interleave_size)
        self.cache_quantized_input = cache_quantized_input
        self.glu_interleave_size = glu_interleave_size

    @property
    def params(self) -> tuple[float, ...]:
        """The kind's parameters in kernel order (``formats.ACTIVATION_PARAMS``); none for most."""
        return ()

    def check_shapes(self, in_shape, quantizers):
        return _out_shape(self, in_shape)

    def _halves(self, x):
        """``x`` with interleaved gate/up blocks as ``[gate | up]`` halves."""
        return _halves(x, self.glu_interleave_size)

    def _interleaved(self, dx):
        """The inverse of :meth:`_halves`."""
        return _interleaved(dx, self.glu_interleave_size)

    def op_forward(self, ctx, x, extra_inputs):
        return self.forward_reducing_amax(ctx, x), []

    def forward_reducing_amax(self, ctx, x, amax_out: torch.Tensor | None = None) -> torch.Tensor:
        """The op's forward output; with ``amax_out`` (a one-element fp32 tensor on
        x's device) also its amax(|y|), reduced by the kernel as it writes y: what a
        current-scaling cast of y computes first (see ForwardLinearBiasLinear)."""
        run = ctx.run
        if x.dtype is not run.compute_dtype:
            x = x.to(run.compute_dtype)
        x = self._halves(x)
        if run.needs_backward:
            if self.cache_quantized_input:
                ctx.saved["x_fp8"] = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
            else:
                ctx.saved["x"] = x
        return _act(x, self.kind, self.params, x.dtype, amax_out)

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x = saved_input(ctx)
        dx = _act_grad(dy, x, self.kind, self.params)
        return self._interleaved(dx if dx.dtype is x.dtype else dx.to(x.dtype)), [], []


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


class ClampedSwiGLU(_ClampedGLUArgs, Activation):
    """GPT-OSS's SwiGLU, as TransformerEngine's: with ``a, b`` the halves,
    ``c = min(a, limit)``, ``c·sigmoid(alpha·c) · (clamp(b, -limit, limit) +
    glu_linear_offset)``. The gradient is the clamps' (zero for ``a > limit`` and
    for ``|b| > limit``). ``limit`` must be finite and positive (TransformerEngine
    does not check it)."""

    kind = "clamped_swiglu"

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
                 cache_quantized_input: bool = False, glu_interleave_size: int | None = None,
                 name: str | None = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size,
                         name=name)
        self._set_clamp(limit, alpha, glu_linear_offset)


class SiTUGLU(_SoftCapArgs, Activation):
    """Kimi K3's soft-capped SiLU GLU, as TransformerEngine's:
    ``beta1·tanh(a/beta1)·sigmoid(a) · beta2·tanh(b/beta2)`` (``beta1``, ``beta2``
    finite and positive)."""

    kind = "situglu"

    def __init__(self, *, beta1: float = 4.0, beta2: float = 25.0, cache_quantized_input: bool = False,
                 glu_interleave_size: int | None = None, name: str | None = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size,
                         name=name)
        self._set_caps(beta1, beta2)


class ScaledActivation(BasicOperation):
    """``scales[..., None] * kind(x)``: an activation whose output rows are scaled by
    the extra input ``scales`` (of the output's shape without its last dim; a
    router's probabilities in a mixture of experts), ``op(x, scales)`` or inside a
    ``Sequential`` ``seq(x, scales)``. The product is taken in fp32 (fp64 for fp64
    input) and rounded once; the backward gives ``x`` and ``scales`` their gradients
    (``d scales`` = the row sums of ``dy * kind(x)``). Not an ``Activation``: the
    fusion rules over activations leave it alone (it runs as its own op).

    ``activation_recompute_in_mlp`` (TransformerEngine's): asks fused grouped-MLP
    kernels to recompute the activation in the backward; there are none here, so
    a gated kind refuses it when built (as TransformerEngine's) and ScaledSReLU
    when it runs.
    """

    module_type = "activation"
    num_extra_inputs = 1
    kind: str = ""

    def __init__(self, glu_interleave_size: int | None = None, *, activation_recompute_in_mlp: bool = False,
                 name: str | None = None) -> None:
        super().__init__(name)
        if not isinstance(activation_recompute_in_mlp, bool):
            raise TypeError(f"{type(self).__name__}.activation_recompute_in_mlp: must be a bool, "
                            f"got {activation_recompute_in_mlp!r}")
        if activation_recompute_in_mlp and self.kind in GLU_GATES:
            raise ValueError(f"{type(self).__name__} does not support activation recomputation in the fused "
                             "grouped MLP")
        _check_interleave(type(self).__name__, self.kind, glu_interleave_size)
        self.glu_interleave_size = glu_interleave_size
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    @property
    def params(self) -> tuple[float, ...]:
        return ()

    def check_shapes(self, in_shape, quantizers):
        return _out_shape(self, in_shape)

    def op_forward(self, ctx, x, extra_inputs):
        if self.activation_recompute_in_mlp:
            raise RuntimeError(f"{type(self).__name__}(activation_recompute_in_mlp=True) requires a fused grouped "
                               "MLP, which te_fuser does not have")
        (scales,) = extra_inputs
        run = ctx.run
        if x.dtype is not run.compute_dtype:
            x = x.to(run.compute_dtype)
        if tuple(scales.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{self.describe()}: scales must have the input's shape without its last dim, "
                             f"{tuple(x.shape[:-1])}, got {tuple(scales.shape)}")
        x = _halves(x, self.glu_interleave_size)
        act = _act(x, self.kind, self.params, None)  # fp32 (fp64 for fp64 input)
        y = (act * scales.to(act.dtype).unsqueeze(-1)).to(x.dtype)
        if run.needs_backward:
            ctx.saved["x"] = x
            ctx.saved["scales"] = scales
        return y, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x, scales = ctx.saved["x"], ctx.saved["scales"]
        wide = torch.float64 if x.dtype is torch.float64 else torch.float32
        dy = dy.to(wide)
        dx = _act_grad(dy * scales.to(wide).unsqueeze(-1), x, self.kind, self.params)
        dx = _interleaved(dx if dx.dtype is x.dtype else dx.to(x.dtype), self.glu_interleave_size)
        d_scales = None
        if scales.requires_grad:
            d_scales = (dy * _act(x, self.kind, self.params, None).to(wide)).sum(dim=-1).to(scales.dtype)
        return dx, [], [d_scales]


class ScaledSwiGLU(ScaledActivation):
    """``scales[..., None] * silu(a) * b`` (TransformerEngine's ScaledSwiGLU)."""

    kind = "swiglu"


class ScaledSiTUGLU(_SoftCapArgs, ScaledActivation):
    """``scales[..., None] * SiTUGLU(x)`` (TransformerEngine's ScaledSiTUGLU)."""

    kind = "situglu"

    def __init__(self, glu_interleave_size: int | None = None, *, activation_recompute_in_mlp: bool = False,
                 beta1: float = 4.0, beta2: float = 25.0, name: str | None = None) -> None:
        super().__init__(glu_interleave_size, activation_recompute_in_mlp=activation_recompute_in_mlp, name=name)
        self._set_caps(beta1, beta2)


class ScaledClampedQGeGLU(_ClampedGLUArgs, ScaledActivation):
    """``scales[..., None] * ClampedSwiGLU(x)`` (TransformerEngine's
    ScaledClampedQGeGLU: the clamped GLU's numerics, its defaults limit 7, alpha
    1.702, glu_linear_offset 1)."""

    kind = "clamped_swiglu"

    def __init__(self, glu_interleave_size: int | None = None, *, activation_recompute_in_mlp: bool = False,
                 limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
                 name: str | None = None) -> None:
        super().__init__(glu_interleave_size, activation_recompute_in_mlp=activation_recompute_in_mlp, name=name)
        self._set_clamp(limit, alpha, glu_linear_offset)


class ScaledSReLU(ScaledActivation):
    """``scales[..., None] * max(x, 0)²`` (TransformerEngine's ScaledSReLU; it takes
    no glu_interleave_size)."""

    kind = "srelu"

    def __init__(self, *, activation_recompute_in_mlp: bool = False, name: str | None = None) -> None:
        super().__init__(None, activation_recompute_in_mlp=activation_recompute_in_mlp, name=name)


def activation_bias_backward(ctx_act, bias_op, dy, amax_out: torch.Tensor | None = None):
    """``(d pre-activation, dbias)`` of ``Bias -> activation`` in one pass, from the
    activation's saved input (for the fused ops that run the two together); with
    ``amax_out`` (a one-element fp32 tensor on x's device) also amax(|d pre-activation|),
    reduced by the kernel as it writes it (see BackwardLinearBiasActivation)."""
    x = saved_input(ctx_act)
    op = ctx_act.op
    dy = dy if dy.dtype is x.dtype else dy.to(x.dtype)
    dx, db = backend.lean_first(backend.resolve("dact_dbias", x.device).fn, dy, x, op.kind, params=op.params,
                                amax_out=amax_out)  # a lean entry hands an amax_out on to the checked call
    dtype = bias_op.bias.dtype
    return ctx_act.op._interleaved(dx), (db if db.dtype is dtype else db.to(dtype))
