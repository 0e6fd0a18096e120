"""QuantizedTensor: the storage of row-wise / column-wise copies."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.kernels.operand import ScaledOperand
from te_fuser.quantization import Float8CurrentScalingQuantizer, MXFP8Quantizer, QuantizedTensor

E4M3 = torch.float8_e4m3fn


def tensor_copy(rows: int, cols: int, scale_inv: float = 0.5) -> ScaledOperand:
    data = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols).remainder(17).to(E4M3)
    return ScaledOperand(data, torch.tensor(scale_inv), "tensor")


def test_dequantize_from_either_copy_restores_the_nd_shape():
    x = torch.linspace(-16.0, 16.0, 2 * 3 * 32).reshape(2, 3, 32).to(E4M3).float()  # exact at scale 16
    quantizer = Float8CurrentScalingQuantizer(E4M3, power_2_scales=True)
    both = quantizer.cast(x, rowwise=True, columnwise=True)
    only_columnwise = QuantizedTensor(None, both.columnwise, both.shape, both.dtype)
    assert tuple(both.rowwise.data.shape) == (6, 32) and tuple(both.columnwise.data.shape) == (32, 6)
    assert_bitwise(both.dequantize(), x, "from rowwise")
    from_columnwise = only_columnwise.dequantize()
    assert from_columnwise.is_contiguous()
    assert_bitwise(from_columnwise, x, "from columnwise, transposed back")
    assert_bitwise(only_columnwise.dequantize(torch.bfloat16), x.bfloat16(), "in another dtype")


def test_properties_and_nbytes():
    t = QuantizedTensor(tensor_copy(4, 64), tensor_copy(64, 4), (4, 64), torch.bfloat16)
    assert t.has_rowwise and t.has_columnwise and t.fp8_dtype is E4M3 and t.scaling == "tensor"
    assert t.nbytes == 2 * (4 * 64 + 4)  # FP8 bytes plus one fp32 scale per copy
    assert t.device == torch.device("cpu") and t.shape == torch.Size([4, 64])
    mx = MXFP8Quantizer(E4M3).cast(torch.ones(4, 64))
    assert mx.nbytes == 4 * 64 + 4 * 2  # one E8M0 byte per 32 elements
    assert not mx.has_columnwise


def test_repr():
    t = QuantizedTensor(tensor_copy(4, 64), None, (2, 2, 64), torch.bfloat16)
    assert repr(t) == (
        "QuantizedTensor(shape=(2, 2, 64), dtype=bfloat16, rowwise=e4m3 tensor (4, 64), "
        "columnwise=None, nbytes=260)"
    )


@pytest.mark.parametrize(
    "rowwise, columnwise, shape, error, match",
    [
        (None, None, (4, 64), ValueError, "neither"),
        (tensor_copy(4, 64), None, (64, 4), ValueError, r"rowwise data of shape \(64, 4\)"),
        (None, tensor_copy(4, 64), (4, 64), ValueError, r"columnwise data of shape \(64, 4\)"),
        (torch.ones(4, 64), None, (4, 64), TypeError, "ScaledOperand"),
        (tensor_copy(4, 64), None, (), ValueError, "0-d"),
    ],
)
def test_construction_is_checked(rowwise, columnwise, shape, error, match):
    with pytest.raises(error, match=match):
        QuantizedTensor(rowwise, columnwise, shape, torch.float32)
