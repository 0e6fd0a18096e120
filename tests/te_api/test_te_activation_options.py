"""TransformerEngine's activation arguments: ``cache_quantized_input`` (the input kept
for the backward as an FP8 E4M3 current-scaling cast) and ``glu_interleave_size``
(gate and up in blocks ``[g0, u0, g1, u1, ...]``), alone and inside fused plans."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import run
from te_fuser.kernels.reference import activation_reference
from te_fuser.quantization import Float8CurrentScalingQuantizer
from tolerances import assert_close

_KINDS = {"GELU": "gelu", "SiLU": "silu", "SReLU": "srelu", "SwiGLU": "swiglu", "GEGLU": "geglu", "ReGLU": "reglu"}


def _data(seed, shape=(5, 13, 64)):
    gen = torch.Generator().manual_seed(seed)
    return -0.3 + torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def _reference(kind, x, dy):
    x64 = x.double().requires_grad_(True)
    y = activation_reference(x64, kind)
    y.backward(dy.double()[..., : y.shape[-1]])
    return y.detach(), x64.grad


@pytest.mark.parametrize("name", list(_KINDS))
def test_cached_fp8_input_gives_the_gradient_at_the_cast_value(name):
    x, dy = _data(1)
    kind = _KINDS[name]
    x_fp8 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x).dequantize()
    op = getattr(te.ops, name)(cache_quantized_input=True)
    outs, grads = run(op, x, dy=dy[..., : (32 if kind in ("swiglu", "geglu", "reglu") else 64)])
    y_ref, _ = _reference(kind, x, dy)  # the forward reads the input itself
    _, dx_at_cast = _reference(kind, x_fp8, dy)  # the backward reads the FP8 copy
    assert_close(outs[0], y_ref, torch.float32, f"{name} cached: output")
    assert_close(grads["x"], dx_at_cast, torch.float32, f"{name} cached: dx at the FP8 value")
    _, dx_exact = _reference(kind, x, dy)
    assert not torch.allclose(grads["x"].double(), dx_exact, rtol=1e-4, atol=1e-5), \
        f"{name} cached: the gradient did not see the FP8 rounding of its input"


def test_cached_input_under_a_recipe_and_in_bf16():
    x, dy = _data(2, (32, 64))
    x = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x).dequantize()  # the cast is exact again
    seq = te.ops.Sequential(te.ops.Quantize(forward=False, backward=True), te.ops.SwiGLU(cache_quantized_input=True))
    outs, grads = run(seq.to(torch.bfloat16), x.bfloat16(), dy=dy[:, :32].bfloat16(),
                      recipe=te.recipe.Float8CurrentScaling())
    y_ref, dx_ref = _reference("swiglu", x.bfloat16().float(), dy.bfloat16().float())
    assert_close(outs[0], y_ref, torch.bfloat16, "SwiGLU cached bf16: output")
    assert_close(grads["x"], dx_ref, torch.float8_e4m3fn, "SwiGLU cached bf16 under FP8: dx")


@pytest.mark.parametrize("size", [1, 4, 16])
def test_interleaved_glu_equals_the_halves_layout_permuted(size):
    x, dy = _data(3, (6, 64))
    n = x.shape[-1]
    perm = torch.arange(n).reshape(2, n // (2 * size), size).transpose(0, 1).reshape(n)  # halves -> interleaved
    outs, grads = run(te.ops.SwiGLU(glu_interleave_size=size), x[:, perm], dy=dy[:, :32])
    y_ref, dx_ref = _reference("swiglu", x, dy)
    assert_close(outs[0], y_ref, torch.float32, f"interleave {size}: output")
    assert_close(grads["x"], dx_ref[:, perm], torch.float32, f"interleave {size}: dx")


def test_interleaved_glu_behind_linear_and_bias_declines_the_epilogue():
    torch.manual_seed(4)
    model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.SwiGLU(glu_interleave_size=8))
    plain = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.SwiGLU(glu_interleave_size=8), fuse=False)
    plain.load_state_dict(model.state_dict())
    x, dy = torch.randn(16, 32), torch.randn(16, 32)
    outs, grads = run(model, x, dy=dy)
    ref_outs, ref_grads = run(plain, x, dy=dy)
    assert_close(outs[0], ref_outs[0].double(), torch.float32, "interleaved SwiGLU after Linear: output")
    assert_close(grads["x"], ref_grads["x"].double(), torch.float32, "interleaved SwiGLU after Linear: dx")
    with torch.no_grad():  # the forward rule's plan without a backward
        assert_close(model(x), plain(x).double(), torch.float32, "interleaved SwiGLU, no backward")
    assert "glu_interleave_size=8" in str(model.fusion_plan())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="glu_interleave_size"):
        te.ops.GELU(glu_interleave_size=4)
    with pytest.raises(ValueError, match="glu_interleave_size"):
        te.ops.SwiGLU(glu_interleave_size=0)
    with pytest.raises(TypeError, match="cache_quantized_input"):
        te.ops.ReLU(cache_quantized_input=1)
    with pytest.raises(ValueError, match="2 \\* glu_interleave_size"):
        te.ops.SwiGLU(glu_interleave_size=16)(torch.randn(4, 48))
