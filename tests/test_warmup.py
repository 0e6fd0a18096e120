"""te.warmup leaves parameters, gradients, scaling state, plans and RNG untouched."""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from te_fuser import recipe as R


def make():
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.Linear(64, 64), te.ops.GELU(), te.ops.Dropout(0.1), te.ops.Linear(64, 64))


def train_step(model, x, recipe, opt, seed=0):
    torch.manual_seed(seed)  # the same dropout mask for both models
    with te.autocast(recipe=recipe):
        y = model(x)
    y.square().mean().backward()
    opt.step()
    return y.detach()


def test_warmup_changes_nothing_the_training_can_see():
    recipe = R.DelayedScaling(amax_history_len=4)
    model, twin = make(), make()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    x = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for m, o in ((model, opt), (twin, twin_opt)):
        train_step(m, x[0], recipe, o)  # grads stay set: warmup must not touch them
    params = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    history = model[0].linear.quantizer("input").amax_history.clone()
    plan_text, stats = model.fusion_plan(), model.fusion_stats()
    torch.manual_seed(1234)
    rng = torch.get_rng_state()

    te.warmup(model, [R.Float8CurrentScaling(), R.MXFP8BlockScaling(), None, recipe], x[1])

    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]) if isinstance(v, torch.Tensor) else True, k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(model[0].linear.quantizer("input").amax_history, history)
    assert model.fusion_plan() == plan_text and model.fusion_stats() == stats
    assert torch.equal(torch.get_rng_state(), rng)
    for i in range(1, 4):
        assert torch.equal(train_step(model, x[i], recipe, opt, i), train_step(twin, x[i], recipe, twin_opt, i))
    assert model.fusion_stats().builds == stats.builds  # no rebuild after the warm-up


def test_warmup_rejects_non_recipes():
    with pytest.raises(TypeError, match="item 1"):
        te.warmup(make(), [None, "mxfp8"], torch.randn(4, 64))


def test_a_fuser_restores_its_plan_and_counters():
    """``OperationFuser.snapshot`` / ``restore``: the plan published then, the
    counters as they were, and the next call under that recipe a hit."""
    import te_fuser as te
    from te_fuser.ops.find import fusers_of

    model = te.ops.Sequential(te.ops.Linear(16, 8), te.ops.GELU())
    x = torch.randn(4, 16)
    delayed = te.recipe.DelayedScaling()
    with te.autocast(recipe=delayed):
        model(x)
    (fuser,) = fusers_of(model)
    snap, op_snaps = fuser.snapshot(), [op.snapshot_quantizers() for op in fuser.ops]
    plan, builds, hits = fuser.plan, fuser.stats.builds, fuser.stats.hits
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        model(x)
    assert fuser.plan is not plan and fuser.stats.builds == builds + 1
    fuser.restore(snap)
    for op, op_snap in zip(fuser.ops, op_snaps):
        op.restore_quantizers(op_snap)
    assert fuser.plan is plan and (fuser.stats.builds, fuser.stats.hits) == (builds, hits)
    assert fuser.stats.key == plan.recipe_key
    with te.autocast(recipe=delayed):
        model(x)
    assert (fuser.stats.builds, fuser.stats.hits) == (builds, hits + 1)  # the restored plan, a hit


def test_warmup_gives_fp8_parameters_their_bytes_back():
    """A plan of another recipe re-casts an FP8 parameter into its layout; te.warmup
    puts the stored bytes, quantizer and master back, and training on is unchanged."""
    from te_fuser.ops.fp8_parameters import master_of
    from te_fuser.quantization.float8_tensor import Float8Tensor

    def fp8_model():
        torch.manual_seed(0)
        with te.quantized_model_init(enabled=True, recipe=R.Float8CurrentScaling()):
            return te.ops.Sequential(te.ops.Linear(64, 64), te.ops.GELU(), te.ops.Linear(64, 64))

    model, twin = fp8_model(), fp8_model()
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    x = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for m, o in ((model, opt), (twin, twin_opt)):
        train_step(m, x[0], R.Float8CurrentScaling(), o)
        o.zero_grad()
    weights = [p for p in model.parameters() if type(p) is Float8Tensor]
    before = [(w.fp8_storage.q, w.fp8_storage.quantizer, master_of(w)) for w in weights]
    assert len(weights) == 2 and all(m is not None for _, _, m in before)
    te.warmup(model, [R.MXFP8BlockScaling(), R.Float8BlockScaling(), None], x[1])
    after = [(w.fp8_storage.q, w.fp8_storage.quantizer, master_of(w)) for w in weights]
    assert all(a[0] is b[0] and a[1] is b[1] and a[2] is b[2] for a, b in zip(after, before))
    for step in (1, 2):
        got = train_step(model, x[step], R.Float8CurrentScaling(), opt)
        want = train_step(twin, x[step], R.Float8CurrentScaling(), twin_opt)
        assert torch.equal(got, want), f"step {step}"


def test_a_switch_to_a_warmed_recipe_matches_no_rule(monkeypatch):
    """The plan templates te.warmup's runs made stay: training's first switch to a
    recipe it ran builds only fresh quantizers, and trains as a model never warmed."""
    from op_testing import record_matches

    current, delayed = R.Float8CurrentScaling(), R.DelayedScaling(amax_history_len=4)
    model, twin = make(), make()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    te.warmup(model, [current, delayed], x)
    matched = record_matches(monkeypatch)
    for recipe in (current, delayed, current):
        assert torch.equal(train_step(model, x, recipe, opt), train_step(twin, x, recipe, twin_opt))
    assert matched.count("forward") == 2  # the twin's first build under each recipe, and none of the model's


@pytest.mark.parametrize("evaluation", [True, False])
def test_an_evaluation_under_a_warmed_recipe_matches_no_rule(monkeypatch, evaluation):
    """With ``evaluation`` (the default) te.warmup also runs each recipe's forward
    without autograd, so a validation pass under it (a plan without a backward)
    matches no fusion rule either; without it, the pass matches once. Either way
    the model evaluates and trains as one never warmed."""
    from op_testing import record_matches

    current, delayed = R.Float8CurrentScaling(), R.DelayedScaling(amax_history_len=4)
    model, twin = make(), make()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    te.warmup(model, [current, delayed], x, evaluation=evaluation)
    matched = record_matches(monkeypatch)
    for recipe in (current, delayed):
        for m in (model, twin):
            m.eval()
            with torch.no_grad(), te.autocast(recipe=recipe):
                out = m(x)
            m.train()
            if m is model:
                evaluated = out
        assert torch.equal(evaluated, out)
        assert torch.equal(train_step(model, x, recipe, opt), train_step(twin, x, recipe, twin_opt))
    # the twin matches each recipe's evaluation and training plans; the model only what warm-up left out
    assert matched.count("forward") == (4 if evaluation else 6), matched
