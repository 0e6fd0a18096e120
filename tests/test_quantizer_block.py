"""Float8BlockQuantizer: 1x128 and 128x128 tile scales by hand, partial and zero tiles."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.kernels.reference import quantize_block_reference
from te_fuser.quantization import Float8BlockQuantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


def inverse(scales) -> torch.Tensor:
    return torch.tensor([[f32(1 / s) for s in row] for row in scales])


def tall_input() -> torch.Tensor:
    """(130, 4): column-wise 1x128 tiles run along M, the last one partial (2 rows)."""
    x = torch.zeros(130, 4)
    x[:128, 0], x[128:, 0] = 3.0, 0.5
    x[:, 1] = -1000.0
    x[128:, 2] = 2.0  # rows 0..127 of column 2: an all-zero tile
    x[:, 3] = 2.0**-20
    return x


@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32"])
def test_1x128_columnwise_scales_by_hand(power_2):
    x = tall_input()
    t = Float8BlockQuantizer(E4M3, 1, power_2_scales=power_2)(x, rowwise=True, columnwise=True)
    assert t.scaling == "block_1x128"
    assert tuple(t.columnwise.data.shape) == (4, 130) and tuple(t.columnwise.scale_inv.shape) == (4, 2)
    if power_2:
        col_scales = [[128.0, 512.0], [0.25, 0.25], [1.0, 128.0], [2.0**28, 2.0**28]]
        row_scale = 0.25  # every row's (partial, 4-wide) tile holds -1000
    else:
        col_scales = [[f32(448 / 3), 896.0], [f32(0.448)] * 2, [1.0, 224.0], [448.0 * 2**20] * 2]
        row_scale = f32(0.448)
    assert_bitwise(t.columnwise.scale_inv, inverse(col_scales), "column-wise scale_inv")
    assert_bitwise(t.rowwise.scale_inv, inverse([[row_scale]] * 130), "row-wise scale_inv")
    grid = torch.tensor(col_scales).repeat_interleave(128, dim=1)[:, :130]  # (4, 130)
    assert_bitwise(t.columnwise.data, (x.t() * grid).to(E4M3), "column-wise data from x.T")
    assert t.dequantize()[5, 3] == 0.0  # row-wise: next to -1000 it underflows
    only_columnwise = Float8BlockQuantizer(E4M3, 1, power_2_scales=power_2)(x, rowwise=False, columnwise=True)
    assert only_columnwise.dequantize()[5, 3] == 2.0**-20  # column-wise: its own tile
    assert not t.columnwise.data[2, :128].float().any()  # the all-zero tile


def test_1x128_copies_are_independent():
    x = torch.ones(2, 128)
    x[0, 0] = 448.0 * 2**8  # row 0's tile scale 2**-8: the 1.125 next to it falls to a subnormal
    x[1, 1] = 1.125
    x[0, 1] = 1.125
    t = Float8BlockQuantizer(E4M3, 1)(x, rowwise=True, columnwise=True)
    assert t.dequantize()[0, 1] == 1.0  # row-wise copy
    only_columnwise = Float8BlockQuantizer(E4M3, 1)(x, rowwise=False, columnwise=True)
    assert only_columnwise.dequantize()[0, 1] == 1.125  # column 1's tile has amax 1.125


@pytest.mark.parametrize("power_2", [True, False], ids=["pow2", "fp32"])
def test_128x128_columnwise_is_the_transposed_tiles(power_2):
    x = torch.zeros(130, 131)
    x[:128, :128] = 1.0
    x[5, 9] = 3.0
    x[:128, 128:] = -0.5
    x[128:, :128] = 1000.0  # tile (1, 1) stays all zero
    t = Float8BlockQuantizer(E5M2, 2, power_2_scales=power_2)(x, rowwise=True, columnwise=True)
    assert t.scaling == "block_128x128"
    if power_2:
        scales = [[2.0**14, 2.0**16], [32.0, 1.0]]
    else:
        scales = [[f32(57344 / 3), 114688.0], [f32(57.344), 1.0]]
    assert_bitwise(t.rowwise.scale_inv, inverse(scales), "row-wise 128x128 scale_inv")
    assert_bitwise(t.columnwise.scale_inv, inverse(scales).t().contiguous(), "transposed scale grid")
    assert_bitwise(t.columnwise.data, t.rowwise.data.t().contiguous(), "transposed data")
    reference = quantize_block_reference(x, E5M2, tile_rows=128, power_2=power_2)
    assert_bitwise(t.rowwise.data, reference.data, "row-wise data")
    only_columnwise = Float8BlockQuantizer(E5M2, 2, power_2_scales=power_2)(x, rowwise=False, columnwise=True)
    assert_bitwise(only_columnwise.dequantize(), t.dequantize(), "same values from either copy")


def test_epsilon_and_fp32_scales():
    x = torch.full((1, 128), 0.5)
    t = Float8BlockQuantizer(E4M3, 1, power_2_scales=False, amax_epsilon=1.0)(x)
    assert t.rowwise.scale_inv.item() == f32(1 / 448)  # 448 / max(0.5, 1.0)
    t = Float8BlockQuantizer(E4M3, 2, amax_epsilon=1.0)(torch.zeros(3, 3))
    assert t.rowwise.scale_inv.item() == 1 / 256  # an all-zero tile floored by epsilon, power of 2


def test_any_shape_is_accepted():
    for block_dim in (1, 2):
        quantizer = Float8BlockQuantizer(E4M3, block_dim)
        quantizer.check_shape((67, 13), rowwise=True, columnwise=True)
        t = quantizer(torch.ones(3, 7, 13), rowwise=True, columnwise=True)
        assert tuple(t.columnwise.data.shape) == (13, 21) and t.shape == torch.Size([3, 7, 13])


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(block_dim=3), ValueError, "block_dim"),
        (dict(block_dim=True), ValueError, "block_dim"),
        (dict(block_dim=1, power_2_scales=1), TypeError, "power_2_scales"),
        (dict(block_dim=1, amax_epsilon=-1.0), ValueError, "amax_epsilon"),
        (dict(block_dim=1, amax_epsilon=float("inf")), ValueError, "amax_epsilon"),
    ],
)
def test_invalid_arguments(kwargs, error, field):
    with pytest.raises(error, match=field):
        Float8BlockQuantizer(E4M3, **kwargs)


def test_describe():
    assert Float8BlockQuantizer(E4M3, 1).describe() == "block(e4m3, 1x128, pow2)"
    text = Float8BlockQuantizer(E5M2, 2, power_2_scales=False, amax_epsilon=0.5).describe()
    assert text == "block(e5m2, 128x128, fp32, eps=0.5)"
