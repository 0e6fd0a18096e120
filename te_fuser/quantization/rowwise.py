"""``Float8RowwiseQuantizer``: one fp32 scale per row, from the row's own amax."""

from __future__ import annotations

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand
from .base import Quantizer
from .role import QuantizerRole

__all__ = ["Float8RowwiseQuantizer"]


class Float8RowwiseQuantizer(Quantizer):
    """Row-wise current scaling: each row's ``scale = fmax / max(amax(row), epsilon)``,
    rounded down to a power of two when ``power_2_scales``.

    A GEMM reduces along the rows of both operands, so each copy is scaled along
    its own rows: the row-wise copy of ``x`` (M, K) has one scale per row of x
    (M, 1), the column-wise copy is ``x.T`` (K, M) quantized with one scale per
    row of ``x.T`` (K, 1), i.e. per column of x. Every GEMM of a linear layer then
    pairs two row-scaled operands. Any shape is accepted; no state is kept.
    """

    scaling = Scaling.ROW

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        power_2_scales: bool = True,
        amax_epsilon: float = 0.0,
        role: QuantizerRole | None = None,
    ) -> None:
        super().__init__(fp8_dtype, role)
        self.power_2_scales = self._checked_bool("power_2_scales", power_2_scales)
        self.amax_epsilon = self._checked_epsilon("amax_epsilon", amax_epsilon)

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        cast = backend.resolve("quantize_rowwise", x_hp.device).fn
        options = (self.fp8_dtype, self.power_2_scales, self.amax_epsilon)
        rowwise_op = cast(x_hp, *options) if rowwise else None  # (M, K), scales (M, 1)
        columnwise_op = cast(x_hp.t(), *options) if columnwise else None  # (K, M), scales (K, 1)
        return rowwise_op, columnwise_op

    def describe(self) -> str:
        extras = (", pow2" if self.power_2_scales else "") + (
            f", eps={self.amax_epsilon!r}" if self.amax_epsilon else ""
        )
        return f"rowwise({short_name(self.fp8_dtype)}{extras})"
