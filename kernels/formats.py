"""The kernel layer's vocabulary: the FP8 formats and the scaling schemes, each
spelled once, here. Every backend, the quantizers and the recipes read them from
this module (``te_fuser.fp8`` re-exports the FP8 facts for the upper layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FP8Format", "FP8_FORMATS", "E4M3", "E5M2", "E8M0_BIAS", "fp8_format", "fp8_max",
    "Scaling", "SCALING_TILES", "block_scaling", "scaling_tile", "ACTIVATIONS", "ACTIVATION_CODES", "GLU_GATES",
    "GLU_UPS", "ACTIVATION_PARAMS", "activation_params", "EPILOGUE_ACTIVATIONS",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class FP8Format:
    """What the casts need to know about one FP8 format."""

    dtype: torch.dtype
    name: str  # short name: "e4m3", "e5m2"
    fmax: float  # largest finite value; casts saturate to +-fmax
    mantissa_bits: int
    min_step_exponent: int  # biased fp32 exponent of the format's subnormal step
    emax: int  # exponent of the largest power of two it holds (fmax = 1.75 * 2**emax)


FP8_FORMATS = {
    E4M3: FP8Format(E4M3, "e4m3", 448.0, 3, 127 - 9, 8),
    E5M2: FP8Format(E5M2, "e5m2", 57344.0, 2, 127 - 16, 15),
}

# E8M0 scale bytes (MXFP8): value = 2 ** (byte - 127); 255 is NaN.
E8M0_BIAS = 127


def fp8_format(fp8_dtype: torch.dtype) -> FP8Format:
    """The format of ``fp8_dtype``, or a ValueError naming the two there are."""
    try:
        return FP8_FORMATS[fp8_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"fp8_dtype: must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") from None


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return fp8_format(fp8_dtype).fmax


class Scaling:
    """The names of the scaling schemes of a quantized operand (its scales' layout)."""

    TENSOR = "tensor"  # one fp32 scale
    ROW = "row"  # one fp32 scale per row
    BLOCK_1X128 = "block_1x128"  # one fp32 scale per 1x128 slice of a row
    BLOCK_128X128 = "block_128x128"  # one fp32 scale per 128x128 tile
    MX_32 = "mx_32"  # one E8M0 byte per 32 elements of a row (MXFP8)


# scaling -> (rows per scale, columns per scale); 0 means "the whole dimension".
SCALING_TILES = {
    Scaling.TENSOR: (0, 0),
    Scaling.ROW: (1, 0),
    Scaling.BLOCK_1X128: (1, 128),
    Scaling.BLOCK_128X128: (128, 128),
    Scaling.MX_32: (1, 32),
}


def block_scaling(tile_rows: int) -> str:
    """The block scaling whose tiles have ``tile_rows`` rows (1 or 128)."""
    return Scaling.BLOCK_1X128 if tile_rows == 1 else Scaling.BLOCK_128X128


# The activations the kernels apply, and the integer code each kernel branches on
# (0: none), the same in Triton and CUDA (launchers.cuh's EpilogueActivation, which
# has the first four). GELU is the tanh approximation (TransformerEngine's), QGELU
# x·sigmoid(1.702x), SReLU max(x, 0)². The gated kinds (GLU_GATES: the gate's own
# activation) halve the last dim, x = [a, b] -> gate(a) · b (the gate on the first
# half, as TransformerEngine; torch's GLU gates the second).
#
# Two gated kinds take parameters (ACTIVATION_PARAMS: their names and
# TransformerEngine's defaults, in the order the kernels take them) and also
# transform the up half (GLU_UPS): ClampedSwiGLU (GPT-OSS's) is
# min(a, limit)·sigmoid(alpha·min(a, limit)) · (clamp(b, -limit, limit) + glu_linear_offset);
# SiTU-GLU (Kimi K3's) is beta1·tanh(a/beta1)·sigmoid(a) · beta2·tanh(b/beta2).
ACTIVATION_CODES = {None: 0, "gelu": 1, "relu": 2, "silu": 3, "swiglu": 4, "qgelu": 5, "srelu": 6,
                    "glu": 7, "geglu": 8, "qgeglu": 9, "reglu": 10, "sreglu": 11, "clamped_swiglu": 12,
                    "situglu": 13}
ACTIVATIONS = tuple(kind for kind in ACTIVATION_CODES if kind is not None)
# gated kind -> the activation of its gate ("sigmoid", "clamped_qgelu" and "situ"
# are gates only, not activation kinds)
GLU_GATES = {"swiglu": "silu", "glu": "sigmoid", "geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu",
             "sreglu": "srelu", "clamped_swiglu": "clamped_qgelu", "situglu": "situ"}
# gated kind -> what it does to its up half before the product (the others take it as it is)
GLU_UPS = {"clamped_swiglu": "clamp_offset", "situglu": "softcap"}
# kind -> ((parameter name, default), ...): a kind's parameters, in kernel order
ACTIVATION_PARAMS = {"clamped_swiglu": (("limit", 7.0), ("alpha", 1.702), ("glu_linear_offset", 1.0)),
                     "situglu": (("beta1", 4.0), ("beta2", 25.0))}


def activation_params(kind: str | None, params=None) -> tuple[float, ...]:
    """``kind``'s parameters as floats in kernel order (its defaults when ``params``
    is None or empty); a kind without parameters takes none."""
    names = ACTIVATION_PARAMS.get(kind, ())
    if not params:
        return tuple(float(d) for _, d in names)
    if len(params) != len(names):
        raise ValueError(f"activation {kind!r}: takes {len(names)} parameter(s) "
                         f"({', '.join(n for n, _ in names) or 'none'}), got {len(params)}")
    return tuple(float(p) for p in params)
# The activations a GEMM epilogue applies (Triton's and CUDA's); the fusion rules
# run any other after the GEMM.
EPILOGUE_ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")

def scaling_tile(scaling: str) -> tuple[int, int]:
    """``(rows, columns)`` per scale of ``scaling``."""
    try:
        return SCALING_TILES[scaling]
    except KeyError:
        raise ValueError(f"scaling: must be one of {list(SCALING_TILES)}, got {scaling!r}") from None
