"""Quantize -> dequantize is bit exact on representable inputs, for every scheme.

``x_rep = dequantize(quantize(x))`` holds only values the scheme represents, so
quantizing it again must reproduce it bit for bit. Each copy (row-wise and
column-wise) is checked on its own, since the column-wise copy of a 1x128 or
MXFP8 tensor is quantized along the other dimension and represents other values.

With fp32 (non power-of-two) scales the scale of ``x_rep`` can differ from the
scale of ``x`` by an ulp, so the representable input is reached by iterating;
the FP8 bytes must never change along the way and the iteration must settle
within a few steps. Power-of-two scales must reproduce ``x_rep`` at once.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.quantization import (
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    QuantizedTensor,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

SCHEMES = {
    "current_fp32": lambda dt: Float8CurrentScalingQuantizer(dt),
    "current_pow2": lambda dt: Float8CurrentScalingQuantizer(dt, power_2_scales=True),
    "mxfp8": lambda dt: MXFP8Quantizer(dt),
    "block_1x128_pow2": lambda dt: Float8BlockQuantizer(dt, 1),
    "block_1x128_fp32": lambda dt: Float8BlockQuantizer(dt, 1, power_2_scales=False),
    "block_128x128_pow2": lambda dt: Float8BlockQuantizer(dt, 2),
    "block_128x128_fp32": lambda dt: Float8BlockQuantizer(dt, 2, power_2_scales=False),
}
# odd shapes (slices of 67x1408 and 13x8704), an N-D one, and MXFP8-friendly ones
SHAPES = [(67, 160), (13, 272), (13, 288), (2, 16, 96), (64, 96)]
COPIES = ["rowwise", "columnwise"]


def off_centre(shape, dtype, seed=0) -> torch.Tensor:
    """``-2.3 + 0.5 * randn`` with an all-zero region (whole zero tiles / blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(shape, generator=g)
    x2d = x.view(-1, shape[-1])  # (M, K)
    if shape[-1] > 128:
        x2d[:, 128:] = 0.0  # zero 1x128 / 128x128 tiles and zero MXFP8 blocks, both directions
    else:
        x2d[:, 32:64] = 0.0  # zero MXFP8 blocks, both directions
    return x.to(dtype)


def shape_allowed(scheme: str, shape, copy: str) -> bool:
    if scheme != "mxfp8":
        return True
    rows, cols = torch.Size(shape[:-1]).numel(), shape[-1]
    return (cols if copy == "rowwise" else rows) % 32 == 0


def quantize_copy(quantizer, x: torch.Tensor, copy: str) -> QuantizedTensor:
    return quantizer(x, rowwise=copy == "rowwise", columnwise=copy == "columnwise")


def fp8_bytes(t: QuantizedTensor) -> torch.Tensor:
    op = t.rowwise if t.has_rowwise else t.columnwise
    return op.data.view(torch.uint8)


def representable(quantizer, x: torch.Tensor, copy: str, max_steps: int) -> tuple[torch.Tensor, int]:
    """Iterate ``x -> dequantize(quantize(x))`` until a fixed point; return it and the steps taken.

    With fp32 scales (``max_steps > 0``) only the scales may drift, never the FP8
    bytes. (A power-of-two scale may double when rounding lowers a tile's amax
    across a binade: the bytes then move by one binade but the values stay.)
    """
    t = quantize_copy(quantizer, x, copy)
    x_rep = t.dequantize()
    for step in range(max_steps + 1):
        t_again = quantize_copy(quantizer, x_rep, copy)
        if max_steps:
            assert torch.equal(fp8_bytes(t_again), fp8_bytes(t)), f"{copy}: FP8 data moved at step {step}"
        x_again = t_again.dequantize()
        if torch.equal(x_again.view(torch.uint8), x_rep.view(torch.uint8)):
            return x_rep, step
        x_rep, t = x_again, t_again
    raise AssertionError(f"{copy}: no fixed point after {max_steps} requantizations")


CASES = [
    pytest.param(scheme, shape, copy, id=f"{scheme}-{shape}-{copy}")
    for scheme in sorted(SCHEMES)
    for shape in SHAPES
    for copy in COPIES
    if shape_allowed(scheme, shape, copy)  # MXFP8: the quantized dim must be a multiple of 32
]


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scheme, shape, copy", CASES)
def test_roundtrip_bit_exact(scheme, shape, copy, fp8_dtype, hp_dtype):
    quantizer = SCHEMES[scheme](fp8_dtype)
    x = off_centre(shape, hp_dtype)
    power_of_2 = scheme.endswith("pow2") or scheme == "mxfp8"
    x_rep, steps = representable(quantizer, x, copy, max_steps=0 if power_of_2 else 8)
    t = quantize_copy(quantizer, x_rep, copy)
    assert t.shape == torch.Size(shape) and t.dtype == hp_dtype
    assert_bitwise(t.dequantize(), x_rep, f"{scheme} {fp8_dtype} {hp_dtype} {shape} {copy}")
    assert (x_rep.view(-1, shape[-1])[:, 128:] == 0).all()  # zero tiles stay zero


@pytest.mark.parametrize("magnitude", [2.0**-60, 2.0**60], ids=["tiny", "huge"])
@pytest.mark.parametrize("scheme", ["current_pow2", "mxfp8", "block_1x128_pow2", "block_128x128_pow2"])
def test_roundtrip_extreme_magnitudes(scheme, magnitude):
    quantizer = SCHEMES[scheme](E4M3)
    x = off_centre((64, 160), torch.float32, seed=1) * magnitude
    for copy in COPIES:
        x_rep, steps = representable(quantizer, x, copy, max_steps=0)
        assert x_rep.abs().max() > 0, "the data must not underflow to zero"


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_both_copies_match_single_copies(scheme):
    """Asking for both copies at once gives the same bytes as asking for each alone."""
    quantizer = SCHEMES[scheme](E4M3)
    x = off_centre((64, 160), torch.bfloat16, seed=2)
    both = quantizer(x, rowwise=True, columnwise=True)
    row = quantizer(x, rowwise=True)
    col = quantizer(x, rowwise=False, columnwise=True)
    assert_bitwise(both.rowwise.data, row.rowwise.data, f"{scheme} rowwise")
    assert_bitwise(both.rowwise.scale_inv, row.rowwise.scale_inv, f"{scheme} rowwise scales")
    assert_bitwise(both.columnwise.data, col.columnwise.data, f"{scheme} columnwise")
    assert_bitwise(both.columnwise.scale_inv, col.columnwise.scale_inv, f"{scheme} columnwise scales")
    assert not row.has_columnwise and not col.has_rowwise


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("calibrate_with", [1.0, 0.25], ids=["fitting", "saturating"])
def test_roundtrip_delayed_scaling(fp8_dtype, hp_dtype, calibrate_with):
    """Delayed scaling casts with the scale of the previous amaxes: requantizing with
    that same scale is bit exact, including values saturated by a stale scale."""
    x = off_centre((67, 160), hp_dtype, seed=3)
    quantizer = DelayedScalingQuantizer(fp8_dtype, amax_history_len=4)
    quantizer.observe(x * calibrate_with)  # a quarter of the range: x saturates
    before = quantizer.state_dict()
    for copy in COPIES:
        quantizer.load_state_dict(before)
        t = quantize_copy(quantizer, x, copy)
        x_rep = t.dequantize()
        quantizer.load_state_dict(before)
        t_again = quantize_copy(quantizer, x_rep, copy)
        assert torch.equal(fp8_bytes(t_again), fp8_bytes(t))
        assert_bitwise(t_again.dequantize(), x_rep, f"delayed {fp8_dtype} {hp_dtype} {copy}")
    clamped = (x.float().abs() * before["scale"] > quantizer.fmax).sum()
    assert (clamped > 0) == (calibrate_with < 1.0)
