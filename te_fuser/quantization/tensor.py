"""``QuantizedTensor``: the FP8 copies of one high-precision tensor.

A tensor of any shape ``(..., K)`` is quantized as its 2-D flattening ``(M, K)``
with ``M = prod(leading dims)``. It may carry two copies, each a
:class:`~te_fuser.kernels.operand.ScaledOperand` quantized along its last dim:

- ``rowwise``:    data ``(M, K)``, quantized along K (the operand of ``x @ w.T``);
- ``columnwise``: data ``(K, M)``, the transposed copy, quantized along M (the
  operand of the GEMMs that reduce over M: ``dy.T @ x`` and ``dy @ w``).

Plain storage, not a ``torch.Tensor`` subclass: ops hand the copies to the GEMM
kernels and call :meth:`QuantizedTensor.dequantize` where high precision is needed.
"""

from __future__ import annotations

import math

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.operand import ScaledOperand

__all__ = ["QuantizedTensor", "flat_2d_shape"]

_new = object.__new__


def flat_2d_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(M, K)`` of the 2-D flattening of ``shape``: ``M = prod(shape[:-1])``."""
    if len(shape) == 0:
        raise ValueError("quantization needs a tensor of at least 1 dimension, got a 0-d shape ()")
    return math.prod(shape[:-1]), shape[-1]


class QuantizedTensor:
    """The row-wise and/or column-wise FP8 copies of a tensor of ``shape``.

    ``dtype`` is the high-precision dtype :meth:`dequantize` returns by default.
    """

    __slots__ = ("rowwise", "columnwise", "shape", "dtype", "__weakref__")

    def __init__(
        self, rowwise: ScaledOperand | None, columnwise: ScaledOperand | None, shape: torch.Size, dtype: torch.dtype
    ) -> None:
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.shape = shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self.dtype = dtype
        if rowwise is None and columnwise is None:
            raise ValueError("QuantizedTensor: needs a rowwise or a columnwise copy, got neither")
        rows, cols = shape if len(shape) == 2 else flat_2d_shape(shape)
        if rowwise is not None:
            self._check_copy("rowwise", rowwise, (rows, cols))
        if columnwise is not None:
            self._check_copy("columnwise", columnwise, (cols, rows))

    @classmethod
    def of_cast(cls, rowwise: ScaledOperand | None, columnwise: ScaledOperand | None, shape: torch.Size,
                dtype: torch.dtype) -> "QuantizedTensor":
        """``QuantizedTensor(rowwise, columnwise, shape, dtype)`` without the checks, for
        a cast's own copies of a tensor of ``shape`` (a ``torch.Size``)."""
        q = _new(cls)
        q.rowwise, q.columnwise, q.shape, q.dtype = rowwise, columnwise, shape, dtype
        return q

    def _check_copy(self, name: str, op: ScaledOperand, expected: tuple[int, int]) -> None:
        if not isinstance(op, ScaledOperand):
            raise TypeError(f"QuantizedTensor.{name}: must be a ScaledOperand or None, got {type(op).__name__}")
        if op.data.shape != expected:
            raise ValueError(
                f"QuantizedTensor.{name}: a tensor of shape {tuple(self.shape)} needs {name} data of "
                f"shape {expected}, got {tuple(op.data.shape)}"
            )

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise is not None

    def _any_copy(self) -> ScaledOperand:
        return self.rowwise if self.rowwise is not None else self.columnwise

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._any_copy().data.dtype

    @property
    def scaling(self) -> str:
        return self._any_copy().scaling

    @property
    def device(self) -> torch.device:
        return self._any_copy().data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: FP8 data plus scales of every copy present."""
        copies = [op for op in (self.rowwise, self.columnwise) if op is not None]
        return sum(op.data.nbytes + op.scale_inv.nbytes for op in copies)

    def to(self, *args, **kwargs) -> torch.Tensor:
        """The values as a plain tensor, as ``torch.Tensor.to`` takes its arguments
        (TransformerEngine's QuantizedTensor dequantizes so): a dtype is dequantized
        into directly (one rounding), a device moves the result."""
        dtype = kwargs.pop("dtype", None)
        rest = []
        for a in args:
            if isinstance(a, torch.dtype) and dtype is None:
                dtype = a
            else:
                rest.append(a)
        out = self.dequantize(dtype)
        return out.to(*rest, **kwargs) if (rest or kwargs) else out

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor of the original shape, in ``dtype`` (default ``self.dtype``).

        Uses the row-wise copy when present, else the column-wise one transposed back.
        """
        out_dtype = self.dtype if dtype is None else dtype
        dequantize = backend.resolve("dequantize", self.device).fn
        if self.rowwise is not None:
            return dequantize(self.rowwise, out_dtype).reshape(self.shape)  # (M, K) -> shape
        x_t = dequantize(self.columnwise, out_dtype)  # (K, M)
        return x_t.t().contiguous().reshape(self.shape)  # (M, K) -> shape

    def __repr__(self) -> str:
        def copy_text(op: ScaledOperand | None) -> str:
            if op is None:
                return "None"
            return f"{short_name(op.data.dtype)} {op.scaling} {tuple(op.data.shape)}"

        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={short_name(self.dtype)}, "
            f"rowwise={copy_text(self.rowwise)}, columnwise={copy_text(self.columnwise)}, "
            f"nbytes={self.nbytes})"
        )
