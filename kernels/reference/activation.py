"""Reference activations and their gradients, in fp32.

GELU is the tanh approximation (as in TransformerEngine). SwiGLU splits the last
dimension in two halves: ``silu(x[..., :d]) * x[..., d:]``.
"""

from __future__ import annotations

import math

import torch

from ..formats import ACTIVATIONS

__all__ = ["ACTIVATIONS", "activation_reference", "activation_grad_reference", "dact_dbias_reference"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)))


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
    t = torch.tanh(inner)
    d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def activation_reference(x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``kind(x)`` computed in fp32 (or fp64 for fp64 input), returned in that dtype
    or rounded once to ``out_dtype``."""
    x = x if x.dtype == torch.float64 else x.float()
    if kind == "gelu":
        y = _gelu(x)
    elif kind == "relu":
        y = torch.relu(x)
    elif kind == "silu":
        y = x * torch.sigmoid(x)
    elif kind == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    else:
        raise ValueError(f"activation: must be one of {list(ACTIVATIONS)}, got {kind!r}")
    return y if out_dtype is None else y.to(out_dtype)


def activation_grad_reference(dy: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """Gradient w.r.t. the activation's input ``x`` given the output gradient ``dy``."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, dy = x.to(wide), dy.to(wide)
    if kind == "gelu":
        return dy * _gelu_grad(x)
    if kind == "relu":
        return dy * (x > 0).to(wide)
    if kind == "silu":
        return dy * _silu_grad(x)
    if kind == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        silu = gate * torch.sigmoid(gate)
        return torch.cat([dy * up * _silu_grad(gate), dy * silu], dim=-1)
    raise ValueError(f"activation: must be one of {list(ACTIVATIONS)}, got {kind!r}")


def dact_dbias_reference(
    dy: torch.Tensor, x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``Bias -> activation``: ``dx = dact(dy, x)`` rounded to
    ``out_dtype`` (default ``x.dtype``), and ``dbias`` = the fp32 sum over rows of
    that rounded ``dx`` — the same numbers the unfused activation and bias
    backwards produce."""
    dx = activation_grad_reference(dy, x, kind).to(x.dtype if out_dtype is None else out_dtype)
    dbias = dx.reshape(-1, dx.shape[-1]).float().sum(dim=0)
    return dx, dbias
