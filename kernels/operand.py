"""The operand every FP8 GEMM takes: a matrix quantized along its last dimension.

Every GEMM of a linear layer is written as ``out = a @ b.T`` with ``a`` (P, R) and
``b`` (Q, R), both quantized along the reduction dimension R (their last, the
"K-major" layout Hopper's FP8 tensor cores want):

- fprop  ``y  = x  @ w.T``   a = x  row-wise (M, K),  b = w row-wise    (N, K)
- dgrad  ``dx = dy @ w``     a = dy row-wise (M, N),  b = w column-wise (K, N)
- wgrad  ``dw = dy.T @ x``   a = dy column-wise (N, M), b = x column-wise (K, M)

A column-wise copy is therefore stored transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import SCALING_TILES as SCALINGS
from .formats import Scaling

__all__ = ["ScaledOperand", "SCALINGS", "scale_grid_shape", "tensor_scaled"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_grid_shape(scaling: str, rows: int, cols: int) -> tuple[int, ...]:
    """Shape of the scale tensor of a (rows, cols) operand."""
    if scaling == Scaling.TENSOR:
        return ()
    tile_r, tile_c = SCALINGS[scaling]
    return (rows if tile_r == 1 else _ceil_div(rows, tile_r), 1 if tile_c == 0 else _ceil_div(cols, tile_c))


@dataclass(frozen=True)
class ScaledOperand:
    """``data`` (rows, R) in FP8 and its dequantization scales.

    ``scale_inv`` multiplies ``data`` to recover the high-precision values: fp32 for
    ``tensor`` (0-d), ``row`` (rows, 1) and the block scalings (one per tile);
    ``uint8`` E8M0 exponents for ``mx_32`` (value ``2**(byte - 127)``).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    scaling: str

    def __post_init__(self) -> None:
        if self.scaling == Scaling.TENSOR and self.data.dim() == 2 and self.scale_inv.dim() == 0:
            return  # the common case, valid without building the shapes below
        if self.scaling not in SCALINGS:
            raise ValueError(f"ScaledOperand.scaling: must be one of {list(SCALINGS)}, got {self.scaling!r}")
        if self.data.dim() != 2:
            raise ValueError(f"ScaledOperand.data: must be 2-D (rows, K), got shape {tuple(self.data.shape)}")
        expected = scale_grid_shape(self.scaling, *self.data.shape)
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(
                f"ScaledOperand.scale_inv: {self.scaling} scaling of a {tuple(self.data.shape)} operand "
                f"needs scales of shape {expected}, got {tuple(self.scale_inv.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype


_new, _set = object.__new__, object.__setattr__


def tensor_scaled(data: torch.Tensor, scale_inv: torch.Tensor) -> ScaledOperand:
    """``ScaledOperand(data, scale_inv, Scaling.TENSOR)`` without the checks, for
    what a per-tensor cast kernel has just returned (2-D data, a 0-d fp32 scale):
    the casts' hot path builds one or two per call."""
    op = _new(ScaledOperand)
    _set(op, "data", data)
    _set(op, "scale_inv", scale_inv)
    _set(op, "scaling", Scaling.TENSOR)
    return op


def scaled_unchecked(data: torch.Tensor, scale_inv: torch.Tensor, scaling: str) -> ScaledOperand:
    """``ScaledOperand(data, scale_inv, scaling)`` without the checks, for what a cast
    kernel has just returned in the shapes its scaling gives (the block casts' hot
    path builds two per call)."""
    op = _new(ScaledOperand)
    _set(op, "data", data)
    _set(op, "scale_inv", scale_inv)
    _set(op, "scaling", scaling)
    return op
