"""TransformerEngine's ``accumulate_into_main_grad``: the weight gradient goes into
``weight.main_grad`` (fp32), added to what it holds (written over it with
``overwrite_main_grad``), and ``.grad`` is None, or a dummy with the
``grad_added_to_main_grad`` flag set (Megatron-LM's protocol)."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import representable
from tolerances import assert_close

RECIPES = {"none": None, "current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling(),
           "mxfp8": te.recipe.MXFP8BlockScaling()}


def _case(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = representable(3, 32, 64, generator=gen, dtype=dtype, scale_exp=-2)  # (3, 32, 64): rows 96
    w = representable(64, 64, generator=gen, dtype=dtype, scale_exp=-3)
    dy = representable(3, 32, 64, generator=gen, dtype=dtype)
    return x, w, dy


def _model(w, dtype, **kw):
    op = te.ops.BasicLinear(64, 64, dtype=dtype, accumulate_into_main_grad=True)
    with torch.no_grad():
        op.weight.copy_(w)
    return op, te.ops.Sequential(op, **kw)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_accumulates_into_main_grad(recipe, dtype):
    x, w, dy = _case(3, dtype)
    op, model = _model(w, dtype)
    op.weight.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
    for step in range(2):  # two micro-batches accumulate
        x_t = x.clone().requires_grad_()
        with te.autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe]):
            y = model(x_t)
        y.backward(dy)
    assert op.weight.grad is None  # no grad_added_to_main_grad attribute: autograd gets nothing
    dw64 = dy.double().reshape(-1, 64).t() @ x.double().reshape(-1, 64)
    key = dtype if RECIPES[recipe] is None else RECIPES[recipe].fp8_format.bwd_dtype
    assert op.weight.main_grad.dtype is torch.float32
    assert_close(op.weight.main_grad - 0.5, 2 * dw64, key, f"main_grad recipe={recipe}", scaled=True)
    assert_close(x_t.grad, (dy.double().reshape(-1, 64) @ w.double()).reshape(x.shape), key if recipe != "none" else dtype,
                 f"dx recipe={recipe}", scaled=True)


def test_high_precision_wgrad_is_not_rounded_to_bf16_before_the_add():
    x, w, dy = _case(5, torch.bfloat16)
    op, model = _model(w, torch.bfloat16)
    op.weight.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    model(x.clone().requires_grad_()).backward(dy)
    dw64 = dy.double().reshape(-1, 64).t() @ x.double().reshape(-1, 64)
    err = (op.weight.main_grad.double() - dw64).abs().max().item()
    rounded = (dw64.to(torch.bfloat16).double() - dw64).abs().max().item()
    assert err < rounded / 16, (err, rounded)  # fp32 sums, far below one bf16 rounding


def test_megatron_flags_overwrite_dummy_and_zero_out():
    x, w, dy = _case(9, torch.float32)
    op, model = _model(w, torch.float32)
    op.weight.main_grad = torch.full(w.shape, 7.0)
    op.weight.overwrite_main_grad = True
    op.weight.grad_added_to_main_grad = False
    op.weight.zero_out_wgrad = True
    model(x.clone().requires_grad_()).backward(dy)
    dw64 = dy.double().reshape(-1, 64).t() @ x.double().reshape(-1, 64)
    assert_close(op.weight.main_grad, dw64, torch.float32, "overwritten main_grad")
    assert op.weight.grad_added_to_main_grad is True
    assert op.weight.grad is not None and op.weight.grad.shape == w.shape
    assert torch.all(op.weight.grad == 0)


def test_linear_bias_gradient_stays_in_grad_and_fused_backward_uses_main_grad():
    x, w, dy = _case(11, torch.float32)
    lin = te.ops.Linear(64, 64, accumulate_into_main_grad=True)
    lin.weight.main_grad = torch.zeros(w.shape)
    model = te.ops.Sequential(lin)
    with torch.no_grad():
        lin.weight.copy_(w)
    recipe = te.recipe.Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        model(x.clone().requires_grad_()).backward(dy)
    assert "backward_linear_bias" in model.fusion_plan().rules()
    assert lin.weight.grad is None and lin.bias.grad is not None
    assert_close(lin.bias.grad, dy.double().reshape(-1, 64).sum(0), torch.float8_e5m2, "dbias", scaled=True)
    dw64 = dy.double().reshape(-1, 64).t() @ x.double().reshape(-1, 64)
    assert_close(lin.weight.main_grad, dw64, torch.float8_e5m2, "main_grad", scaled=True)


def test_missing_main_grad_names_the_op():
    x, w, dy = _case(1, torch.float32)
    op, model = _model(w, torch.float32)
    with pytest.raises(RuntimeError, match="main_grad"):
        model(x.clone().requires_grad_()).backward(dy)
    with pytest.raises(TypeError, match="accumulate_into_main_grad"):
        te.ops.BasicLinear(4, 4, accumulate_into_main_grad=1)
