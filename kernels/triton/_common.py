"""Shared pieces of the Triton kernels: FP8 rounding, scales, and launcher checks.

Every FP8 cast here rounds onto the FP8 grid in fp32 arithmetic and builds the
FP8 byte in int32 arithmetic (:func:`fp8_bytes`): no float-to-FP8 conversion, whose
interpreted form rounds wrongly and whose compiled form Triton 3.6 miscompiled on
the H200 in some layouts. That makes the kernels bit-exact against
:mod:`te_fuser.kernels.reference` both on a GPU and under ``TRITON_INTERPRET=1``.
The FP8 bytes are written through a ``uint8`` view; NaN gets the encoding torch
uses (``0x7F`` plus the sign bit). Divisions are IEEE (``tl.math.div_rn``), amaxes
are integer maxima of the bits of |x| (ordered like the values, NaN above inf, so
NaN propagates as in ``torch.amax``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# fp8 dtype -> (largest finite value, mantissa bits, biased fp32 exponent of the
# subnormal step, exponent of the largest power of two the format holds)
FP8_FORMAT = {
    torch.float8_e4m3fn: (448.0, 3, 127 - 9, 8),
    torch.float8_e5m2: (57344.0, 2, 127 - 16, 15),
}
FLT_MAX = 3.4028234663852886e38


# --------------------------------------------------------------------------- jit


@triton.jit
def round_to_fp8_grid(v, FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr):
    """fp32 ``v`` saturated to +-FMAX and rounded to the FP8 grid (nearest, ties to
    even) in fp32 arithmetic; the sign (also of zero) is kept and NaN stays NaN."""
    mag = tl.minimum(tl.abs(v), FMAX, propagate_nan=tl.PropagateNan.ALL)
    # Rounding quantum q = 2**(exponent(mag) - MANT_BITS), never below the
    # subnormal step; c = q * 2**23 is built from the exponent bits of mag, and
    # (mag + c) - c rounds mag to a multiple of q.
    exp_bits = mag.to(tl.int32, bitcast=True) & 0x7F800000
    c_bits = tl.maximum(exp_bits + ((23 - MANT_BITS) << 23), (MIN_STEP_EXP + 23) << 23)
    c = c_bits.to(tl.float32, bitcast=True)
    rounded = (mag + c) - c
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_bytes(v, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr,
              PATCH_NAN: tl.constexpr):
    """The FP8 encoding (uint8) of the saturating cast of fp32 ``v`` (nearest, ties
    to even); NaN becomes 0x7F with the sign bit of ``v``, as torch encodes it.

    The rounding is :func:`round_to_fp8_grid`'s ``|v| + c`` (exact but for the one
    rounding to a multiple of the quantum q = c / 2**23), and the byte is read off
    its bits in int32 arithmetic: ``bits(|v| + c) - bits(c)`` counts the quanta in
    the rounded |v| (its leading 1 included, for a normal value), and
    ``(bits(c) - bits(c_min)) >> (23 - MANT_BITS)`` adds the exponent above the
    subnormal binade; a carry into the next binade comes out right by itself.
    Only the final narrowing touches 8 bits: there is no float-to-FP8 conversion
    and no arithmetic on 8-bit vectors. (Triton 3.6 on the H200 miscompiled the
    packed ``cvt.rn.satfinite.e*m*x2.f32`` conversion followed by byte arithmetic
    and a layout change before the store, losing or swapping bytes; exact under
    the interpreter.) OUT_DTYPE and PATCH_NAN are kept for the callers: the
    encoding needs neither."""
    C_MIN: tl.constexpr = (MIN_STEP_EXP + 23) << 23  # bits of c for the subnormal step
    mag = tl.minimum(tl.abs(v), FMAX, propagate_nan=tl.PropagateNan.ALL)
    exp_bits = mag.to(tl.int32, bitcast=True) & 0x7F800000
    c_bits = tl.maximum(exp_bits + ((23 - MANT_BITS) << 23), C_MIN)
    quanta = (mag + c_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - c_bits
    code = quanta + ((c_bits - C_MIN) >> (23 - MANT_BITS))
    code = tl.where(mag != mag, 0x7F, code)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def fp8_bytes_as(v, OUT_DTYPE: tl.constexpr, PATCH_NAN: tl.constexpr):
    """:func:`fp8_bytes` with the format constants taken from ``OUT_DTYPE``."""
    if OUT_DTYPE == tl.float8e4nv:
        return fp8_bytes(v, OUT_DTYPE, 448.0, 3, 127 - 9, PATCH_NAN)
    else:
        return fp8_bytes(v, OUT_DTYPE, 57344.0, 2, 127 - 16, PATCH_NAN)


@triton.jit
def fp8_to_float(q, IS_E4M3: tl.constexpr):
    """fp32 value of FP8 ``q``; NaN and inf are decoded explicitly, with the bits
    torch gives them (sign, and the FP8 mantissa in the top fp32 mantissa bits)."""
    q_bits = q.to(tl.uint8, bitcast=True).to(tl.int32)
    low = q_bits & 0x7F
    sign = (q_bits & 0x80) << 24
    v = q.to(tl.float32)
    if IS_E4M3:
        special = low == 0x7F
        special_bits = sign | 0x7FF00000
    else:
        special = low >= 0x7C
        quiet = tl.where(low > 0x7C, 0x7FC00000 | ((low & 3) << 21), 0x7F800000)
        special_bits = sign | quiet
    return tl.where(special, special_bits.to(tl.float32, bitcast=True), v)


@triton.jit
def bf16_grid(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even; past the largest
    bf16 to inf), still in fp32: integer arithmetic on the bits, NaN kept."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def round_to_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even) in integer arithmetic
    and converted; the final conversion is then exact in any rounding mode."""
    return bf16_grid(v).to(tl.bfloat16)


@triton.jit
def round_through(v, DTYPE: tl.constexpr):
    """``v`` rounded once to the narrower ``DTYPE`` (nearest, ties to even) and
    widened back exactly; fp32 to bf16 in integer arithmetic (exact under the
    interpreter too)."""
    if DTYPE == tl.bfloat16 and v.dtype == tl.float32:
        return bf16_grid(v)
    else:
        return v.to(DTYPE).to(v.dtype)


@triton.jit
def to_output(v, OUT_DTYPE: tl.constexpr):
    """fp32 ``v`` converted to ``OUT_DTYPE`` with round-to-nearest-even."""
    if OUT_DTYPE == tl.bfloat16:
        return round_to_bf16(v)
    else:
        return v.to(OUT_DTYPE)


@triton.jit
def abs_bits(x):
    """int32 bits of |x| (fp32): ordered like the values, NaN above inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr, POWER_2: tl.constexpr, EPSILON: tl.constexpr):
    """fp32 scale for fp32 ``amax`` (any shape): the rules of the reference."""
    if EPSILON > 0.0:
        amax = tl.where(amax < EPSILON, EPSILON, amax)
    fmax = tl.full(amax.shape, FMAX, tl.float32)
    scale = tl.math.div_rn(fmax, amax)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    usable = (amax > 0.0) & (amax < float("inf"))
    scale = tl.where(usable, scale, 1.0)
    if POWER_2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def reciprocal(scale):
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def e8m0_from_amax(amax, FP8_EMAX: tl.constexpr):
    """E8M0 byte (int32) for fp32 block amaxes: ``127 + ceil(log2(amax / fmax))``."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    byte = biased - FP8_EMAX + (mantissa > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    byte = tl.where(biased == 0, 0, byte)
    return tl.where(biased == 255, 255, byte)


@triton.jit
def e8m0_reciprocal(byte):
    """fp32 ``2**(127 - byte)`` for int32 E8M0 bytes (NaN for 255)."""
    mult = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), mult)


@triton.jit
def e8m0_value(byte):
    """fp32 ``2**(byte - 127)`` for int32 E8M0 bytes (NaN for 255)."""
    value = tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), value)


# ---------------------------------------------------------------------- launcher


def fp8_format(fp8_dtype: torch.dtype) -> tuple[float, int, int, int]:
    try:
        return FP8_FORMAT[fp8_dtype]
    except KeyError:
        raise ValueError(f"fp8_dtype: must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") from None


def check_input(x: torch.Tensor, kernel: str, name: str = "x", dims: int | None = 2) -> None:
    """Raise a clear error unless ``x`` is a floating tensor the kernels read."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUTS:
        raise TypeError(f"{kernel}: {name} must be one of {[str(d) for d in FLOAT_INPUTS]}, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{kernel}: {name} must be {dims}-D, got shape {tuple(x.shape)}")
    if x.device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"{kernel}: the triton backend runs on cuda (or interpreted cpu) tensors, got {x.device}")


def check_scale(scale: torch.Tensor, kernel: str, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        what = f"{scale.dtype} tensor of {scale.numel()} elements" if isinstance(scale, torch.Tensor) else type(scale)
        raise ValueError(f"{kernel}: scale must be a one-element float32 tensor, got {what}")
    if scale.device != device:
        raise ValueError(f"{kernel}: scale is on {scale.device} but x is on {device}")


def check_epsilon(epsilon: float, kernel: str) -> float:
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"{kernel}: epsilon must be >= 0, got {epsilon}")
    return epsilon


def is_interpreted(t: torch.Tensor) -> bool:
    """Tensors on the CPU only run under ``TRITON_INTERPRET=1``."""
    return t.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU (4 for interpreted CPU tensors)."""
    if t.device.type != "cuda":
        return 4
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
