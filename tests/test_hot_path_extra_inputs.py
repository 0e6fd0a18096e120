"""Calls with extra inputs (a residual, ``seq(x, x)``) take the guard's decision:
a repeated call runs the published plan without the miss path, a change the
guard sees (a recipe, grad mode, an extra input that requires grad, a replaced
Parameter) is decided afresh, and the results equal the Python path's bit for
bit. A fused group refuses functorch's transforms, as torch refuses an
``autograd.Function`` without ``setup_context``. A backward that needs only
a late extra input's gradient stops where nothing earlier needs one."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser.ops import fuser as fuser_module
from te_fuser.ops import hot_guard

H, F = 32, 64
# the counts of miss-path calls assume a guard (TE_FUSER_HOT_GUARD=0, or no C compiler: every call misses)
needs_guard = pytest.mark.skipif(hot_guard.guard_module() is None, reason="the compiled guard is unavailable")


def residual_mlp(seed: int = 0) -> te.ops.Sequential:
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H),
                             te.ops.AddExtraInput())


def attention_like(seed: int = 0) -> te.ops.Sequential:
    """Two groups around a plain module; the second takes the residual."""
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), torch.nn.Tanh(), te.ops.Linear(H, H),
                             te.ops.AddExtraInput())


def fusers(model):
    return [g for g in model.groups() if isinstance(g, fuser_module.OperationFuser)]


def counting_misses(monkeypatch):
    """The number of calls that reached the fuser's miss path (``OperationFuser.run``)."""
    calls = [0]
    real = fuser_module.OperationFuser.run

    def run(self, *args):
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(fuser_module.OperationFuser, "run", run)
    return calls


def train_step(model, x, recipe):
    xx = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(xx, xx)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [xx.grad.clone()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


@needs_guard
@pytest.mark.parametrize("make", [residual_mlp, attention_like])
@pytest.mark.parametrize("recipe", [None, te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling()],
                         ids=["bf16", "current", "delayed"])
def test_repeated_residual_calls_hit_and_equal_the_python_path(monkeypatch, make, recipe):
    x = torch.randn(2, 8, H)
    model, reference = make(), make()
    misses = counting_misses(monkeypatch)
    for f in fusers(reference):
        f._guard, f.entry = None, f.run  # no guard (as without a C compiler): every call takes the miss path
    expected = [train_step(reference, x, recipe) for _ in range(4)]
    n = len(fusers(model))
    assert misses[0] == 4 * n
    for step, (y_ref, grads_ref) in enumerate(expected):
        before = misses[0]
        y, grads = train_step(model, x, recipe)
        assert torch.equal(y, y_ref), step
        for g, g_ref in zip(grads, grads_ref):
            assert torch.equal(g, g_ref), step
        if step >= 2:  # the first steps build (and a later group's build re-validates an earlier one's plan)
            assert misses[0] == before, step
    assert model.fusion_stats().builds == n


@needs_guard
def test_what_the_guard_sees_is_decided_afresh(monkeypatch):
    model = residual_mlp()
    x = torch.randn(4, H, requires_grad=True)
    misses = counting_misses(monkeypatch)

    def call(x, extra, recipe=None):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return model(x, extra)

    call(x, x)
    call(x, x)
    assert misses[0] == 1
    plain = x.detach()
    call(plain, plain)  # x does not require grad, the parameters do: the same decision
    assert misses[0] == 1
    with torch.no_grad():
        call(x, x)  # no backward
    assert misses[0] == 2
    call(x, x, te.recipe.Float8CurrentScaling())  # another recipe
    assert misses[0] == 3
    model[1].linear.weight = torch.nn.Parameter(model[1].weight.detach().clone())  # a replaced Parameter
    y = call(x, x, te.recipe.Float8CurrentScaling())
    assert misses[0] == 4
    y.sum().backward()
    assert model[1].weight.grad is not None


@needs_guard
def test_an_extra_input_that_requires_grad_needs_a_plan_with_a_backward(monkeypatch):
    model = residual_mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, H)
    misses = counting_misses(monkeypatch)
    model(x, x)
    model(x, x)
    assert misses[0] == 1
    assert not model.groups()[0].plan.needs_backward
    extra = torch.randn(4, H, requires_grad=True)
    y = model(x, extra)  # the guard's check of x and the parameters holds, the extra input's does not
    assert misses[0] == 2
    assert model.groups()[0].plan.needs_backward
    y.sum().backward()  # only the residual's gradient: the ops before it do not run their backward
    assert torch.equal(extra.grad, torch.ones_like(extra))


def test_wrong_extra_input_counts_keep_their_errors():
    model = residual_mlp()
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match="extra input"):
        model(x)
    with pytest.raises(ValueError, match="extra input"):
        model(x, x, x)


@pytest.mark.parametrize("extra", [False, True])
def test_a_fused_group_refuses_functorch_transforms(extra):
    model = residual_mlp() if extra else te.ops.Sequential(te.ops.Linear(H, H))
    x = torch.randn(3, 4, H)
    call = (lambda t: model(t, t)) if extra else model
    call(x[0])  # a published plan and an armed guard: a call under the transform still refuses
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.vmap(call)(x)


@pytest.mark.parametrize("recipe", [None, te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling()],
                         ids=["bf16", "current", "delayed"])
def test_a_frozen_first_layer_trains_the_rest(recipe):
    """Fine-tuning: the input and the first Linear need no gradient, so the backward
    stops after the last op that needs its input's gradient (the GELU's is not
    formed either); the trained layer's gradients are those of the same model
    with nothing frozen."""
    def model():
        torch.manual_seed(0)
        return te.ops.Sequential(te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H))

    x = torch.randn(8, H)
    frozen, full = model(), model()
    for p in frozen[0].parameters():
        p.requires_grad_(False)
    for m in (frozen, full):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = m(x)
        y.float().square().sum().backward()
    assert frozen[0].weight.grad is None
    assert torch.equal(frozen[2].weight.grad, full[2].weight.grad)
    assert torch.equal(frozen[2].bias.grad, full[2].bias.grad)
