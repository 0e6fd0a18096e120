"""Facts about the FP8 formats, in one place."""

from __future__ import annotations

import torch

__all__ = ["E4M3", "E5M2", "FP8_MAX", "E8M0_BIAS", "fp8_max", "short_name"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# Largest finite value of each format; casts saturate to +-FP8_MAX.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Exponent of the largest power of two each format holds (448 = 1.75 * 2**8).
FP8_EMAX = {E4M3: 8, E5M2: 15}
# E8M0 scale bytes: value = 2 ** (byte - 127); 255 is NaN.
E8M0_BIAS = 127

_SHORT = {E4M3: "e4m3", E5M2: "e5m2"}


def fp8_max(dtype: torch.dtype) -> float:
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not an FP8 format (expected {E4M3} or {E5M2})") from None


def short_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))
