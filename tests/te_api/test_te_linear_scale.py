"""TransformerEngine's fused ``ForwardLinearScaleAdd`` (``Linear -> ConstantScale ->
AddExtraInput``: ``scale · (x · wᵀ) + residual`` rounded once) and
``BackwardLinearScale`` (``Linear -> ConstantScale``: the scale applied by the
backward GEMMs), against float64 under each recipe; and ``ForwardLinearBiasAdd``
firing without a bias."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import representable
from te_fuser.ops.fused import BackwardLinearScale, ForwardLinearBiasAdd, ForwardLinearScaleAdd
from tolerances import assert_close

RECIPES = {"none": None, "current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling(),
           "mxfp8": te.recipe.MXFP8BlockScaling(), "block": te.recipe.Float8BlockScaling()}


def _case(seed, dtype, n=128):
    gen = torch.Generator().manual_seed(seed)
    x = representable(2, 64, n, generator=gen, dtype=dtype, scale_exp=-2)
    w = representable(n, n, generator=gen, dtype=dtype, scale_exp=-3)
    res = representable(2, 64, n, generator=gen, dtype=dtype)
    dy = representable(2, 64, n, generator=gen, dtype=dtype)
    return x, w, res, dy


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("scale", [-0.37, 2.0])
def test_linear_scale_add_forward_and_backward(recipe, scale):
    dtype = torch.bfloat16
    x, w, res, dy = _case(3, dtype)
    model = te.ops.Sequential(te.ops.Linear(128, 128, bias=False, dtype=dtype), te.ops.ConstantScale(scale),
                              te.ops.AddExtraInput(in_place=True))
    with torch.no_grad():
        model[0].weight.copy_(w)
    x_t, r_t = x.clone().requires_grad_(), res.clone().requires_grad_()
    rec = RECIPES[recipe]
    with te.autocast(enabled=rec is not None, recipe=rec):
        y = model(x_t, r_t)
    y.backward(dy)
    plan = model.groups()[0].plan
    steps = {type(s.executor) for s in plan.forward + plan.backward}
    assert ForwardLinearScaleAdd in steps and BackwardLinearScale in steps, model.fusion_plan()
    assert y.data_ptr() == r_t.data_ptr()
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y64 = scale * (x64 @ w64.t()) + res.double()
    fwd = dtype if rec is None else rec.fp8_format.fwd_dtype
    bwd = dtype if rec is None else rec.fp8_format.bwd_dtype
    ctx = f"recipe={recipe} scale={scale}"
    assert_close(y, y64, fwd, f"{ctx} y", scaled=True)
    assert_close(x_t.grad, scale * dy64 @ w64, bwd, f"{ctx} dx", scaled=True)
    assert_close(model[0].weight.grad, scale * dy64.reshape(-1, 128).t() @ x64.reshape(-1, 128), bwd,
                 f"{ctx} dw", scaled=True)
    assert torch.equal(r_t.grad, dy)


def test_scale_add_rounds_once_in_high_precision():
    x, w, res, _ = _case(5, torch.bfloat16)
    model = te.ops.Sequential(te.ops.BasicLinear(128, 128, dtype=torch.bfloat16), te.ops.ConstantScale(0.3),
                              te.ops.AddExtraInput())
    with torch.no_grad():
        model[0].weight.copy_(w)
        y = model(x, res)
    y64 = 0.3 * (x.double() @ w.double().t()) + res.double()
    # one rounding of an fp32 sum: within half a bf16 ulp of the float64 value (plus the fp32 sums' slack)
    half_ulp = 2.0 ** (torch.floor(torch.log2(y64.abs())) - 8)
    err = (y.double() - y64).abs()
    assert torch.all(err <= half_ulp * 1.01), (err / half_ulp).max()


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_backward_linear_scale_equals_scaling_dy_first(recipe):
    """Fused (scale in the GEMMs' dequantization scales, or dy scaled before a stateful
    cast) against the unfused ops, and the delayed-scaling amax history records
    ``scale · dy`` as the unfused ops' does."""
    x, w, _, dy = _case(7, torch.bfloat16, n=64)
    rec = RECIPES[recipe]
    grads = []
    for fuse in (True, False):
        model = te.ops.Sequential(te.ops.BasicLinear(64, 64, dtype=torch.bfloat16), te.ops.ConstantScale(-0.75),
                                  fuse=fuse)
        with torch.no_grad():
            model[0].weight.copy_(w)
        x_t = x.clone().requires_grad_()
        with te.autocast(recipe=rec):
            y = model(x_t)
        y.backward(dy)
        grads.append((x_t.grad, model[0].weight.grad, model[0].quantizer("grad_output")))
    (dx_f, dw_f, q_f), (dx_u, dw_u, q_u) = grads
    assert_close(dx_f, dx_u, torch.bfloat16, "dx", scaled=True)
    assert_close(dw_f, dw_u, torch.bfloat16, "dw", scaled=True)
    if recipe == "delayed":
        for name in q_u.STATE_TENSORS:
            assert torch.equal(getattr(q_f, name), getattr(q_u, name)), name


def test_forward_linear_bias_add_fires_without_a_bias():
    model = te.ops.Sequential(te.ops.Linear(32, 32, bias=False), te.ops.AddExtraInput())
    model(torch.randn(4, 32), torch.randn(4, 32))
    assert isinstance(model.groups()[0].plan.forward[0].executor, ForwardLinearBiasAdd)
