"""Ops read their parameters live and their modules' hooks fire.

A Parameter replaced at any time (late weight tying, ``load_state_dict(assign=True)``,
a wrapper that swaps parameters) is the one that computes and the one that
trains; a pruned or parametrized weight computes as its module gives it at each
call and trains what stands behind it; forward hooks of the ops inside a
``Sequential`` run around their fused group, on the compiled hot path's models as
on the Python path's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import te_fuser as te
from te_fuser import recipe as R

H = 32
RECIPES = {"none": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling()}


def call(model, x, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        return model(x)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_parameter_replaced_after_the_first_forward_is_used_and_trained(recipe_name):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))
    x = torch.randn(16, H)
    call(model, x, recipe).sum().backward()  # warm: the plan (and the compiled guard) exist
    new = nn.Parameter(torch.randn(H, H) * 0.1)
    model[2].linear.weight = new
    twin = te.ops.Sequential(te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))
    twin.load_state_dict(model.state_dict())
    model.zero_grad(set_to_none=True)
    y = call(model, x, recipe)
    assert torch.equal(y, call(twin, x, recipe)), "the replaced weight did not compute"
    y.sum().backward()
    assert new.grad is not None and new.grad.abs().sum() > 0, "the replaced weight did not train"


def test_late_weight_tying_trains_the_shared_parameter():
    """An LM head tied to the embedding after the model ran once."""
    torch.manual_seed(0)
    emb = nn.Embedding(64, H)
    head = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 64, bias=False))
    tokens = torch.randint(0, 64, (8, 4))
    head(emb(tokens)).sum().backward()
    head[1].linear.weight = emb.weight  # tie now
    emb.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-2, fused=True)
    before = emb.weight.detach().clone()
    logits = head(emb(tokens))
    expected = torch.nn.functional.linear(torch.nn.functional.layer_norm(emb(tokens), (H,)), emb.weight)
    torch.testing.assert_close(logits, expected)
    logits.logsumexp(-1).mean().backward()
    assert emb.weight.grad is not None
    opt.step()
    assert not torch.equal(emb.weight, before)
    torch.testing.assert_close(head(emb(tokens)),
                               torch.nn.functional.linear(torch.nn.functional.layer_norm(emb(tokens), (H,)),
                                                          emb.weight))


def test_assign_load_then_a_new_optimizer_trains_the_loaded_parameters():
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(H, H))
    x = torch.randn(8, H)
    call(model, x, RECIPES["current"]).sum().backward()
    old = model[0].weight
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items() if k.endswith(("weight", "bias"))}
    start = loaded["0.weight"].clone()
    model.load_state_dict(loaded, strict=False, assign=True)
    assert model[0].weight is not old and torch.equal(model[0].weight, start)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.zero_grad(set_to_none=True)
    call(model, x, None).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, start), "the loaded weight did not train"
    with torch.no_grad():
        expected = x @ model[0].weight.T + model[0].bias
    torch.testing.assert_close(call(model, x, None), expected)


class _Recorder:
    def __init__(self):
        self.calls = []

    def pre(self, name):
        def hook(module, args):
            self.calls.append(("pre", name, tuple(args[0].shape)))
        return hook

    def post(self, name):
        def hook(module, args, output):
            self.calls.append(("post", name, tuple(output.shape)))
        return hook


@pytest.mark.parametrize("recipe_name", ["none", "current"])
def test_forward_hooks_of_ops_in_a_sequential_fire_around_their_group(recipe_name):
    recipe = RECIPES[recipe_name]
    model = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 2 * H), te.ops.GELU(),
                              te.ops.Linear(2 * H, H))
    x = torch.randn(4, H)
    call(model, x, recipe)  # warm first: hooks registered later must still be seen
    rec = _Recorder()
    handles = [model[0].register_forward_pre_hook(rec.pre("norm")),
               model[1].register_forward_pre_hook(rec.pre("fc1")),
               model[1].linear.register_forward_hook(rec.post("fc1.linear")),
               model[3].register_forward_hook(rec.post("fc2"))]
    for _ in range(2):
        call(model, x, recipe)
    assert rec.calls == [("pre", "norm", (4, H)), ("pre", "fc1", (4, H)),
                         ("post", "fc1.linear", (4, H)), ("post", "fc2", (4, H))] * 2
    for h in handles:
        h.remove()
    rec.calls.clear()
    call(model, x, recipe)
    assert rec.calls == []


def test_hooks_may_replace_the_input_and_the_output():
    model = te.ops.Sequential(te.ops.Linear(H, H))
    x = torch.randn(4, H)
    expected = model(x * 2) + 1
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[0].linear.register_forward_hook(lambda m, args, out: out + 1)
    torch.testing.assert_close(model(x), expected)


def test_hooks_of_an_op_called_on_its_own_fire_once():
    op = te.ops.Linear(H, H)
    calls = []
    op.register_forward_pre_hook(lambda m, a: calls.append("linear"))
    op.linear.register_forward_pre_hook(lambda m, a: calls.append("basic"))
    bias_op = te.ops.Bias(H)
    bias_op.register_forward_pre_hook(lambda m, a: calls.append("bias"))
    op(torch.randn(2, H))
    bias_op(torch.randn(2, H))
    assert calls == ["linear", "basic", "bias"]


def test_global_module_hooks_see_the_ops():
    """torch's global hooks (module trackers, FLOP counters) fire for ops in a group."""
    model = te.ops.Sequential(te.ops.Linear(H, H), te.ops.ReLU())
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.append(type(m).__name__))
    try:
        model(torch.randn(2, H))
    finally:
        handle.remove()
    assert seen == ["Sequential", "Linear", "BasicLinear", "Bias", "ReLU"]


def test_a_module_backward_hook_inside_a_group_is_refused():
    model = te.ops.Sequential(te.ops.Linear(H, H), te.ops.ReLU())
    model[1].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match="ReLU has module backward hooks.*register them on the Sequential"):
        model(torch.randn(2, H))


# -- pruned and parametrized weights (torch.nn.utils.prune / parametrize) --------------

def _model():
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))


def _steps(model, opt, recipe, steps, before_step=lambda: None, seed=1):
    """``steps`` AdamW steps on fixed data; the losses."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, H, generator=gen)
        loss = call(model, x, recipe).float().square().mean()
        loss.backward()
        before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("when", ["before", "after"], ids=["pruned_before_the_first_forward", "pruned_after"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_pruned_weight_trains_as_a_weight_held_at_zero_where_pruned(recipe_name, when):
    """``torch.nn.utils.prune`` on a Linear's weight (before the group ever ran, or
    after its plan and guard exist): the op computes with ``weight_orig · mask``
    read fresh every call, and ``weight_orig`` receives the masked gradient, so three
    AdamW steps give the losses and effective weight of a twin whose pruned entries
    are zeroed and whose gradient is masked, bit for bit (a stale weight, or the
    unmasked gradient, would not)."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(5)
    model = _model()
    mask = (torch.rand(H, H) > 0.5).float()
    twin = _model()
    twin.load_state_dict(model.state_dict())
    if when == "after":
        x = torch.randn(16, H)
        for m in (model, twin):
            call(m, x, recipe).sum().backward()
            m.zero_grad(set_to_none=True)
    torch.nn.utils.prune.custom_from_mask(model[1].linear, "weight", mask)
    with torch.no_grad():
        twin[1].linear.weight.mul_(mask)
    twin[1].linear.weight.register_hook(lambda g: g * mask)
    got = _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, 3)
    want = _steps(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), recipe, 3)
    assert torch.equal(got, want)
    assert torch.equal(model[1].linear.weight_orig * mask, twin[1].linear.weight)


class _LowRank(nn.Module):
    """A LoRA-like reparametrization: W + B A."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(rank, H) * 0.1)
        self.b = nn.Parameter(torch.randn(H, rank) * 0.1)

    def forward(self, w):
        return w + self.b @ self.a


def _low_rank(linear):
    torch.nn.utils.parametrize.register_parametrization(linear, "weight", _LowRank())
    linear.parametrizations.weight.original.requires_grad_(False)  # frozen: only the low-rank factors train


def _weight_norm(linear):
    torch.nn.utils.parametrizations.weight_norm(linear, "weight")


@pytest.mark.parametrize("kind", [_low_rank, _weight_norm], ids=["low_rank", "weight_norm"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_parametrized_weight_trains_its_parametrization(recipe_name, kind):
    """``torch.nn.utils.parametrize`` on a Linear's weight (a frozen weight with
    trained low-rank factors; weight_norm): every call computes with the
    parametrization evaluated then, and the weight's gradient reaches the
    parametrization's parameters through it. Three AdamW steps give the losses and
    parameters of a twin run as a plain te model whose weight is set to the
    parametrization's value before each step, its gradient pushed through a copy of
    the parametrization, bit for bit."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(6)
    model = _model()
    twin = _model()
    twin.load_state_dict(model.state_dict())
    kind(model[1].linear)
    holder = te.ops.BasicLinear(H, H)  # the twin's parametrization, evaluated beside it
    holder.load_state_dict({"weight": twin[1].linear.weight.detach()})
    kind(holder)
    holder.load_state_dict(model[1].linear.state_dict())
    twin[1].linear.weight.requires_grad_(False)
    trained = dict(model.named_parameters())
    theirs = {**{n: p for n, p in twin.named_parameters() if n != "1.linear.weight"},
              **{"1.linear." + n: p for n, p in holder.named_parameters()}}
    assert sorted(trained) == sorted(theirs)
    opt = torch.optim.AdamW([trained[n] for n in sorted(trained)], lr=1e-2)
    opt_twin = torch.optim.AdamW([theirs[n] for n in sorted(theirs)], lr=1e-2)
    got = _steps(model, opt, recipe, 3)
    gen = torch.Generator().manual_seed(1)
    want = []
    for _ in range(3):
        w = holder.weight
        with torch.no_grad():
            twin[1].linear.weight.copy_(w)
        twin[1].linear.weight.requires_grad_(True)
        loss = call(twin, torch.randn(16, H, generator=gen), recipe).float().square().mean()
        loss.backward()
        w.backward(twin[1].linear.weight.grad)
        twin[1].linear.weight.grad = None
        twin[1].linear.weight.requires_grad_(False)
        opt_twin.step()
        opt_twin.zero_grad(set_to_none=True)
        want.append(loss.detach())
    assert torch.equal(got, torch.stack(want))
    for name in trained:
        assert torch.equal(trained[name], theirs[name]), name
