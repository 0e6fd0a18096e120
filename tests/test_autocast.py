"""te.autocast: nesting, restoring on exceptions, defaults, torch.autocast composition."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser import recipe as R
from te_fuser.autocast import current_state


def test_nesting_restores_the_outer_state_also_on_an_exception():
    outer, inner = R.Float8CurrentScaling(), R.MXFP8BlockScaling()
    assert current_state().active_recipe is None
    # (compared by value: an equal recipe from an earlier region may stand for it)
    with te.autocast(recipe=outer):
        assert current_state().active_recipe == outer
        with pytest.raises(KeyError):
            with te.autocast(recipe=inner):
                assert current_state().active_recipe == inner
                raise KeyError("boom")
        assert current_state().active_recipe == outer
        with te.autocast(enabled=False):
            assert current_state().active_recipe is None
        assert current_state().active_recipe == outer
    assert current_state().active_recipe is None


def test_default_recipe_and_bad_arguments():
    with te.autocast():
        assert current_state().recipe is te.DEFAULT_RECIPE
        assert isinstance(te.DEFAULT_RECIPE, R.DelayedScaling)
    with pytest.raises(TypeError, match="recipe"):
        with te.autocast(recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="enabled"):
        with te.autocast(enabled=1):
            pass


def test_calibrating_records_amax_without_quantizing():
    model = te.ops.Sequential(te.ops.Linear(32, 32))
    x = torch.randn(8, 32) * 3
    with torch.no_grad():
        y_hp = model(x)
        with te.autocast(enabled=False, calibrating=True, recipe=R.DelayedScaling()):
            y_cal = model(x)
    assert torch.equal(y_hp, y_cal)
    q = model[0].linear.quantizer("input")
    assert q.seeded and torch.equal(q.amax_history[0], x.abs().max())


@pytest.mark.parametrize("order", ["torch_outside", "torch_inside"])
def test_composes_with_torch_autocast_in_both_orders(order):
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))
    x = torch.randn(8, 32, requires_grad=True)
    recipe = R.Float8CurrentScaling()
    if order == "torch_outside":
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(recipe=recipe):
            y = model(x)
    else:
        with te.autocast(recipe=recipe), torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
    assert "dtype=bfloat16" in model.fusion_plan()


def test_backend_override_is_scoped():
    assert te.get_backend() in ("auto", "reference")
    with te.autocast(recipe=R.Float8CurrentScaling(), backend="reference"):
        assert te.get_backend() == "reference"
    with pytest.raises(ValueError, match="backend"):
        with te.autocast(backend="fastest"):
            pass
