"""``Float8BlockQuantizer``: DeepSeek-style 1x128 or 128x128 tile scales."""

from __future__ import annotations

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.formats import block_scaling
from ..kernels.operand import ScaledOperand
from ..recipe import BLOCK_SCALING_TILE
from .base import Quantizer
from .role import QuantizerRole

__all__ = ["Float8BlockQuantizer"]


class Float8BlockQuantizer(Quantizer):
    """Block scaling with ``block_dim`` 1 (1x128 tiles) or 2 (128x128 tiles).

    - 1x128: the row-wise copy has one scale per 128 elements of a row (along K);
      the column-wise copy is quantized from the high-precision ``x.T``, one scale
      per 128 elements along M.
    - 128x128: the column-wise copy is the transposed row-wise data with the
      transposed scale grid: exactly the same tiles.

    Both copies come from one cast (one read of ``x``) when both are asked for.

    Any shape is accepted; partial tiles at the edges take their amax from the
    elements they hold. Scales are powers of two when ``power_2_scales``.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        block_dim: int | None = None,
        power_2_scales: bool = True,
        amax_epsilon: float = 0.0,
        role: QuantizerRole | None = None,
        *,
        block_scaling_dim: int | None = None,
        force_pow_2_scales: bool | None = None,
        rowwise: bool = True,
        columnwise: bool = False,
        device=None,
    ) -> None:
        """``block_scaling_dim`` and ``force_pow_2_scales`` are TransformerEngine's names for
        ``block_dim`` and ``power_2_scales`` (its default block_scaling_dim, 2, is ours)."""
        super().__init__(fp8_dtype, role, rowwise=rowwise, columnwise=columnwise, device=device)
        block_dim = self._one_of("block_dim", block_dim, "block_scaling_dim", block_scaling_dim, 2)
        power_2_scales = self._one_of("power_2_scales", power_2_scales, "force_pow_2_scales", force_pow_2_scales,
                                      True)
        if isinstance(block_dim, bool) or block_dim not in (1, 2):
            raise ValueError(
                f"Float8BlockQuantizer.block_dim: must be 1 (1x128 tiles) or 2 (128x128 tiles), got {block_dim!r}"
            )
        self.block_dim = block_dim
        self.power_2_scales = self._checked_bool("power_2_scales", power_2_scales)
        self.amax_epsilon = self._checked_epsilon("amax_epsilon", amax_epsilon)
        self.tile_rows = 1 if block_dim == 1 else BLOCK_SCALING_TILE
        self.scaling = block_scaling(self.tile_rows)

    @staticmethod
    def _one_of(name, value, te_name, te_value, default):
        """The value of a field given by our name or TransformerEngine's (not both, unless equal)."""
        if te_value is None:
            return default if value is None else value
        if value is not None and value != default and value != te_value:
            raise ValueError(f"Float8BlockQuantizer: {name}={value!r} and {te_name}={te_value!r} disagree; give one")
        return te_value

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        cast = backend.resolve("quantize_block", x_hp.device).fn
        options = (self.fp8_dtype, self.tile_rows, self.power_2_scales, self.amax_epsilon)
        if not columnwise:
            return (cast(x_hp, *options) if rowwise else None), None
        # both copies from one read: 1x128 with x.T's own scales, 128x128 the tiles transposed
        return cast(x_hp, *options, rowwise, True)

    def describe(self) -> str:
        tiles = "1x128" if self.block_dim == 1 else "128x128"
        extras = (", pow2" if self.power_2_scales else ", fp32") + (
            f", eps={self.amax_epsilon!r}" if self.amax_epsilon else ""
        )
        return f"block({short_name(self.fp8_dtype)}, {tiles}{extras})"
