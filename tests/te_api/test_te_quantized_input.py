"""A quantizer's output used as TransformerEngine code uses a QuantizedTensor: a
Float8Tensor that takes ``requires_grad_``, ``copy_`` and ``.to``, whose gradient
arrives, and that a Sequential takes as its input. The internal ``cast`` storage's
``.to(dtype)`` dequantizes into that dtype in one rounding."""

from __future__ import annotations

import torch

import te_fuser as te
from te_fuser.quantization import Float8CurrentScalingQuantizer
from te_fuser.quantization.float8_tensor import Float8Tensor
from tolerances import assert_bitwise


def test_a_quantizers_call_gives_a_tensor_of_its_nominal_dtype():
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    f = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
    assert type(f) is Float8Tensor and f.dtype is torch.bfloat16 and f.shape == x.shape
    assert f.fp8_nbytes == 16 * 32 + 4  # FP8 bytes and one fp32 scale
    f.requires_grad_()
    assert f.is_leaf and f.requires_grad
    ref = torch.empty(16, 32, dtype=torch.float64)
    ref.copy_(f)  # TransformerEngine's tests build their float64 references so
    assert_bitwise(ref, f.dequantize().double(), "copy_ into float64")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # a bf16 tensor: its bf16 values, converted
        assert_bitwise(f.to(dtype), f.dequantize().to(dtype), f"to({dtype})")


def test_the_internal_cast_dequantizes_into_the_dtype_and_moves():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).cast(torch.randn(16, 32, dtype=torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert_bitwise(q.to(dtype=dtype), q.dequantize(dtype), f"to({dtype})")
        assert_bitwise(q.to(dtype), q.dequantize(dtype), f"to({dtype}) positional")
    assert q.to("cpu", torch.float32).dtype is torch.float32 and q.to().dtype is torch.bfloat16


def test_the_gradient_reaches_a_quantized_leaf():
    torch.manual_seed(0)
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    seq = te.ops.Sequential(te.ops.BasicLinear(32, 8))
    f = quantizer(torch.randn(16, 32)).requires_grad_()
    plain = f.dequantize().detach().requires_grad_()
    seq(f).square().sum().backward()
    seq(plain).square().sum().backward()
    assert f.grad is not None and type(f.grad) is torch.Tensor
    assert_bitwise(f.grad, plain.grad, "the leaf's gradient")


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
