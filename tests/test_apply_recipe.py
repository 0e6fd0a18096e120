"""``te.apply_recipe``: a whole model switches at once or not at all; the applied
recipe is the model's own, pinned overrides hold, the precedence table of the
module doc holds in every nesting, and checkpoints carry and check it."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import te_fuser as te
from te_fuser import recipe as R
from te_fuser.quantization import IdentityQuantizer

H = 64
DELAYED = R.DelayedScaling(amax_history_len=8)
CURRENT = R.Float8CurrentScaling()
MXFP8 = R.MXFP8BlockScaling()


class Model(nn.Module):
    """Two te Sequentials with a plain module between them, and a standalone te Linear head."""

    def __init__(self, head_out=H, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 2 * H), te.ops.GELU(),
                                      te.ops.Linear(2 * H, H))
        self.mix = nn.Tanh()
        self.tail = te.ops.Sequential(te.ops.RMSNorm(H), te.ops.Linear(H, H))
        self.head = te.ops.Linear(H, head_out)

    def forward(self, x):
        return self.head(self.tail(self.mix(self.body(x))))


def batch(i, rows=32):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(i))


def step(model, opt, x, recipe="own"):
    ctx = te.autocast(enabled=recipe is not None, recipe=recipe) if recipe != "own" else _Null()
    with ctx:
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def snapshot(model):
    """Everything apply_recipe could change, to compare."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, te.ops.BasicOperation):
            out[name] = (m._quantizers, {t: q.state_dict() for t, q in m._quantizers.items()}, m._quantizer_key)
    fusers = te.ops.fusers_of(model)
    out["plans"] = [(f.plan, f.own_recipe) for f in fusers]
    return out


def assert_same_snapshot(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if k == "plans":
            assert all(p is q and o == r for (p, o), (q, r) in zip(a[k], b[k])), "a plan changed"
            continue
        qa, sa, ka = a[k]
        qb, sb, kb = b[k]
        assert qa is qb and ka == kb, f"{k}: quantizers replaced"
        for t in sa:
            for field in sa[t]:
                va, vb = sa[t][field], sb[t][field]
                assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, f"{k}.{t}.{field}"


def trained(recipe, steps=2):
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i in range(steps):
        step(model, opt, batch(i), recipe)
    return model, opt


@pytest.mark.parametrize("bad", ["mxfp8_on_48", "qfactory_refuses"])
def test_a_recipe_one_module_cannot_take_changes_nothing(bad):
    model = Model(head_out=48) if bad == "mxfp8_on_48" else Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        step(model, opt, batch(i), DELAYED)
    before = snapshot(model)
    reference = copy.deepcopy(model)
    if bad == "mxfp8_on_48":
        recipe, match = MXFP8, r"apply_recipe: head \[Linear\].*48"
    else:
        def refuse(role):
            if role.module_type == "linear" and role.tensor_type == "grad_output" and role.name == "lm":
                raise ValueError("no gradients for the head")
            return IdentityQuantizer()

        model.head.linear.name = reference.head.linear.name = "lm"
        recipe, match = R.CustomRecipe(refuse, qfactory_key="refuse_head"), "apply_recipe: head.*no gradients"
    with pytest.raises((ValueError, RuntimeError), match=match):
        te.apply_recipe(model, recipe, example_inputs=batch(0))
    assert_same_snapshot(before, snapshot(model))
    with te.autocast(recipe=DELAYED):  # every module still runs as before, bit for bit
        assert torch.equal(model(batch(5)), reference(batch(5)))


def test_an_applied_model_trains_as_a_fresh_model_under_that_recipe():
    model = Model()
    te.apply_recipe(model, DELAYED, example_inputs=batch(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    twin = Model()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for i in range(3):
        assert torch.equal(step(model, opt, batch(i), "own"), step(twin, twin_opt, batch(i), DELAYED))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert model.body[1].quantizer("input").amax_history.equal(twin.body[1].quantizer("input").amax_history)


def test_the_shapes_of_the_last_call_or_an_error_asking_for_example_inputs():
    model = Model()
    with pytest.raises(ValueError, match="has not run yet.*example_inputs"):
        te.apply_recipe(model, CURRENT)
    model(batch(0))
    te.apply_recipe(model, CURRENT)  # the last call's shapes
    assert model.body._fusers()[0].plan.recipe_key == str(CURRENT)


def test_overrides_are_checked_before_anything():
    model = Model()
    with pytest.raises(ValueError, match="'nope' is not a module path"):
        te.apply_recipe(model, CURRENT, example_inputs=batch(0), overrides={"nope": None})
    with pytest.raises(TypeError, match=r"overrides\['head'\]"):
        te.apply_recipe(model, CURRENT, example_inputs=batch(0), overrides={"head": "fp8"})
    assert all(f.plan is None for f in model.body._fusers())


def _recipes_run(model, ctx) -> dict:
    """The recipe key each module's plan ran under, for one forward in ``ctx``."""
    with ctx:
        model(batch(1))
    return {"body": model.body._fusers()[0].plan.recipe_key, "tail": model.tail._fusers()[0].plan.recipe_key,
            "head": model.head.own_fuser().plan.recipe_key}


HP = "high_precision"


@pytest.mark.parametrize("apply_inside_autocast", [False, True])
def test_precedence_in_every_nesting(apply_inside_autocast):
    model = Model()
    outer = te.autocast(recipe=MXFP8) if apply_inside_autocast else _Null()
    with outer:
        te.apply_recipe(model, DELAYED, example_inputs=batch(0), overrides={"head": None, "tail": CURRENT})
    own, cur = str(DELAYED), str(CURRENT)
    table = [
        (_Null(), {"body": own, "tail": cur, "head": HP}),
        (te.autocast(), {"body": own, "tail": cur, "head": HP}),
        (te.autocast(recipe=MXFP8), {"body": str(MXFP8), "tail": cur, "head": HP}),
        (te.autocast(enabled=False), {"body": HP, "tail": cur, "head": HP}),
        (te.autocast(recipe=MXFP8, override_pinned=True), {"body": str(MXFP8), "tail": str(MXFP8),
                                                          "head": str(MXFP8)}),
        (te.autocast(enabled=False, override_pinned=True), {"body": HP, "tail": HP, "head": HP}),
    ]
    for ctx, expected in table:
        assert _recipes_run(model, ctx) == expected
    with te.autocast(recipe=MXFP8):  # nested: the inner region decides
        assert _recipes_run(model, te.autocast(enabled=False)) == {"body": HP, "tail": cur, "head": HP}


def test_apply_again_replaces_and_none_means_high_precision():
    model = Model()
    te.apply_recipe(model, DELAYED, example_inputs=batch(0))
    assert _recipes_run(model, _Null()) == {"body": str(DELAYED), "tail": str(DELAYED), "head": str(DELAYED)}
    te.apply_recipe(model, None)
    assert _recipes_run(model, _Null()) == {"body": HP, "tail": HP, "head": HP}
    assert _recipes_run(model, te.autocast(recipe=CURRENT)) == {k: str(CURRENT) for k in ("body", "tail", "head")}


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_checkpoint_round_trip_across_apply_recipe_is_bit_identical():
    straight = Model()
    te.apply_recipe(straight, DELAYED, example_inputs=batch(0))
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2, fused=True)
    for i in range(4):
        step(straight, opt, batch(i))

    first = Model()
    te.apply_recipe(first, DELAYED, example_inputs=batch(0))
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2, fused=True)
    for i in range(2):
        step(first, opt, batch(i))
    checkpoint = roundtrip({"model": first.state_dict(), "opt": opt.state_dict()})
    resumed = Model(seed=9)
    resumed.load_state_dict(checkpoint["model"])
    te.apply_recipe(resumed, DELAYED, example_inputs=batch(0))
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, fused=True)
    opt.load_state_dict(checkpoint["opt"])
    for i in range(2, 4):
        step(resumed, opt, batch(i))
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert straight.body[1].quantizer("input").amax_history.equal(resumed.body[1].quantizer("input").amax_history)


def test_a_checkpoint_of_another_recipe_is_reported_and_its_history_carries_over():
    saved, _ = trained(DELAYED)
    te.apply_recipe(saved, DELAYED)
    state = saved.state_dict()
    model = Model(seed=3)
    te.apply_recipe(model, DELAYED.replace(amax_history_len=4), example_inputs=batch(0))
    with pytest.warns(UserWarning, match="saved under the recipe .*DelayedScaling.*amax_history_len=8.* is loaded "
                                         "into a model whose recipe is .*amax_history_len=4"):
        model.load_state_dict(state)
    history = model.body[1].quantizer("input").amax_history
    assert history.shape == (4,) and torch.equal(history, saved.body[1].quantizer("input").amax_history[:4])
    strict = Model(seed=3)
    te.apply_recipe(strict, CURRENT, example_inputs=batch(0), on_mismatched_load="error")
    with pytest.raises(ValueError, match="is loaded into a model whose recipe is"):
        strict.load_state_dict(state)
    quiet = Model(seed=3)
    te.apply_recipe(quiet, CURRENT, example_inputs=batch(0), on_mismatched_load="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.load_state_dict(state)


def test_a_new_applied_recipe_is_published_once_and_then_hit():
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for recipe in (DELAYED, CURRENT, DELAYED):
        te.apply_recipe(model, recipe, example_inputs=batch(0))
        builds = te.fusion_stats(model).total.builds
        for i in range(3):
            step(model, opt, batch(i))
        assert te.fusion_stats(model).total.builds == builds, "a step after apply_recipe rebuilt"


def test_model_wide_plan_and_stats_name_every_module():
    model = Model()
    te.apply_recipe(model, CURRENT, example_inputs=batch(0), overrides={"head": None})
    model(batch(1))
    text = te.fusion_plan(model)
    assert "body [Sequential] recipe own: Float8CurrentScaling" in text
    assert "head [Linear] recipe pinned: high precision" in text
    assert "tail [Sequential]" in text
    stats = te.fusion_stats(model)
    assert set(stats.by_path) == {"body", "tail", "head"}
    assert stats.total.builds == sum(s.builds for s in stats.by_path.values()) >= 3
    assert stats.by_path["body"].hits >= 1


def test_the_example_probe_runs_plain_modules_and_changes_nothing_else():
    calls = []
    model = Model()
    model.mix.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    te.apply_recipe(model, CURRENT, example_inputs=batch(0, rows=16))
    assert calls == [torch.Size((16, H))]
    assert all(p.grad is None for p in model.parameters())
    assert te.fusion_stats(model).total.hits == 0
