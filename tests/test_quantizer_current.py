"""Float8CurrentScalingQuantizer: power-of-2 scales, epsilon, the zero tensor."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.quantization import Float8CurrentScalingQuantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


def amax_3() -> torch.Tensor:
    return torch.tensor([[1.0, -3.0, 0.5], [2.0, 0.25, 0.0]])


@pytest.mark.parametrize(
    "fp8_dtype, power_2, scale",
    [
        (E4M3, False, f32(448 / 3)),
        (E4M3, True, 128.0),  # 149.33 rounded down to a power of 2
        (E5M2, False, f32(57344 / 3)),
        (E5M2, True, 2.0**14),
    ],
)
def test_scale_by_hand(fp8_dtype, power_2, scale):
    x = amax_3()
    t = Float8CurrentScalingQuantizer(fp8_dtype, power_2_scales=power_2)(x, rowwise=True, columnwise=True)
    assert t.scaling == "tensor" and t.rowwise.scale_inv.dim() == 0
    assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1 / scale)), "scale_inv")
    assert_bitwise(t.rowwise.data, (x * scale).to(fp8_dtype), "data")
    assert_bitwise(t.columnwise.data, t.rowwise.data.t().contiguous(), "column-wise = transposed")
    assert t.columnwise.scale_inv is t.rowwise.scale_inv


def test_epsilon_floors_the_amax():
    x = torch.full((2, 4), 1e-6)
    quantizer = Float8CurrentScalingQuantizer(E4M3, amax_epsilon=1e-3)
    scale = f32(448 / f32(1e-3))
    assert_bitwise(quantizer(x).rowwise.scale_inv, torch.tensor(f32(1 / scale)), "epsilon scale_inv")
    pow2 = Float8CurrentScalingQuantizer(E4M3, power_2_scales=True, amax_epsilon=1e-3)
    assert pow2(x).rowwise.scale_inv.item() == 2.0**-18  # 448000 -> 2**18
    big = torch.full((2, 4), 10.0)
    assert quantizer(big).rowwise.scale_inv.item() == f32(1 / 44.8)  # epsilon below amax: no effect


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_tensor(hp_dtype):
    x = torch.zeros(3, 5, dtype=hp_dtype)
    t = Float8CurrentScalingQuantizer(E4M3)(x, rowwise=True, columnwise=True)
    assert t.rowwise.scale_inv.item() == 1.0
    assert not t.rowwise.data.float().any() and not t.columnwise.data.float().any()
    assert_bitwise(t.dequantize(), x, "zeros back")
    eps = Float8CurrentScalingQuantizer(E4M3, amax_epsilon=0.5)(x)
    assert eps.rowwise.scale_inv.item() == f32(1 / 896)


def test_nd_input_and_dtype():
    x = amax_3().reshape(1, 2, 3).to(torch.bfloat16)
    t = Float8CurrentScalingQuantizer(E4M3, power_2_scales=True)(x, rowwise=False, columnwise=True)
    assert t.shape == x.shape and t.dtype == torch.bfloat16 and not t.has_rowwise
    assert_bitwise(t.dequantize(), x, "exact values at a power-of-2 scale")
    assert t.dequantize(torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(power_2_scales="yes"), TypeError, "power_2_scales"),
        (dict(amax_epsilon=-0.5), ValueError, "amax_epsilon"),
        (dict(amax_epsilon=True), ValueError, "amax_epsilon"),
    ],
)
def test_invalid_arguments(kwargs, error, field):
    with pytest.raises(error, match=field):
        Float8CurrentScalingQuantizer(E4M3, **kwargs)


def test_describe():
    assert Float8CurrentScalingQuantizer(E4M3).describe() == "current(e4m3)"
    text = Float8CurrentScalingQuantizer(E5M2, power_2_scales=True, amax_epsilon=1e-3).describe()
    assert text == "current(e5m2, pow2, eps=0.001)"
