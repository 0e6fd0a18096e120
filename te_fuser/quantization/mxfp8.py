"""``MXFP8Quantizer``: one E8M0 scale per 32 elements along the reduction dim."""

from __future__ import annotations

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand
from ..recipe import MXFP8_BLOCK
from .base import Quantizer
from .role import QuantizerRole

__all__ = ["MXFP8Quantizer"]


class MXFP8Quantizer(Quantizer):
    """MXFP8: the row-wise copy is scaled per 32 elements along K, the column-wise
    copy per 32 elements along M. Each copy is quantized from the high-precision
    tensor, never from the other copy, so the two may round differently.

    The quantized dimension of each requested copy must be a multiple of 32.
    """

    scaling = Scaling.MX_32

    def __init__(self, fp8_dtype: torch.dtype, role: QuantizerRole | None = None, *, rowwise: bool = True,
                 columnwise: bool = False, device=None) -> None:
        super().__init__(fp8_dtype, role, rowwise=rowwise, columnwise=columnwise, device=device)

    def check_shape(self, shape: tuple[int, ...], *, rowwise: bool = True, columnwise: bool = False) -> None:
        rows, cols = self._flat_shape(shape)
        wanted = [("rowwise", 1, "columns", cols)] if rowwise else []
        wanted += [("columnwise", 0, "rows", rows)] if columnwise else []
        for copy, dim, dim_name, size in wanted:
            if size % MXFP8_BLOCK:
                raise ValueError(
                    f"{self._who()}: the {copy} copy of a tensor of shape {tuple(shape)} is quantized along "
                    f"dim {dim} ({dim_name}, {size}) of its 2-D flattening {(rows, cols)}, which must be a "
                    f"multiple of {MXFP8_BLOCK} (one E8M0 scale per {MXFP8_BLOCK} elements)"
                )

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        cast = backend.resolve("quantize_mxfp8", x_hp.device).fn
        rowwise_op = cast(x_hp, self.fp8_dtype) if rowwise else None  # (M, K), scales along K
        columnwise_op = cast(x_hp.t(), self.fp8_dtype) if columnwise else None  # (K, M), scales along M
        return rowwise_op, columnwise_op

    def describe(self) -> str:
        return f"mxfp8({short_name(self.fp8_dtype)})"
