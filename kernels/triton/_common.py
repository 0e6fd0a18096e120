"""Shared pieces of the Triton kernels: FP8 encodings, scales, and launcher checks.

FP8 bytes are written through ``uint8`` views, in one of two encodings of the same
saturating round-to-nearest-even cast (finite values saturate to +-fmax; inf and
NaN get the NaN encoding torch uses, ``0x7F`` plus the sign bit, so that an
overflow stays visible), chosen by each launcher through a ``HW_FP8`` constexpr
(:func:`hw_fp8`):

- with HW_FP8, the GPU's conversion instruction (``cvt.rn.satfinite``, two values
  per instruction) in inline PTX: compiled kernels on CUDA GPUs with FP8
  conversions (sm_89 and later). Either the four bytes of four values stay in one
  register up to the store (:func:`fp8_bytes_hw`, 1.5 SASS instructions per value
  for E4M3, about 2.8 for E5M2), or, where the bytes change layout before the
  store, each byte gets an int32 lane and Triton narrows it
  (:func:`fp8_bytes_hw_lanes`, about one more): then nothing after the asm
  differs from what the exact encoding hands Triton;
- :func:`fp8_bytes_exact`: the byte built in fp32 and int32 arithmetic, about 12
  SASS instructions per value, exact everywhere: under ``TRITON_INTERPRET=1``
  (whose own FP8 conversion rounds wrongly), and on a GPU with
  ``TE_FUSER_EXACT_FP8=1`` (the fallback should a compiler mangle the hardware
  path: Triton 3.6 on the H200 miscompiled its own packed conversion followed by
  byte arithmetic and a layout change before the store).

Either way the kernels are bit-exact against :mod:`te_fuser.kernels.reference`
(``benchmarks/check_gpu_defects.py`` checks both encodings on a GPU). Divisions are
IEEE (``tl.math.div_rn``), amaxes are integer maxima of the bits of |x| (ordered
like the values, NaN above inf, so NaN propagates as in ``torch.amax``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import env as _env
from ..formats import FP8_FORMATS
from ..formats import fp8_format as checked_format
from ._launch import launch

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = tuple(FP8_FORMATS)
FLT_MAX = 3.4028234663852886e38

# True: compiled kernels write FP8 with the exact integer encoding too, not the
# GPU's conversion instruction. From TE_FUSER_EXACT_FP8, read once, when this module
# is imported; the benchmarks and checks flip it to run both encodings in one process.
EXACT_FP8 = _env.triton_exact_fp8()


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
def fp8_bytes_exact(v, FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr):
    """The FP8 encoding (uint8) of the saturating cast of fp32 ``v`` (nearest, ties
    to even); NaN becomes 0x7F with the sign bit of ``v``, as torch encodes it
    (inf saturates here: :func:`fp8_bytes` turns it into NaN first).

    The rounding is :func:`round_to_fp8_grid`'s ``|v| + c`` (exact but for the one
    rounding to a multiple of the quantum q = c / 2**23), and the byte is read off
    its bits in int32 arithmetic: ``bits(|v| + c) - bits(c)`` counts the quanta in
    the rounded |v| (its leading 1 included, for a normal value), and
    ``(bits(c) - bits(c_min)) >> (23 - MANT_BITS)`` adds the exponent above the
    subnormal binade; a carry into the next binade comes out right by itself.
    Only the final narrowing touches 8 bits: there is no float-to-FP8 conversion
    and no arithmetic on 8-bit vectors, so it is exact under the interpreter and
    on any GPU."""
    C_MIN: tl.constexpr = (MIN_STEP_EXP + 23) << 23  # bits of c for the subnormal step
    mag = tl.minimum(tl.abs(v), FMAX, propagate_nan=tl.PropagateNan.ALL)
    exp_bits = mag.to(tl.int32, bitcast=True) & 0x7F800000
    c_bits = tl.maximum(exp_bits + ((23 - MANT_BITS) << 23), C_MIN)
    quanta = (mag + c_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - c_bits
    code = quanta + ((c_bits - C_MIN) >> (23 - MANT_BITS))
    code = tl.where(mag != mag, 0x7F, code)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


def _cvt_asm(fmt: str, lanes: bool) -> str:
    """PTX for four fp32 inputs to four FP8 bytes (``fmt`` e4m3 or e5m2): in one
    register, value i in byte i (``lanes=False``: ``$0``, inputs ``$1..$4``), or one
    byte per 32-bit output, zero-extended (``lanes=True``: ``$0..$3``, inputs
    ``$4..$7``). ``cvt`` with ``.satfinite`` rounds to nearest even and saturates
    (infinities too) to +-fmax. The sign bits are then taken from the inputs, not
    from the instruction, so that NaN and zero carry their sign as torch gives it;
    for E5M2 the lanes whose exponent bits are all ones (NaN: satfinite makes no
    inf) get 0x7F, whatever NaN pattern the instruction chose (E4M3 has only 0x7F)."""
    a = [f"${i + (4 if lanes else 1)}" for i in range(4)]
    lines = [
        ".reg .b16 lo, hi;",
        ".reg .b32 q, s01, s23, s, n;",
        f"cvt.rn.satfinite.{fmt}x2.f32 lo, {a[1]}, {a[0]};",
        f"cvt.rn.satfinite.{fmt}x2.f32 hi, {a[3]}, {a[2]};",
        "mov.b32 q, {lo, hi};",
        f"prmt.b32 s01, {a[0]}, {a[1]}, 0x0073;",  # byte 0: top byte of a0, byte 1: of a1
        f"prmt.b32 s23, {a[2]}, {a[3]}, 0x0073;",
        "prmt.b32 s, s01, s23, 0x5410;",
        "and.b32 q, q, 0x7F7F7F7F;",
        "and.b32 s, s, 0x80808080;",
        "or.b32 q, q, s;",
    ]
    if fmt == "e5m2":
        lines += [
            "and.b32 n, q, 0x7C7C7C7C;",
            "add.u32 n, n, 0x04040404;",  # 0x80 in the lanes with exponent 31, no carry out of a lane
            "and.b32 n, n, 0x80808080;",
            "shr.u32 n, n, 7;",
            "mul.lo.u32 n, n, 0x7F;",
            "or.b32 q, q, n;",
        ]
    if lanes:
        lines += ["and.b32 $0, q, 0xFF;", "bfe.u32 $1, q, 8, 8;", "bfe.u32 $2, q, 16, 8;", "shr.u32 $3, q, 24;"]
    else:
        lines += ["mov.b32 $0, q;"]
    return "{\n" + "\n".join(lines) + "\n}"


_CVT_E4M3 = tl.constexpr(_cvt_asm("e4m3", lanes=False))
_CVT_E5M2 = tl.constexpr(_cvt_asm("e5m2", lanes=False))
_CVT_E4M3_LANES = tl.constexpr(_cvt_asm("e4m3", lanes=True))
_CVT_E5M2_LANES = tl.constexpr(_cvt_asm("e5m2", lanes=True))


@triton.jit
def add_rounded(a, b, HW: tl.constexpr):
    """``a + b`` in fp32 as an addition of its own, rounded once. On the GPU it is
    ``add.rn.f32``: an addition with its rounding named is never contracted with the
    multiply that made ``a`` into one FMA, which would round the product and the sum
    together and so differ from the separate addition autograd makes. Under the
    interpreter (``HW`` False) a plain ``+``, which numpy never contracts."""
    if HW:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a + b


@triton.jit
def fp8_bytes_hw(v, OUT_DTYPE: tl.constexpr):
    """:func:`fp8_bytes_exact`'s bytes through the GPU's conversion instruction
    (sm_89 and later; never under the interpreter), for bytes stored in the layout
    they are computed in: per four values two ``cvt.rn.satfinite.e4m3x2.f32`` (or
    ``e5m2x2``), three byte permutes and one logic op for the signs (E5M2: about
    five more for NaN). The asm returns the four bytes in one register; a store of
    whole words writes it as it is, a narrower one (rows not a multiple of 16
    bytes, masked edges) takes each byte out with one permute. No byte arithmetic
    and no layout change follow the conversion."""
    if OUT_DTYPE == tl.float8e4nv:
        return tl.inline_asm_elementwise(_CVT_E4M3, "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_CVT_E5M2, "=r,r,r,r,r", [v], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def fp8_bytes_hw_lanes(v, OUT_DTYPE: tl.constexpr):
    """:func:`fp8_bytes_hw` for bytes that change layout before the store (a
    transposed copy, an input with strided rows, a GEMM accumulator's MMA layout):
    the asm returns one byte per int32 lane and Triton narrows it to uint8, so
    everything after the asm is what :func:`fp8_bytes_exact` hands Triton (about
    one SASS instruction per value more than :func:`fp8_bytes_hw`)."""
    if OUT_DTYPE == tl.float8e4nv:
        codes = tl.inline_asm_elementwise(_CVT_E4M3_LANES, "=r,=r,=r,=r,r,r,r,r", [v], dtype=tl.int32,
                                          is_pure=True, pack=4)
    else:
        codes = tl.inline_asm_elementwise(_CVT_E5M2_LANES, "=r,=r,=r,=r,r,r,r,r", [v], dtype=tl.int32,
                                          is_pure=True, pack=4)
    return codes.to(tl.uint8)


@triton.jit
def nan_for_inf(v):
    """fp32 ``v`` with each inf made a NaN of the same sign (a mantissa bit set on its
    bits); finite values and NaNs as they are. Before an encoding, so that an
    overflow encodes as NaN rather than saturating: a few integer operations a
    value, computed once where a kernel encodes one value twice (a transposed copy
    beside the row-major one: the same expression of the same value)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where((bits & 0x7FFFFFFF) == 0x7F800000, (bits | 0x400000).to(tl.float32, bitcast=True), v)


@triton.jit
def fp8_bytes(v, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr,
              HW_FP8: tl.constexpr, MOVED: tl.constexpr = False):
    """The FP8 encoding (uint8) of the saturating cast of fp32 ``v`` (nearest, ties
    to even; inf and NaN become 0x7F with the sign bit of ``v``), the same bytes
    either way: :func:`fp8_bytes_exact`, or with HW_FP8 the GPU's conversion,
    :func:`fp8_bytes_hw_lanes` when the bytes change layout before they are stored
    (MOVED), else :func:`fp8_bytes_hw`; inf is made NaN first (:func:`nan_for_inf`)."""
    v = nan_for_inf(v)
    if HW_FP8:
        if MOVED:
            return fp8_bytes_hw_lanes(v, OUT_DTYPE)
        else:
            return fp8_bytes_hw(v, OUT_DTYPE)
    else:
        return fp8_bytes_exact(v, FMAX, MANT_BITS, MIN_STEP_EXP)


@triton.jit
def fp8_bytes_as(v, OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, MOVED: tl.constexpr = False):
    """:func:`fp8_bytes` with the format constants taken from ``OUT_DTYPE``."""
    if OUT_DTYPE == tl.float8e4nv:
        return fp8_bytes(v, OUT_DTYPE, 448.0, 3, 127 - 9, HW_FP8, MOVED)
    else:
        return fp8_bytes(v, OUT_DTYPE, 57344.0, 2, 127 - 16, HW_FP8, MOVED)


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


# Triton's dtypes of the float tensors the kernels read and write.
TL_FLOAT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def load_k_tile(src, row0, rows, k0, K, stride, offs_k, USE_TMA: tl.constexpr):
    """The (rows, BLOCK_K) tile of a K-major GEMM operand at columns k0...: through a
    TMA descriptor (zero fill outside the matrix) or through pointers (``rows``
    already inside the matrix, columns past K masked to zero)."""
    if USE_TMA:
        return src.load([row0, k0])
    else:
        cols = k0 + offs_k
        return tl.load(src + rows[:, None] * stride + cols[None, :], mask=cols[None, :] < K, other=0.0)


@triton.jit
def bf16_grid(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even; past the largest
    bf16 to inf), still in fp32: integer arithmetic on the bits, NaN kept."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def bf16_value(v):
    """fp32 ``v`` as ``v.to(bfloat16)`` on a GPU holds it, widened back to fp32:
    :func:`bf16_grid`, with every NaN the NaN of CUDA's conversion (bf16 0x7FFF), so
    that a cast reading values through bf16 writes the bits (NaN bytes, a NaN amax)
    of the same cast of the bf16 tensor."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(v != v, 0x7FFF0000, rounded).to(tl.float32, bitcast=True)


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
    """``(fmax, mantissa bits, subnormal step exponent, emax)`` of ``fp8_dtype``: the
    constexprs the kernels take (the facts are ``kernels/formats.py``'s)."""
    f = checked_format(fp8_dtype)
    return f.fmax, f.mantissa_bits, f.min_step_exponent, f.emax


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


def cdiv(x: int, div: int) -> int:
    """``triton.cdiv`` for the launchers' host code: newer Triton makes its helper a
    ``ConstexprFunction``, whose call costs microseconds where this costs nanoseconds,
    and a step calls it about a hundred times."""
    return (x + div - 1) // div


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see :func:`cdiv`); 0 for n <= 0, as Triton's."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def is_interpreted(t: torch.Tensor) -> bool:
    """Tensors on the CPU only run under ``TRITON_INTERPRET=1``."""
    return t.device.type == "cpu"


# Triton's interpreter runs CUDA tensors too (through host copies); read once, like EXACT_FP8.
_INTERPRETER = _env.triton_interpreted()


def compiled_for_gpu(t: torch.Tensor) -> bool:
    """True where a kernel for ``t`` is compiled for a CUDA GPU (inline PTX runs), False
    under the interpreter."""
    return t.device.type == "cuda" and not _INTERPRETER


@functools.lru_cache(maxsize=None)
def _has_fp8_conversion(index: int) -> bool:
    """sm_89 and later convert fp32 pairs to FP8 in one instruction."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def hw_fp8(t: torch.Tensor) -> bool:
    """The ``HW_FP8`` constexpr of a kernel writing FP8 for data on ``t``'s device:
    True for compiled kernels on a CUDA GPU with FP8 conversions, unless
    ``EXACT_FP8``; False under the interpreter (CPU tensors)."""
    if EXACT_FP8 or not compiled_for_gpu(t):
        return False
    index = t.device.index
    return _has_fp8_conversion(index if index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU (4 for interpreted CPU tensors)."""
    if t.device.type != "cuda":
        return 4
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------- reductions


@triton.jit
def _sum_rows_kernel(src_ptr, out_ptr, rows, cols, BLOCK: tl.constexpr):
    """out[b, c] = the sum over r of src[b, r, c], for one block of columns of batch
    b (program axis 1), adding the rows in order in src's dtype."""
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    ptrs = src_ptr + b * rows * cols + offs
    acc = tl.zeros([BLOCK], dtype=src_ptr.dtype.element_ty)
    for _ in range(0, rows):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += cols
    tl.store(out_ptr + b * cols + offs, acc, mask=ok)


def sum_rows(partial: torch.Tensor) -> torch.Tensor:
    """A kernel's partial sums added up: ``partial`` (rows, cols) -> (cols,), or
    (batches, rows, cols) -> (batches, cols), each column's rows added in order, in
    one launch (a torch reduction costs the host several times a launch). fp32 or
    fp64, contiguous."""
    if not partial.is_contiguous():
        partial = partial.contiguous()
    batches, (rows, cols) = (partial.shape[0] if partial.dim() == 3 else 1), partial.shape[-2:]
    out = torch.empty((*partial.shape[:-2], cols), dtype=partial.dtype, device=partial.device)
    if out.numel():
        block = min(1024, max(32, next_power_of_2(cols)))
        launch(_sum_rows_kernel, (cdiv(cols, block), batches), partial, out, rows, cols, BLOCK=block,
               num_warps=4)
    return out
