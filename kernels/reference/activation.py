"""Reference activations and their gradients, in fp32 (fp64 for fp64 input).

GELU is the tanh approximation (as in TransformerEngine), QGELU ``x·sigmoid(1.702x)``,
SReLU ``max(x, 0)²``. The gated kinds split the last dimension in two halves and
gate the first: ``gate(x[..., :d]) * x[..., d:]`` (SwiGLU: silu, GLU: sigmoid,
GEGLU: gelu, QGEGLU: qgelu, ReGLU: relu, SReGLU: srelu). Two gated kinds take
parameters (``params``, in the order of ``formats.ACTIVATION_PARAMS``; their
defaults when not given) and transform the up half too, as TransformerEngine's
kernels: ClampedSwiGLU ``(limit, alpha, glu_linear_offset)``,
``c·sigmoid(alpha·c) · (clamp(b, -limit, limit) + glu_linear_offset)`` with
``c = min(a, limit)`` (the gradient passes where ``a <= limit`` and
``-limit <= b <= limit``); SiTU-GLU ``(beta1, beta2)``,
``beta1·tanh(a/beta1)·sigmoid(a) · beta2·tanh(b/beta2)``.
"""

from __future__ import annotations

import math

import torch

from ..formats import ACTIVATIONS, GLU_GATES, GLU_UPS, activation_params
from .cast import check_given_amax

__all__ = ["ACTIVATIONS", "activation_reference", "activation_grad_reference", "dact_dbias_reference"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
_QGELU_C = 1.702


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)))


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    # 0.5 (1 + tanh u) = sigmoid(2u) and 0.5 (1 - tanh² u) = 2 sigmoid(2u) sigmoid(-2u):
    # the same function, without the cancellations of 1 ± tanh in fp32
    two_u = 2.0 * _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
    s, s_neg = torch.sigmoid(two_u), torch.sigmoid(-two_u)  # s_neg = 1 - s, also where s rounds to 1
    d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
    return s + 2.0 * x * s * s_neg * d_inner


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _qgelu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(_QGELU_C * x)
    return s * (1.0 + _QGELU_C * x * (1.0 - s))


# kind -> (f, f'), the unary activations and GLU's sigmoid gate
_UNARY = {
    "gelu": (_gelu, _gelu_grad),
    "relu": (torch.relu, lambda x: (x > 0).to(x.dtype)),
    "silu": (lambda x: x * torch.sigmoid(x), _silu_grad),
    "qgelu": (lambda x: x * torch.sigmoid(_QGELU_C * x), _qgelu_grad),
    "srelu": (lambda x: torch.relu(x) ** 2, lambda x: 2.0 * torch.relu(x)),
    "sigmoid": (torch.sigmoid, lambda x: torch.sigmoid(x) * (1.0 - torch.sigmoid(x))),
}


def _clamped_qgelu(limit: float, alpha: float):
    """ClampedSwiGLU's gate ``c·sigmoid(alpha·c)``, ``c = min(a, limit)``, and its
    derivative (zero where ``a > limit``, as the clamp's)."""
    def f(a):
        c = a.clamp(max=limit)
        return c * torch.sigmoid(alpha * c)

    def f_grad(a):
        c = a.clamp(max=limit)
        s = torch.sigmoid(alpha * c)
        return torch.where(a <= limit, s * (1.0 + alpha * c * (1.0 - s)), torch.zeros_like(a))
    return f, f_grad


def _sech2(u: torch.Tensor) -> torch.Tensor:
    """``1 - tanh²(u)`` as ``4e / (1 + e)²``, ``e = exp(-2|u|)``: no cancellation where tanh nears ±1."""
    e = torch.exp(-2.0 * u.abs())
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def _situ(beta1: float):
    """SiTU-GLU's gate ``beta1·tanh(a/beta1)·sigmoid(a)`` and its derivative."""
    def f(a):
        return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)

    def f_grad(a):
        t, s = torch.tanh(a / beta1), torch.sigmoid(a)
        return _sech2(a / beta1) * s + beta1 * t * s * (1.0 - s)
    return f, f_grad


def _clamp_offset(limit: float, offset: float):
    """ClampedSwiGLU's up half ``clamp(b, -limit, limit) + offset`` and its derivative."""
    return (lambda b: b.clamp(-limit, limit) + offset,
            lambda b: ((b >= -limit) & (b <= limit)).to(b.dtype))


def _softcap(beta2: float):
    """SiTU-GLU's up half ``beta2·tanh(b/beta2)`` and its derivative."""
    return (lambda b: beta2 * torch.tanh(b / beta2)), (lambda b: _sech2(b / beta2))


def _gated(kind: str, params) -> tuple:
    """``(gate, gate', up, up')`` of the gated ``kind`` (``up`` None: the identity)."""
    p = activation_params(kind, params)
    if kind == "clamped_swiglu":
        return (*_clamped_qgelu(p[0], p[1]), *_clamp_offset(p[0], p[2]))
    if kind == "situglu":
        return (*_situ(p[0]), *_softcap(p[1]))
    assert kind not in GLU_UPS, kind
    return (*_UNARY[GLU_GATES[kind]], None, None)


def _check_kind(kind: str, params=None) -> None:
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation: must be one of {list(ACTIVATIONS)}, got {kind!r}")
    activation_params(kind, params)


def activation_reference(x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
                         params: tuple | None = None, amax_out: torch.Tensor | None = None) -> torch.Tensor:
    """``kind(x)`` computed in fp32 (or fp64 for fp64 input), returned in that dtype
    or rounded once to ``out_dtype``; ``params``: a parametrized kind's values
    (its defaults when None). ``amax_out`` (a one-element fp32 tensor beside ``x``)
    is overwritten with the result's ``amax(|y|)`` as returned (0 for an empty
    result, NaN where y holds one): what a current-scaling cast of y would compute
    first, so the cast can take it as given and read y once."""
    _check_kind(kind, params)
    if amax_out is not None:
        check_given_amax(amax_out, x, "activation", "amax_out")
    y = _activation(x, kind, out_dtype, params)
    if amax_out is not None:
        _write_amax(y, amax_out)
    return y


def _write_amax(y: torch.Tensor, amax_out: torch.Tensor) -> None:
    """``amax_out`` = amax(|y|) in fp32 (0 for an empty ``y``, NaN where it holds one)."""
    amax = y.abs().amax() if y.numel() else torch.zeros((), device=y.device)
    amax_out.copy_(amax.float().reshape(amax_out.shape))


def _activation(x: torch.Tensor, kind: str, out_dtype: torch.dtype | None, params: tuple | None) -> torch.Tensor:
    x = x if x.dtype == torch.float64 else x.float()
    if kind in GLU_GATES:
        f, _, up_f, _ = _gated(kind, params)
        gate, up = x.chunk(2, dim=-1)
        y = f(gate) * (up if up_f is None else up_f(up))
    else:
        y = _UNARY[kind][0](x)
    return y if out_dtype is None else y.to(out_dtype)


def activation_grad_reference(dy: torch.Tensor, x: torch.Tensor, kind: str,
                              params: tuple | None = None) -> torch.Tensor:
    """Gradient w.r.t. the activation's input ``x`` given the output gradient ``dy``."""
    _check_kind(kind, params)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, dy = x.to(wide), dy.to(wide)
    if kind in GLU_GATES:
        f, f_grad, up_f, up_grad = _gated(kind, params)
        gate, up = x.chunk(2, dim=-1)
        if up_f is None:
            return torch.cat([dy * up * f_grad(gate), dy * f(gate)], dim=-1)
        return torch.cat([dy * up_f(up) * f_grad(gate), dy * f(gate) * up_grad(up)], dim=-1)
    return dy * _UNARY[kind][1](x)


def dact_dbias_reference(
    dy: torch.Tensor, x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
    params: tuple | None = None, amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``Bias -> activation``: ``dx = dact(dy, x)`` rounded to
    ``out_dtype`` (default ``x.dtype``), and ``dbias`` = the fp32 sum over rows of
    that rounded ``dx`` — the same numbers the unfused activation and bias
    backwards produce. ``amax_out`` (a one-element fp32 tensor beside ``x``) is
    overwritten with ``amax(|dx|)`` of dx as returned, as :func:`activation_reference`'s
    is with its output's: what a current-scaling cast of dx would compute first."""
    if amax_out is not None:
        check_given_amax(amax_out, x, "dact_dbias", "amax_out")
    dx = activation_grad_reference(dy, x, kind, params).to(x.dtype if out_dtype is None else out_dtype)
    dbias = dx.reshape(-1, dx.shape[-1]).float().sum(dim=0)
    if amax_out is not None:
        _write_amax(dx, amax_out)
    return dx, dbias
