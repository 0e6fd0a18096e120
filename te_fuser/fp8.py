"""Facts about the FP8 formats for the upper layers: ``kernels/formats.py``'s table."""

from __future__ import annotations

import torch

from .kernels.formats import E4M3, E5M2, E8M0_BIAS, FP8_FORMATS
from .kernels.formats import fp8_max as _fp8_max

__all__ = ["E4M3", "E5M2", "FP8_MAX", "E8M0_BIAS", "fp8_max", "short_name"]

# Largest finite value of each format; casts saturate to +-FP8_MAX.
FP8_MAX = {dtype: f.fmax for dtype, f in FP8_FORMATS.items()}


def fp8_max(dtype: torch.dtype) -> float:
    try:
        return _fp8_max(dtype)
    except ValueError:
        raise ValueError(f"{dtype} is not an FP8 format (expected {E4M3} or {E5M2})") from None


def short_name(dtype: torch.dtype) -> str:
    f = FP8_FORMATS.get(dtype)
    return f.name if f is not None else str(dtype).replace("torch.", "")
