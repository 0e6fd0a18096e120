"""The FP8 weight cast is never stale: after any optimizer step, any write and
any parameter replacement, a forward equals a fresh model's forward on the
current weights, bit for bit; a cast is reused only inside
``te.reuse_quantized_weights()``, and there while nothing changed.

Written as the training loops users write: torch optimizers of every kind,
EMA through ``.data``, state-dict loads, evaluation between steps."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import te_fuser as te
from op_testing import FP8_RECIPES
from te_fuser import recipe as R

H = 64  # MXFP8 and block scaling need multiples of 32 / 128 on some dims: the reference emulates any
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}
if CUDA:
    OPTIMIZERS["adamw_capturable"] = lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=True)


def build(seed=0):
    torch.manual_seed(seed)
    return te.ops.Sequential(
        te.ops.LayerNorm(H), te.ops.Linear(H, 2 * H), te.ops.GELU(), te.ops.Linear(2 * H, H)
    ).to(DEVICE)


def batch(i, rows=32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(rows, H, generator=g).to(DEVICE)


def train_step(model, opt, x, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def fresh_copy(model):
    """A new model holding the same weights and scaling state, with nothing cached."""
    twin = build(seed=1)
    twin.load_state_dict(model.state_dict())
    return twin


def forward(model, x, recipe):
    with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
        return model(x)


def assert_equal_to_fresh(model, x, recipe, what):
    twin = fresh_copy(model)  # copies the scaling state as it is before this forward
    y = forward(model, x, recipe)
    expected = forward(twin, x, recipe)
    assert torch.equal(y, expected), (
        f"{what}: the forward differs from a fresh model on the same weights "
        f"(max diff {(y.double() - expected.double()).abs().max():.3g})"
    )


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_forward_after_every_optimizer_step_uses_the_updated_weights(opt_name, recipe_name):
    recipe = FP8_RECIPES[recipe_name]
    model = build()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for i in range(3):
        train_step(model, opt, batch(i), recipe)
        assert_equal_to_fresh(model, batch(50), recipe, f"{opt_name}/{recipe_name} after step {i}")


def test_writes_through_data_are_seen():
    """EMA weights and master-weight copies are written through ``.data``, which
    torch does not count as a change."""
    recipe = R.Float8CurrentScaling()
    ema, model = build(), build(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = batch(7)
    before = forward(ema, x, recipe)
    for i in range(3):
        train_step(model, opt, batch(i), recipe)
        for e, p in zip(ema.parameters(), model.parameters()):
            e.data.mul_(0.5).add_(p.data, alpha=0.5)
        assert_equal_to_fresh(ema, x, recipe, f"EMA after step {i}")
    assert not torch.equal(forward(ema, x, recipe), before)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_after_a_forward_is_used(assign):
    recipe = R.DelayedScaling()
    model, other = build(), build(seed=5)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    train_step(other, opt, batch(0), recipe)
    x = batch(9)
    forward(model, x, recipe)  # warm: a plan and a weight cast exist
    model.load_state_dict(other.state_dict(), assign=assign)
    assert torch.equal(forward(model, x, recipe), forward(fresh_copy(other), x, recipe))


def test_outside_the_scope_nothing_is_kept():
    model = build()
    with torch.no_grad(), te.autocast(recipe=R.Float8CurrentScaling()):
        model(batch(0))
    assert model[1].linear.cached_weight(torch.float32) is None


def test_inside_the_scope_inference_reuses_the_cast_until_something_changes():
    model = build()
    linear = model[1].linear
    recipe = R.Float8CurrentScaling()
    x = batch(0)
    with te.reuse_quantized_weights():
        forward(model, x, recipe)
        _, w_q = linear.cached_weight(torch.float32)
        forward(model, x, recipe)
        assert linear.cached_weight(torch.float32)[1] is w_q, "an unchanged weight is cast again"
        with torch.no_grad():
            model[1].weight.add_(0.25)  # a tracked in-place write
        assert linear.cached_weight(torch.float32) is None
        assert_equal_to_fresh(model, x, recipe, "after an in-place write inside the scope")
        forward(model, x, recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model(x).sum().backward()
        opt.step()  # fused: no version bump, but an optimizer step all the same
        assert linear.cached_weight(torch.float32) is None
        assert_equal_to_fresh(model, x, recipe, "after a fused AdamW step inside the scope")
        forward(model, x, recipe)
        assert linear.cached_weight(torch.float32) is not None
    assert linear.cached_weight(torch.float32) is None, "leaving the scope keeps a cast"
    assert linear._weight_cache.empty


def _accumulate(recipe, scoped: bool, steps: int = 3, micro_batches: int = 3):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(steps):
        with te.reuse_quantized_weights() if scoped else contextlib.nullcontext():
            for mb in range(micro_batches):
                with te.autocast(recipe=recipe):
                    loss = model(batch(10 * step + mb)).float().square().mean()
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "block"])
def test_gradient_accumulation_in_the_scope_equals_casting_every_micro_batch(recipe_name):
    """The weights do not change between micro-batches, so reusing the first one's
    cast gives the gradients that casting each time gives, bit for bit."""
    recipe = FP8_RECIPES[recipe_name]
    for a, b in zip(_accumulate(recipe, False).parameters(), _accumulate(recipe, True).parameters()):
        assert torch.equal(a, b)


def test_gradient_accumulation_in_the_scope_casts_each_weight_once_per_step():
    """Under delayed scaling every cast records the weight's amax: one per step
    inside the scope, one per micro-batch outside it."""
    recipe = R.DelayedScaling()
    for scoped, casts in ((False, 9), (True, 3)):
        model = _accumulate(recipe, scoped)
        history = model[1].linear.quantizer("weight").amax_history
        assert int((history > 0).sum()) == casts, f"scoped={scoped}"


def test_copies_and_pickles_start_with_an_empty_cache():
    model = build()
    with te.reuse_quantized_weights():
        forward(model, batch(0), R.Float8CurrentScaling())
        twin = copy.deepcopy(model)
        assert twin[1].linear._weight_cache.empty
        assert not model[1].linear._weight_cache.empty
