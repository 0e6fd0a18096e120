"""The reference casts (the numerics oracle) against hand-computed cases.

Expected scales are float64 quotients rounded once to fp32, which equals the IEEE
fp32 division the contract prescribes.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.kernels.operand import ScaledOperand
from te_fuser.kernels.reference import (
    dequantize_reference,
    e8m0_exponent_reference,
    e8m0_to_float,
    quantize_block_reference,
    quantize_current_reference,
    quantize_mxfp8_reference,
    quantize_rowwise_reference,
    quantize_tensorwise_reference,
    saturating_cast_reference,
    scale_from_amax_reference,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max
INF, NAN = math.inf, math.nan


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


def next_up(value: float) -> float:
    return torch.tensor(value).nextafter(torch.tensor(INF)).item()


def fp32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize(
    "fp8_dtype, inputs, expected",
    [
        # ties go to the even neighbour; a finite value beyond fmax saturates; signs
        # survive; inf and NaN become NaN (an overflow is not turned into a number)
        (E4M3, [1.0625, 1.1875, 2**-10, 3 * 2**-10, 464.0, 1e9, -FLT_MAX, -0.0, NAN, -INF, INF],
         [1.0, 1.25, 0.0, 2**-8, 448.0, 448.0, -448.0, -0.0, NAN, -NAN, NAN]),
        (E5M2, [1.125, 1.375, 2**-17, 61440.0, FLT_MAX, -1e30, NAN, INF, -INF],
         [1.0, 1.5, 0.0, 57344.0, 57344.0, -57344.0, NAN, NAN, -NAN]),
    ],
    ids=["e4m3", "e5m2"],
)
def test_saturating_cast(fp8_dtype, inputs, expected):
    out = saturating_cast_reference(fp32(inputs), fp8_dtype)
    assert out.dtype == fp8_dtype
    assert_bitwise(out, fp32(expected).to(fp8_dtype), f"saturating cast to {fp8_dtype}")


def test_scale_from_amax_rules():
    amax = fp32([0.0, INF, NAN, 448.0, 3.0, 1e-40, 1000.0])
    expected = [1.0, 1.0, 1.0, 1.0, f32(448 / 3), FLT_MAX, f32(448 / 1000)]
    assert_bitwise(scale_from_amax_reference(amax, 448.0), fp32(expected), "fp32 scales")
    pow2 = [1.0, 1.0, 1.0, 1.0, 128.0, 2.0**127, 0.25]  # mantissa cleared: rounded down
    assert_bitwise(scale_from_amax_reference(amax, 448.0, power_2=True), fp32(pow2), "power-of-2 scales")


def test_scale_from_amax_epsilon():
    amax = fp32([0.0, 1e-6, 2.0])
    eps32 = f32(1e-3)  # the epsilon is an fp32 value
    expected = [f32(448 / eps32), f32(448 / eps32), 224.0]
    assert_bitwise(scale_from_amax_reference(amax, 448.0, epsilon=1e-3), fp32(expected), "epsilon floors amax")


@pytest.mark.parametrize(
    "fp8_dtype, amax, byte",
    [
        (E4M3, 448.0, 127),
        (E4M3, 449.0, 128),
        (E4M3, next_up(448.0), 128),
        (E4M3, 224.0, 126),
        (E4M3, 1.75, 119),  # 1.75 / 448 = 2**-8
        (E4M3, next_up(1.75), 120),
        (E4M3, 0.0, 0),
        (E4M3, 1e-40, 0),  # subnormal amax
        (E4M3, 2.0**-126, 0),  # exponent below the E8M0 range: clamped
        (E4M3, FLT_MAX, 247),
        (E4M3, INF, 255),
        (E4M3, NAN, 255),
        (E5M2, 57344.0, 127),
        (E5M2, 57345.0, 128),
        (E5M2, 1.0, 112),  # ceil(log2(1 / 57344)) = -15
    ],
)
def test_e8m0_exponent(fp8_dtype, amax, byte):
    out = e8m0_exponent_reference(fp32([amax]), fp8_dtype)
    assert out.dtype == torch.uint8 and out.item() == byte
    if byte not in (0, 255) and amax > 0:
        assert amax / 2.0 ** (byte - 127) <= {E4M3: 448.0, E5M2: 57344.0}[fp8_dtype]


def test_e8m0_to_float():
    out = e8m0_to_float(torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8))
    expected = fp32([2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127, NAN])
    assert_bitwise(out, expected, "E8M0 values")


def test_mxfp8_blocks_by_hand():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-448.0, 448.0, 32)  # amax 448 -> byte 127, data unchanged
    x[0, 32:] = 1.0
    x[0, 40] = 449.0  # amax 449 -> byte 128: everything halves
    # row 1, block 0 stays all zero -> byte 0; block 1 has amax 1.75 -> byte 119
    x[1, 32:] = 1.75
    op = quantize_mxfp8_reference(x, E4M3)
    assert op.scaling == "mx_32" and op.scale_inv.dtype == torch.uint8
    assert op.scale_inv.tolist() == [[127, 128], [0, 119]]
    assert_bitwise(op.data[0, :32], x[0, :32].to(E4M3), "block at scale 1")
    assert_bitwise(op.data[0, 32:], (x[0, 32:] / 2).to(E4M3), "block at scale 2")
    assert_bitwise(op.data[1, :32], torch.zeros(32).to(E4M3), "all-zero block")
    assert_bitwise(op.data[1, 32:], torch.full((32,), 448.0).to(E4M3), "1.75 * 2**8")
    deq = dequantize_reference(op)
    assert_bitwise(deq[0, 40:41], fp32([448.0]), "449 halves to 224.5 -> 224 in E4M3, times 2")


def test_mxfp8_rejects_k_not_multiple_of_32():
    with pytest.raises(ValueError, match="48.*multiple of 32"):
        quantize_mxfp8_reference(torch.ones(4, 48), E4M3)


def block_1x128_input() -> torch.Tensor:
    x = torch.zeros(3, 160)  # tiles: cols 0..127 and a partial tile 128..159
    x[0, :128] = 1.0
    x[0, 7] = -3.0  # tile (0, 0): amax 3
    x[0, 128:] = 0.5  # tile (0, 1): amax 0.5, partial
    x[1, :128] = 1000.0  # tile (1, 0): amax 1000; tile (1, 1) all zero
    x[2, :] = 2.0**-20  # tiny tiles
    return x


@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32"])
def test_block_1x128_by_hand(power_2):
    x = block_1x128_input()
    op = quantize_block_reference(x, E4M3, tile_rows=1, power_2=power_2)
    assert op.scaling == "block_1x128" and tuple(op.scale_inv.shape) == (3, 2)
    if power_2:
        scales = [[128.0, 512.0], [0.25, 1.0], [2.0**28, 2.0**28]]  # 448/3 -> 128, 896 -> 512, ...
    else:
        scales = [[f32(448 / 3), 896.0], [f32(0.448), 1.0], [448.0 * 2**20, 448.0 * 2**20]]
    expected_inv = fp32([[f32(1 / s) for s in row] for row in scales])
    assert_bitwise(op.scale_inv, expected_inv, f"1x128 scale_inv ({'pow2' if power_2 else 'fp32'})")
    expected_data = (x * fp32(scales).repeat_interleave(128, dim=1)[:, :160]).to(E4M3)
    assert_bitwise(op.data, expected_data, "1x128 data")


def test_block_epsilon():
    x = torch.full((1, 128), 0.5)
    op = quantize_block_reference(x, E4M3, tile_rows=1, power_2=True, epsilon=1.0)
    assert op.scale_inv.item() == 1 / 256  # 448 / max(0.5, 1) = 448 -> 256
    op = quantize_block_reference(torch.zeros(1, 128), E4M3, tile_rows=1, power_2=False, epsilon=0.5)
    assert op.scale_inv.item() == f32(1 / 896)  # an all-zero tile with epsilon uses the epsilon


@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32"])
def test_block_128x128_partial_tiles(power_2):
    x = torch.zeros(130, 131)  # grid 2 x 2 with partial tiles on both edges
    x[:128, :128] = 1.0
    x[5, 9] = 3.0
    x[:128, 128:] = -0.5
    x[128:, :128] = 1000.0
    # tile (1, 1): 2 x 3 elements, all zero
    op = quantize_block_reference(x, E5M2, tile_rows=128, power_2=power_2)
    assert op.scaling == "block_128x128" and tuple(op.scale_inv.shape) == (2, 2)
    if power_2:
        scales = [[2.0**14, 2.0**16], [32.0, 1.0]]  # 57344/3 = 19114.67 -> 2**14; 114688 -> 2**16
    else:
        scales = [[f32(57344 / 3), 114688.0], [f32(57.344), 1.0]]
    assert_bitwise(op.scale_inv, fp32([[f32(1 / s) for s in row] for row in scales]), "128x128 scale_inv")
    grid = fp32(scales).repeat_interleave(128, dim=0)[:130].repeat_interleave(128, dim=1)[:, :131]
    assert_bitwise(op.data, (x * grid).to(E5M2), "128x128 data")


def test_block_rejects_other_tiles():
    with pytest.raises(ValueError, match="tile_rows"):
        quantize_block_reference(torch.ones(4, 4), E4M3, tile_rows=32)


def test_rowwise_and_current_by_hand():
    x = fp32([[1.0, -4.0], [0.0, 0.0], [3.0, 0.5]])
    op = quantize_rowwise_reference(x, E4M3)
    assert op.scaling == "row"
    assert_bitwise(op.scale_inv, fp32([[f32(1 / 112)], [1.0], [f32(1 / f32(448 / 3))]]), "row scale_inv")
    data, data_t, scale, scale_inv, amax = quantize_current_reference(x, E4M3, power_2=True, columnwise=True)
    assert amax.item() == 4.0 and scale.item() == 64.0 and scale_inv.item() == 1 / 64  # 112 -> 64
    assert_bitwise(data, (x * 64).to(E4M3), "current data")
    assert_bitwise(data_t, data.t().contiguous(), "current transposed data")


def test_tensorwise_writes_amax_slot():
    history = torch.zeros(4)
    x = fp32([[1.0, -6.0], [2.0, 0.0]])
    data, data_t, amax = quantize_tensorwise_reference(
        x, torch.tensor(2.0), E4M3, rowwise=False, columnwise=True, amax_out=history[1:2]
    )
    assert data is None and amax.data_ptr() == history[1:2].data_ptr()
    assert history.tolist() == [0.0, 6.0, 0.0, 0.0]
    assert_bitwise(data_t, (x.t() * 2).to(E4M3), "tensorwise transposed data")


def test_dequantize_by_hand():
    data = fp32([[1.5, -2.0, 448.0]]).to(E4M3)
    op = ScaledOperand(data, torch.tensor(0.25), "tensor")
    assert_bitwise(dequantize_reference(op), fp32([[0.375, -0.5, 112.0]]), "tensorwise")
    assert dequantize_reference(op, torch.bfloat16).dtype == torch.bfloat16
    mx = ScaledOperand(torch.ones(1, 32).to(E4M3), torch.tensor([[130]], dtype=torch.uint8), "mx_32")
    assert_bitwise(dequantize_reference(mx), torch.full((1, 32), 8.0), "E8M0 130 = 2**3")
