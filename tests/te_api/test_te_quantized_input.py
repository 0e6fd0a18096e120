"""A quantizer's output used as TransformerEngine code uses a QuantizedTensor:
``.to(dtype)`` dequantizes into that dtype in one rounding, and a Sequential takes
it as its input (as the Float8Tensor of those FP8 values)."""

from __future__ import annotations

import torch

import te_fuser as te
from te_fuser.quantization import Float8CurrentScalingQuantizer
from te_fuser.quantization.float8_tensor import Float8Tensor
from tolerances import assert_bitwise


def test_to_dequantizes_into_the_dtype_and_moves():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(16, 32, dtype=torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert_bitwise(q.to(dtype=dtype), q.dequantize(dtype), f"to({dtype})")
        assert_bitwise(q.to(dtype), q.dequantize(dtype), f"to({dtype}) positional")
    assert q.to("cpu", torch.float32).dtype is torch.float32 and q.to().dtype is torch.bfloat16


def test_a_sequential_takes_a_quantizers_output():
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
    assert type(te.ops.Sequential(te.ops.Identity())(q)) is Float8Tensor  # passes FP8 on
    seq = te.ops.Sequential(te.ops.BasicLinear(32, 8), te.ops.GELU())
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        got = seq(q)
        want = seq(q.dequantize())  # the same FP8 values, cast again by the linear: the same bytes
    assert_bitwise(got, want, "a QuantizedTensor input")
