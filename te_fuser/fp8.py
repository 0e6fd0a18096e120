"""Facts about the FP8 formats for the upper layers: ``kernels/formats.py``'s table."""

from __future__ import annotations

import enum

import torch

from .kernels.formats import E4M3, E5M2, E8M0_BIAS, FP8_FORMATS
from .kernels.formats import fp8_max as _fp8_max

__all__ = ["E4M3", "E5M2", "FP8_MAX", "E8M0_BIAS", "DType", "fp8_max", "short_name", "torch_dtype"]

# Largest finite value of each format; casts saturate to +-FP8_MAX.
FP8_MAX = {dtype: f.fmax for dtype, f in FP8_FORMATS.items()}


class DType(enum.Enum):
    """TransformerEngine's dtype names (``te.DType.kFloat8E4M3``), each standing for
    its torch dtype (``.value``). Wherever te_fuser takes a dtype it also takes one
    of these; it keeps torch dtypes inside."""

    kByte = torch.uint8
    kInt32 = torch.int32
    kFloat32 = torch.float32
    kFloat16 = torch.float16
    kBFloat16 = torch.bfloat16
    kFloat8E4M3 = torch.float8_e4m3fn
    kFloat8E5M2 = torch.float8_e5m2
    kFloat4E2M1 = torch.float4_e2m1fn_x2


def torch_dtype(dtype):
    """``dtype`` as a torch dtype (a :class:`DType` gives its value; anything else is returned as it is)."""
    return dtype.value if isinstance(dtype, DType) else dtype


def fp8_max(dtype: torch.dtype) -> float:
    try:
        return _fp8_max(dtype)
    except ValueError:
        raise ValueError(f"{dtype} is not an FP8 format (expected {E4M3} or {E5M2})") from None


def short_name(dtype: torch.dtype) -> str:
    f = FP8_FORMATS.get(dtype)
    return f.name if f is not None else str(dtype).replace("torch.", "")
