"""``IdentityQuantizer``: high precision, no FP8."""

from __future__ import annotations

import torch

from ..kernels.reference.cast import check_sums_dtype
from .base import Quantizer
from .role import QuantizerRole

__all__ = ["IdentityQuantizer"]


class IdentityQuantizer(Quantizer):
    """Leaves tensors in high precision: ``quantizer(x) is x`` and ``quantizer.cast(x) is x``.

    Needs no FP8 hardware, so :meth:`check_device` never fails, and accepts any
    shape.
    """

    scaling = "identity"
    min_compute_capability = None
    flattens = False  # its cast is x itself, of x's dims

    def __init__(self, role: QuantizerRole | None = None) -> None:
        super().__init__(None, role)

    def __call__(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> torch.Tensor:
        return x

    def cast(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> torch.Tensor:
        return x

    def quantize_with_column_sums(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
                                  as_dtype: torch.dtype | None = None, sums_dtype: torch.dtype = torch.float32):
        """``x`` (converted to ``as_dtype`` when given) and the column sums of ``x`` as it
        is, summed in fp32 and returned as ``sums_dtype``."""
        if sums_dtype is not torch.float32:
            check_sums_dtype(sums_dtype, "IdentityQuantizer.quantize_with_column_sums")
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        sums = x2d.sum(dim=0, dtype=torch.float32).to(sums_dtype)
        return (x if as_dtype is None or as_dtype is x.dtype else x.to(as_dtype)), sums

    def check_shape(self, shape: tuple[int, ...], *, rowwise: bool = True, columnwise: bool = False) -> None:
        return None

    def describe(self) -> str:
        return "identity"
