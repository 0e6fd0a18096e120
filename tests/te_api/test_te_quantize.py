"""te.ops.Quantize as TransformerEngine documents it: the forward value and (with
``backward=True``) the gradient rounded onto the recipe's FP8 grid, the gradient
left in high precision under a recipe's ``backward_override``."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import FP8_RECIPES, run
from tolerances import assert_bitwise

_RECIPES = ["delayed", "current", "block", "mxfp8"]


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=gen) * 3, torch.randn(32, 64, generator=gen) * 3


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
@pytest.mark.parametrize("recipe_name", _RECIPES)
def test_backward_override_keeps_the_gradient_in_high_precision(recipe_name, override):
    x, dy = _data(1)
    recipe = FP8_RECIPES[recipe_name].replace(backward_override=override)
    _, grads = run(te.ops.Quantize(forward=False, backward=True), x, recipe=recipe, dy=dy)
    assert_bitwise(grads["x"], dy, f"Quantize backward recipe={recipe_name} backward_override={override}")


@pytest.mark.parametrize("recipe_name", _RECIPES)
def test_without_override_the_gradient_is_rounded_onto_the_fp8_grid(recipe_name):
    x, dy = _data(2)
    _, grads = run(te.ops.Quantize(forward=False, backward=True), x, recipe=FP8_RECIPES[recipe_name], dy=dy)
    rel = ((grads["x"] - dy).abs() / dy.abs().clamp_min(1e-3)).max().item()
    assert 2.0**-6 < rel <= 2.0**-2, f"recipe={recipe_name}: the E5M2 rounding's relative error is {rel}"


def test_forward_still_quantizes_under_backward_override():
    x, dy = _data(3)
    recipe = FP8_RECIPES["current"].replace(backward_override="high_precision")
    outs, _ = run(te.ops.Quantize(forward=True, backward=True), x, recipe=recipe, dy=dy)
    assert not torch.equal(outs[0], x)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_the_input_gradient_is_a_float8_tensor_of_the_cast(recipe_name):
    """As TE's Quantize(backward=True) leaves a QuantizedTensor in ``x.grad``: here a
    Float8Tensor of the input's dtype, holding the E5M2 cast of the gradient (the
    same values a separate cast of dy dequantizes to)."""
    from te_fuser.quantization.float8_tensor import Float8Tensor

    x, dy = _data(4)
    x = x.to(torch.bfloat16).requires_grad_()
    recipe = FP8_RECIPES[recipe_name]
    op = te.ops.Quantize(forward=False, backward=True)
    with te.autocast(recipe=recipe):
        y = op(x)
    y.backward(dy.to(torch.bfloat16))
    assert type(x.grad) is Float8Tensor and x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    assert not isinstance(y, Float8Tensor)
    rel = ((x.grad.float() - dy).abs() / dy.abs().clamp_min(1e-3)).max().item()
    assert 2.0**-6 < rel <= 2.0**-2, f"recipe={recipe_name}: the E5M2 rounding's relative error is {rel}"
