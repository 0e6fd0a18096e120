"""Reference FP8 casts in plain torch: the numerics oracle for every backend.

All arithmetic is fp32 on the values loaded from the input (bf16/fp16/fp32), in
this order, which the Triton and CUDA kernels reproduce bit for bit:

- a cast multiplies by the fp32 scale (one rounding), clamps to +-fmax and rounds
  to the nearest FP8 value, ties to even; a value that is not finite after the
  scaling (inf or NaN) becomes NaN with its sign (the byte 0x7F plus the sign bit,
  in either format), so that an overflow upstream (a loss scaler's inf gradients,
  a diverging activation) stays visible through the FP8 GEMMs instead of
  saturating into a plausible number;
- a scale from an amax is ``fmax / max(amax, eps)`` (IEEE division); amax 0, inf
  or NaN gives 1; an infinite quotient gives the largest finite fp32; with
  power-of-2 scales the mantissa is cleared (rounds down to a power of two);
  ``scale_inv = 1 / scale`` (IEEE division);
- ``round_bf16`` (the column-sums casts of a gradient that arrives in fp32 while the
  GEMMs compute in bf16): the cast reads each value rounded to bf16 first (nearest,
  ties to even; a NaN becomes the NaN 0x7FFF, as CUDA's conversion makes it), exactly
  as a cast of ``x.to(torch.bfloat16)`` on the GPU would, amax included; the column
  sums are of ``x`` as given, as a bias's own sum would be;
- an MXFP8 block's E8M0 exponent is the smallest that keeps ``amax / 2**e <= fmax``:
  ``e = ceil(log2(amax / fmax))``, found exactly from the bits of amax; clamped to
  the E8M0 range; a block whose amax is inf or NaN gets the NaN byte 255 and NaN
  data.
"""

from __future__ import annotations

import torch

from ..formats import Scaling, block_scaling, fp8_format, fp8_max
from ..operand import ScaledOperand

__all__ = [
    "FLT_MAX",
    "saturating_cast_reference",
    "scale_from_amax_reference",
    "quantize_tensorwise_reference",
    "quantize_tensorwise_column_sums_reference",
    "quantize_current_reference",
    "amax_column_sums_reference",
    "quantize_current_column_sums_reference",
    "bf16_copy_reference",
    "column_sums_as",
    "quantize_rowwise_reference",
    "quantize_block_reference",
    "quantize_mxfp8_reference",
    "e8m0_exponent_reference",
    "e8m0_to_float",
    "dequantize_reference",
]

FLT_MAX = torch.finfo(torch.float32).max
_MANTISSA_OF_1_75 = 0x600000  # fmax of both formats is 1.75 * 2**emax


def saturating_cast_reference(x_scaled: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to ``fp8_dtype``, finite ones saturating to +-fmax; inf and
    NaN become NaN with their sign (the byte 0x7F plus the sign bit)."""
    fmax = fp8_max(fp8_dtype)
    xf = x_scaled.float()
    bits = xf.view(torch.int32)
    # a mantissa bit set on an all-ones exponent: inf becomes a NaN of its own sign
    xf = torch.where((bits & 0x7F800000) == 0x7F800000, (bits | 0x400000).view(torch.float32), xf)
    return xf.clamp(-fmax, fmax).to(fp8_dtype)


def scale_from_amax_reference(
    amax: torch.Tensor, fmax: float, power_2: bool = False, epsilon: float = 0.0
) -> torch.Tensor:
    """fp32 scale(s) for fp32 amax(es); see the module docstring for the rules."""
    amax = amax.float()
    if epsilon > 0.0:
        amax = torch.maximum(amax, torch.tensor(epsilon, dtype=torch.float32, device=amax.device))
    scale = torch.tensor(fmax, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    usable = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(usable, scale, torch.ones_like(scale))
    if power_2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(scale) / scale


def quantize_tensorwise_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Cast 2-D ``x`` with the given 0-d fp32 ``scale``; also return ``amax(|x|)``.

    Returns ``(data (M, K) or None, data_t (K, M) or None, amax)``: the delayed
    scaling cast. When ``amax_out`` (a one-element fp32 tensor, e.g. a slot of the
    amax history) is given, the amax is written there and that tensor returned.
    """
    xf = x.float()
    q = saturating_cast_reference(xf * scale.float(), fp8_dtype)
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    if amax_out is not None:
        amax = amax_out.copy_(amax.reshape(amax_out.shape))
    return (q if rowwise else None), (q.t().contiguous() if columnwise else None), amax


def quantize_tensorwise_column_sums_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensorwise_reference` of 2-D ``x`` (M, N), and ``x`` summed over
    its rows in fp32 (N,): the delayed-scaling cast of a gradient and the bias
    gradient, which the kernels take from one read of ``x``. ``round_bf16``: the
    cast (and its amax) of ``x`` rounded to bf16, the sums of ``x`` as given.
    ``sums_dtype`` (fp32 or bf16): the sums as returned, each fp32 total rounded
    once to bf16 for a bf16 bias (:func:`column_sums_as`).

    Returns ``(data or None, data_t or None, amax, sums)``.
    """
    check_matrix(x, "quantize_tensorwise_column_sums")
    check_sums_dtype(sums_dtype, "quantize_tensorwise_column_sums")
    q, qt, amax = quantize_tensorwise_reference(_rounded(x, round_bf16), scale, fp8_dtype, rowwise, columnwise,
                                                amax_out)
    return q, qt, amax, column_sums_as(x.sum(dim=0, dtype=torch.float32), sums_dtype)


_BF16_NAN = 0x7FFF  # the NaN of a CUDA conversion to bf16, whatever the NaN converted


def bf16_copy_reference(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.bfloat16)`` as the GPU computes it: every NaN becomes the one NaN
    0x7FFF (torch's CPU conversion writes 0xFFFF or 0x7FC0 by code path). What a
    cast through bf16 reads."""
    b = x.to(torch.bfloat16)
    # a fill on b's device, not a copy from the host: a CUDA graph being captured takes it
    nan = torch.full((), _BF16_NAN, dtype=torch.int16, device=b.device).view(torch.bfloat16)
    return torch.where(torch.isnan(b), nan, b)


def check_sums_dtype(sums_dtype, kernel: str) -> None:
    """The column-sums casts return their sums in fp32, or rounded to bf16 (a bf16 bias's gradient)."""
    if sums_dtype is not torch.float32 and sums_dtype is not torch.bfloat16:
        raise ValueError(f"{kernel}: sums_dtype must be torch.float32 or torch.bfloat16, got {sums_dtype!r}")


def column_sums_as(sums: torch.Tensor, sums_dtype: torch.dtype) -> torch.Tensor:
    """fp32 column sums as ``sums_dtype``: themselves, or each rounded once to the
    nearest bf16 as the GPU rounds (ties to even, every NaN 0x7FFF)."""
    return sums if sums_dtype is torch.float32 else bf16_copy_reference(sums)


def _rounded(x: torch.Tensor, round_bf16: bool) -> torch.Tensor:
    """``x`` as the cast reads it: rounded to bf16 with ``round_bf16``, else as it is."""
    return bf16_copy_reference(x) if round_bf16 else x


def quantize_current_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax of ``x``, its scale, then the cast. ``amax`` (0-d fp32,
    e.g. from :func:`amax_column_sums_reference`) skips computing it again.

    Returns ``(data, data_t, scale, scale_inv, amax)``.
    """
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    else:
        check_given_amax(amax, x, "quantize_current")
        amax = amax.reshape(())
    scale = scale_from_amax_reference(amax, fp8_max(fp8_dtype), power_2, epsilon)
    q = saturating_cast_reference(xf * scale, fp8_dtype)
    return (q if rowwise else None), (q.t().contiguous() if columnwise else None), scale, _reciprocal(scale), amax


def amax_column_sums_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax(|x|), x summed over its rows)`` of 2-D ``x`` (M, N), 0-d and (N,) fp32.

    What a bias and a current-scaling cast of a gradient both read: the amax of
    current scaling and the bias gradient (the sum accumulated in fp32), from one
    read of ``x`` in the kernels."""
    check_matrix(x, "amax_column_sums")
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    return amax, x.sum(dim=0, dtype=torch.float32)


def quantize_current_column_sums_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_current_reference` of 2-D ``x`` (M, N) and ``x`` summed over its
    rows in fp32 (N,): a gradient's current-scaling cast with its bias gradient,
    which the kernels take from the same reads. ``round_bf16``: the cast (amax,
    scale and data) of ``x`` rounded to bf16, the sums of ``x`` as given.
    ``sums_dtype``: as :func:`quantize_tensorwise_column_sums_reference`'s.

    Returns ``(data, data_t, scale, scale_inv, amax, sums)``.
    """
    check_matrix(x, "quantize_current_column_sums")
    check_sums_dtype(sums_dtype, "quantize_current_column_sums")
    return (*quantize_current_reference(_rounded(x, round_bf16), fp8_dtype, power_2, epsilon, rowwise, columnwise),
            column_sums_as(x.sum(dim=0, dtype=torch.float32), sums_dtype))


def check_matrix(x, kernel: str) -> None:
    """The kernels that sum columns take a 2-D ``x`` (M, N)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{kernel}: x must be a 2-D tensor (M, N), got {got}")


def check_given_amax(amax, x: torch.Tensor, kernel: str, name: str = "amax") -> None:
    """A precomputed amax (or one a kernel is to write: ``name`` says which argument)
    must be a one-element fp32 tensor beside ``x``."""
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1 or amax.dtype != torch.float32:
        what = f"{amax.dtype} tensor of {amax.numel()} elements" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"{kernel}: {name} must be None or a one-element float32 tensor, got {what}")
    if amax.device != x.device:
        raise ValueError(f"{kernel}: {name} is on {amax.device} but x is on {x.device}")


def quantize_rowwise_reference(
    x: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool = False, epsilon: float = 0.0
) -> ScaledOperand:
    """One scale per row of 2-D ``x`` (the layout of row-wise scaled GEMMs)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = scale_from_amax_reference(amax, fp8_max(fp8_dtype), power_2, epsilon)
    return ScaledOperand(saturating_cast_reference(xf * scale, fp8_dtype), _reciprocal(scale), Scaling.ROW)


def _tiles(x: torch.Tensor, tile_rows: int, tile_cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Zero-pad 2-D ``x`` to whole tiles and view it as (R, tile_rows, C, tile_cols)."""
    rows, cols = x.shape
    pad_r, pad_c = (-rows) % tile_rows, (-cols) % tile_cols
    xp = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    grid = (xp.shape[0] // tile_rows, xp.shape[1] // tile_cols)
    return xp.reshape(grid[0], tile_rows, grid[1], tile_cols), grid


def _untile(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    g0, tr, g1, tc = t.shape
    return t.reshape(g0 * tr, g1 * tc)[:rows, :cols]


def check_block_copies(rowwise: bool, columnwise: bool, kernel: str) -> None:
    """A block cast makes the row-wise copy, the column-wise one, or both."""
    for name, value in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not isinstance(value, bool):
            raise TypeError(f"{kernel}: {name} must be a bool, got {type(value).__name__}")
    if not (rowwise or columnwise):
        raise ValueError(f"{kernel}: rowwise and columnwise are both False: no copy to make")


def quantize_block_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    tile_rows: int,
    power_2: bool = True,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
) -> ScaledOperand | tuple[ScaledOperand | None, ScaledOperand]:
    """Block scaling of 2-D ``x`` with 1x128 (``tile_rows=1``) or 128x128 tiles.

    Partial tiles at the edges are allowed; the padding does not count in amax.
    ``columnwise``: also ``x.T`` (N, M) quantized along M (1x128: its own scales;
    128x128: the same tiles transposed), and the result is the pair (the row-wise
    operand, or None without ``rowwise``, and the column-wise one).
    """
    if tile_rows not in (1, 128):
        raise ValueError(f"tile_rows: must be 1 (1x128) or 128 (128x128), got {tile_rows}")
    check_block_copies(rowwise, columnwise, "quantize_block")
    if columnwise:
        op = quantize_block_reference(x, fp8_dtype, tile_rows, power_2, epsilon)
        if tile_rows == 1:
            op_t = quantize_block_reference(x.t(), fp8_dtype, tile_rows, power_2, epsilon)
        else:
            op_t = ScaledOperand(op.data.t().contiguous(), op.scale_inv.t().contiguous(), op.scaling)
        return (op if rowwise else None), op_t
    rows, cols = x.shape
    t, _ = _tiles(x.float(), tile_rows, 128)
    amax = t.abs().amax(dim=(1, 3))  # (R, C)
    scale = scale_from_amax_reference(amax, fp8_max(fp8_dtype), power_2, epsilon)
    q = saturating_cast_reference(t * scale[:, None, :, None], fp8_dtype)
    scaling = block_scaling(tile_rows)
    return ScaledOperand(_untile(q, rows, cols).contiguous(), _reciprocal(scale), scaling)


def e8m0_exponent_reference(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """E8M0 byte (uint8) for fp32 block amaxes: ``127 + ceil(log2(amax / fmax))``."""
    bits = amax.float().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    byte = biased - fp8_format(fp8_dtype).emax + (mantissa > _MANTISSA_OF_1_75).to(torch.int32)
    byte = byte.clamp(0, 254)
    byte = torch.where(biased == 0, torch.zeros_like(byte), byte)  # 0 and subnormal amax
    byte = torch.where(biased == 255, torch.full_like(byte, 255), byte)  # inf / NaN
    return byte.to(torch.uint8)


def _e8m0_reciprocal(byte: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(127 - byte)`` (exact: normal for every byte 0..253), NaN for 255."""
    b = byte.to(torch.int32)
    mult = ((254 - b).clamp(min=1) << 23).view(torch.float32)
    return torch.where(b == 255, torch.full_like(mult, float("nan")), mult)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2**(byte - 127)`` of E8M0 bytes (NaN for 255)."""
    value = torch.exp2(byte.to(torch.float64) - 127.0).float()
    return torch.where(byte == 255, torch.full_like(value, float("nan")), value)


def quantize_mxfp8_reference(x: torch.Tensor, fp8_dtype: torch.dtype) -> ScaledOperand:
    """MXFP8 along the last dim of 2-D ``x``: one E8M0 scale per 32 elements."""
    rows, cols = x.shape
    if cols % 32:
        raise ValueError(f"MXFP8: the quantized dimension ({cols}) must be a multiple of 32")
    blocks = x.float().reshape(rows, cols // 32, 32)
    byte = e8m0_exponent_reference(blocks.abs().amax(dim=2), fp8_dtype)
    q = saturating_cast_reference(blocks * _e8m0_reciprocal(byte)[:, :, None], fp8_dtype)
    return ScaledOperand(q.reshape(rows, cols), byte, Scaling.MX_32)


def _expanded_scale_inv(op: ScaledOperand) -> torch.Tensor:
    rows, cols = op.data.shape
    if op.scaling == Scaling.TENSOR:
        return op.scale_inv.float()
    if op.scaling == Scaling.ROW:
        return op.scale_inv.float().expand(rows, cols)
    if op.scaling == Scaling.MX_32:
        return e8m0_to_float(op.scale_inv).repeat_interleave(32, dim=1)
    tile_r = 1 if op.scaling == Scaling.BLOCK_1X128 else 128
    s = op.scale_inv.float().repeat_interleave(128, dim=1)[:, :cols]
    return s.repeat_interleave(tile_r, dim=0)[:rows] if tile_r > 1 else s


def dequantize_reference(op: ScaledOperand, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` in fp32 (exact for representable values), then ``out_dtype``."""
    return (op.data.float() * _expanded_scale_inv(op)).to(out_dtype)
