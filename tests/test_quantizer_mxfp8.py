"""MXFP8Quantizer: E8M0 block scales by hand, independent copies, shape rules."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.kernels.reference import quantize_mxfp8_reference
from te_fuser.quantization import MXFP8Quantizer, QuantizerRole

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROLE = QuantizerRole("linear", "input", "fc1")


def hand_input() -> torch.Tensor:
    """(64, 64) ones with one huge element, one 1.125 beside it and an all-zero quadrant."""
    x = torch.ones(64, 64)
    x[0, 0] = 448.0 * 256  # E8M0 byte 127 + 8 for the row-wise block (0, 0) and column-wise block (0, 0)
    x[0, 5] = 1.125  # in the huge row-wise block it falls to an E4M3 subnormal and rounds to 1.0
    x[32:, 32:] = 0.0  # all-zero blocks in both directions
    return x


def test_rowwise_scales_by_hand():
    t = MXFP8Quantizer(E4M3, role=ROLE)(hand_input())
    assert t.scaling == "mx_32" and not t.has_columnwise
    expected = torch.full((64, 2), 119, dtype=torch.uint8)  # amax 1: ceil(log2(1/448)) = -8
    expected[0, 0] = 135
    expected[32:, 1] = 0  # amax 0 -> byte 0
    assert_bitwise(t.rowwise.scale_inv, expected, "row-wise E8M0 bytes")
    x_rep = t.dequantize()
    assert x_rep[0, 0] == 448.0 * 256 and x_rep[0, 5] == 1.0 and x_rep[1, 5] == 1.0
    assert not x_rep[32:, 32:].any()


def test_columnwise_is_quantized_from_high_precision():
    x = hand_input()
    t = MXFP8Quantizer(E4M3)(x, rowwise=True, columnwise=True)
    expected = torch.full((64, 2), 119, dtype=torch.uint8)  # (K, M // 32): blocks along M
    expected[0, 0] = 135
    expected[32:, 1] = 0
    assert_bitwise(t.columnwise.scale_inv, expected, "column-wise E8M0 bytes")
    assert_bitwise(t.columnwise.data, quantize_mxfp8_reference(x.t(), E4M3).data, "column-wise data")
    from_columnwise = MXFP8Quantizer(E4M3)(x, rowwise=False, columnwise=True).dequantize()
    assert from_columnwise[0, 5] == 1.125  # column 5's block has amax 1.125: exact there
    assert t.dequantize()[0, 5] == 1.0  # the row-wise copy lost it; the copies are independent


def test_hand_cases_448_449_zero_e5m2():
    x = torch.zeros(3, 32)
    x[0, 3], x[1, 3] = 448.0, -449.0
    for fp8_dtype, byte_448 in ((E4M3, 127), (E5M2, 127 - 7)):  # 448 / 57344 = 2**-7
        t = MXFP8Quantizer(fp8_dtype)(x)
        assert t.rowwise.scale_inv[:, 0].tolist() == [byte_448, byte_448 + 1, 0]  # 448, 449, all zero
        assert t.dequantize()[0, 3] == 448.0


@pytest.mark.parametrize(
    "shape, rowwise, columnwise, match",
    [
        ((64, 48), True, False, r"rowwise.*dim 1 \(columns, 48\).*multiple of 32"),
        ((40, 64), False, True, r"columnwise.*dim 0 \(rows, 40\).*multiple of 32"),
        ((2, 20, 64), True, True, r"columnwise.*dim 0 \(rows, 40\).*multiple of 32"),
    ],
)
def test_shape_rejections_name_dim_and_multiple(shape, rowwise, columnwise, match):
    quantizer = MXFP8Quantizer(E4M3, role=ROLE)
    with pytest.raises(ValueError, match=match) as err:
        quantizer.check_shape(shape, rowwise=rowwise, columnwise=columnwise)
    assert "linear:fc1.input" in str(err.value)
    with pytest.raises(ValueError, match=match):
        quantizer(torch.ones(shape), rowwise=rowwise, columnwise=columnwise)


def test_shapes_accepted_per_copy():
    quantizer = MXFP8Quantizer(E4M3)
    quantizer.check_shape((40, 64))  # rows only matter for the column-wise copy
    quantizer.check_shape((64, 40), rowwise=False, columnwise=True)
    t = quantizer(torch.ones(2, 16, 64), rowwise=True, columnwise=True)
    assert tuple(t.columnwise.data.shape) == (64, 32) and tuple(t.columnwise.scale_inv.shape) == (64, 1)


def test_attributes_and_describe():
    quantizer = MXFP8Quantizer(E5M2)
    assert quantizer.scaling == "mx_32" and quantizer.fp8_dtype is E5M2
    assert quantizer.min_compute_capability == (8, 9)
    assert quantizer.describe() == "mxfp8(e5m2)" and quantizer.state_dict() == {}
    with pytest.raises(ValueError, match="fp8_dtype"):
        MXFP8Quantizer(torch.float16)
