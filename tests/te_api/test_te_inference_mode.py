"""Parameters created under ``torch.inference_mode()`` (TransformerEngine's
``test_linear_inference_loop``): inference tensors have no version counter, so
the weight cast is never kept for them, and every forward casts the weight it
reads; outputs match a float64 linear of the same parameters."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable
from tolerances import assert_close


def _inference_model(gen):
    with torch.inference_mode():
        model = te.ops.Sequential(te.ops.RMSNorm(64), te.ops.Linear(64, 64), te.ops.GELU())
        for p in model.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -3))
    return model


def _reference(model, x):
    norm, lin = model[0], model[1]
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    return torch.nn.functional.gelu(h @ lin.weight.double().t() + lin.bias.double(), approximate="tanh")


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
def test_inference_loop_with_parameters_made_under_inference_mode(recipe_name):
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(5)
    model = _inference_model(gen)
    assert model[1].weight.is_inference()
    for step in range(3):
        x = representable(32, 64, generator=gen).requires_grad_(step % 2 == 0)  # TE's inputs require grad
        inside = step == 2
        with torch.inference_mode(inside), te.reuse_quantized_weights(), te.autocast(enabled=recipe is not None,
                                                                                       recipe=recipe):
            y = model(x)
        # bf16-free fp32 model: FP8 only rounds the normed activations (the input cast)
        key = torch.float32 if recipe is None else torch.float8_e4m3fn
        assert_close(y, _reference(model, x.detach()), key, f"recipe={recipe_name} step={step}", scaled=True)


def test_a_weight_written_in_inference_mode_is_never_served_stale():
    gen = torch.Generator().manual_seed(6)
    model = _inference_model(gen)
    x = representable(8, 64, generator=gen)
    recipe = RECIPES["current"]
    with te.reuse_quantized_weights(), te.autocast(recipe=recipe):
        first = model(x)
        with torch.inference_mode():
            model[1].weight.mul_(2.0)  # no version counter records this
        second = model(x)
    assert not torch.equal(first, second)
    assert_close(second, _reference(model, x), torch.float8_e4m3fn, "after the write", scaled=True)


def test_fp8_parameters_read_under_inference_mode():
    """TransformerEngine's inference stage reads an FP8 weight with ``detach()`` and
    views under ``torch.inference_mode()``: the aliases keep the FP8 values (before,
    making them raised "Cannot set version_counter for inference tensor")."""
    from te_fuser.quantization.float8_tensor import Float8Tensor

    recipe = te.recipe.Float8CurrentScaling()
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        op = te.ops.Linear(32, 16)
    x = torch.randn(4, 32)
    with te.autocast(recipe=recipe):
        want = op(x).detach()
    with torch.inference_mode():
        alias, view = op.weight.detach(), op.weight.view(2, 8, 32)
        assert type(alias) is Float8Tensor and type(view) is Float8Tensor
        assert torch.equal(alias.dequantize(), op.weight.dequantize())
        assert torch.equal(view.dequantize().reshape(16, 32), op.weight.dequantize())
        with te.autocast(recipe=recipe):
            got = op(x)
    assert torch.equal(got, want)
    assert op.weight.detach()._version == op.weight._version  # outside, an alias shares the counter
