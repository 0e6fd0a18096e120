"""Delayed-scaling state is durable: an evaluation pass in high precision leaves
it untouched, a checkpoint always carries the last FP8 state, and a loaded
history is kept (resized for another ``amax_history_len``), never dropped."""

from __future__ import annotations

import io

import pytest
import torch

import te_fuser as te
from te_fuser import recipe as R

H = 32
DELAYED = R.DelayedScaling(amax_history_len=8)


def build(seed=0):
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))


def batch(i):
    return torch.randn(16, H, generator=torch.Generator().manual_seed(i))


def train(model, opt, steps, recipe=DELAYED, start=0, eval_between=None):
    for i in range(start, start + steps):
        with te.autocast(recipe=recipe):
            loss = model(batch(i)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if eval_between is not None:
            eval_between(model)


def scaling_state(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


def histories(model):
    return [op.quantizer(t).amax_history.clone() for op in (model[1].linear, model[3].linear)
            for t in ("input", "weight", "grad_output")]


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


EVALS = {
    "no_autocast": lambda m: m(batch(99)),
    "autocast_disabled": lambda m: _under(te.autocast(enabled=False), m),
    "eval_mode_no_grad": lambda m: _eval(m),
}


def _under(ctx, model):
    with ctx:
        return model(batch(99))


def _eval(model):
    model.eval()
    with torch.no_grad():
        model(batch(99))
    model.train()


@pytest.mark.parametrize("how", list(EVALS))
def test_high_precision_evaluation_between_steps_leaves_the_training_unchanged(how):
    runs = []
    for evaluate in (None, EVALS[how]):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        train(model, opt, 4, eval_between=evaluate)
        runs.append((histories(model), [p.detach().clone() for p in model.parameters()]))
    (h_plain, p_plain), (h_eval, p_eval) = runs
    for a, b in zip(h_plain, h_eval):
        assert torch.equal(a, b), "an evaluation pass changed the amax history"
    for a, b in zip(p_plain, p_eval):
        assert torch.equal(a, b), "an evaluation pass changed the training"


def test_a_checkpoint_after_an_evaluation_pass_holds_the_scaling_state():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 3)
    before = histories(model)
    assert all(int((h > 0).sum()) == 3 for h in before)
    _eval(model)
    resumed = build(seed=1)
    resumed.load_state_dict(roundtrip(model.state_dict()))
    _eval(resumed)  # a high-precision pass before the first FP8 one: the loaded state waits
    third = build(seed=2)
    third.load_state_dict(roundtrip(resumed.state_dict()))  # and is saved again meanwhile
    for m in (model, resumed, third):
        with te.autocast(recipe=DELAYED):
            m(batch(5)).sum().backward()  # one more amax recorded per role
        for got, old in zip(histories(m), before):
            assert torch.equal(got[1:4], old[:3]), "the history before the evaluation pass was lost"
    for a, b, c in zip(histories(model), histories(resumed), histories(third)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_resume_is_bit_identical_to_training_on():
    """Train 3 steps, save model and optimizer, resume in new objects, train 3 more:
    the same weights and scaling state as 6 steps without a stop."""
    straight = build()
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2, fused=True)
    train(straight, opt, 6)

    first = build()
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2, fused=True)
    train(first, opt, 3)
    checkpoint = roundtrip({"model": first.state_dict(), "opt": opt.state_dict()})
    resumed = build(seed=7)
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, fused=True)
    resumed.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    train(resumed, opt, 3, start=3)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(histories(straight), histories(resumed)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("new_len", [4, 8, 16])
def test_a_history_loaded_under_another_length_is_resized_not_dropped(new_len):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 6)  # 6 amaxes recorded per role, newest first
    saved = histories(model)
    resumed = build(seed=1)
    resumed.load_state_dict(roundtrip(model.state_dict()))
    other = DELAYED.replace(amax_history_len=new_len)
    resumed.prepare(batch(0), recipe=other)
    for op in (resumed[1].linear, resumed[3].linear):
        assert op.quantizer("input").amax_history_len == new_len
    kept = min(8, new_len)
    for got, old in zip(histories(resumed), saved):
        assert torch.equal(got[:kept], old[:kept]), "the newest entries must be kept"
        assert not got[kept:].any(), "a grown history pads zeros at the old end"
        assert (got > 0).any()


def test_a_checkpoint_loaded_into_a_live_model_under_another_recipe_is_kept_for_later():
    """The live model trains under current scaling (no state); the checkpoint's
    delayed-scaling state waits for a switch back to delayed scaling."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 3)
    saved = histories(model)
    live = build(seed=1)
    train(live, torch.optim.SGD(live.parameters(), lr=0.1), 2, recipe=R.Float8CurrentScaling())
    live.load_state_dict(model.state_dict())
    train(live, torch.optim.SGD(live.parameters(), lr=0.1), 1, recipe=R.Float8CurrentScaling())
    live.prepare(batch(0), recipe=DELAYED)
    for got, old in zip(histories(live), saved):
        assert torch.equal(got, old)


def test_a_checkpoint_loaded_into_a_model_on_the_same_recipe_applies_at_once():
    """The hot path would otherwise keep running the old state: the load writes
    into the installed quantizers."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 3)
    live = build(seed=1)
    train(live, torch.optim.SGD(live.parameters(), lr=0.1), 5)
    live.load_state_dict(model.state_dict())
    for got, old in zip(histories(live), histories(model)):
        assert torch.equal(got, old)
    with te.autocast(recipe=DELAYED):
        assert torch.equal(live(batch(3)), model(batch(3)))
