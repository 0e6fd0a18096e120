"""The capture core's state check (``graphs/core.py``), on the CPU: before a replay
the guard finds every scaling-state tensor an eager step rebound and copies it into
the tensor the graphs read, reading each quantizer's state once."""

from __future__ import annotations

import torch

import te_fuser as te
from te_fuser.graphs.core import CaptureGuard, state_slots


def _model_after_a_step(recipe):
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=recipe):
        model(x).sum().backward()
    return model, x


def test_a_replay_adopts_exactly_what_an_eager_step_rebound():
    """Delayed scaling rebinds its history, scale and scale_inv on every update: after
    an eager step the guard copies each new value into its home tensor and binds the
    quantizer back to it; a second check finds nothing to do."""
    recipe = te.recipe.DelayedScaling()
    model, x = _model_after_a_step(recipe)
    quantizers, slots = state_slots(model)
    assert slots, "delayed scaling has state to hold"
    guard = CaptureGuard(None, tuple(model.parameters()), slots, quantizers)
    assert sum(len(group) for _, group in guard.slot_groups) == len(slots)
    assert len(guard.slot_groups) == len({id(s.quantizer) for s in slots})
    homes = [s.home for s in slots]
    with te.autocast(recipe=recipe):  # an eager step between replays: the quantizers rebind their state
        model(x).sum().backward()
    rebound = [s for s in slots if not s.bound()]
    assert rebound, "an eager step under delayed scaling rebinds the state"
    values = {id(s): s.live().clone() for s in rebound}
    guard.adopt_rebound()
    for slot, home in zip(slots, homes):
        assert slot.home is home and slot.bound(), slot.name
    for slot in rebound:
        assert torch.equal(slot.home, values[id(slot)]), f"{slot.name}: the eager step's value is in the home tensor"
    before = [s.home.clone() for s in slots]
    guard.adopt_rebound()
    assert all(torch.equal(a, s.home) for a, s in zip(before, slots))


def test_stateless_recipes_have_no_slots_to_check():
    model, _ = _model_after_a_step(te.recipe.Float8CurrentScaling())
    quantizers, slots = state_slots(model)
    guard = CaptureGuard(None, tuple(model.parameters()), slots, quantizers)
    assert slots == [] and guard.slot_groups == ()
    guard.adopt_rebound()
