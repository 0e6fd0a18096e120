"""``te.make_graphed_step``: a replayed whole training step is the eager step, bit for bit.

Every GPU test trains an eager model and a copy through a graphed step side by
side on the same batches (the optimizer inside the step) and compares losses,
gradients, weights, optimizer state and the delayed-scaling state exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import te_fuser as te
from graph_testing import CUDA, RECIPES, mlp, needs_gpu, quantizer_state


class _Trainer:
    """A model, its optimizer and a step function that runs forward, loss, backward
    and the optimizer step (no zero_grad: a graphed step starts without gradients)."""

    def __init__(self, model, optimizer: str):
        self.model = model
        params = model.parameters()
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            self.opt = torch.optim.Adam(params, lr=1e-3, capturable=optimizer == "adam capturable")

    def step(self, x, target, scale=1.0):
        loss = F.mse_loss(self.model(x).float(), target) * scale
        loss.backward()
        self.opt.step()
        return {"loss": loss, "parts": (loss * 2,)}


def _assert_same(eager: _Trainer, graphed: _Trainer, context: str) -> None:
    for (name, p), (_, q) in zip(eager.model.named_parameters(), graphed.model.named_parameters()):
        assert torch.equal(p, q), f"{context}: parameter {name} differs"
        assert (p.grad is None) == (q.grad is None), f"{context}: gradient of {name}"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{context}: gradient of {name} differs"
    for pe, pg in zip(eager.opt.state.values(), graphed.opt.state.values()):
        for k in pe:
            assert torch.equal(torch.as_tensor(pe[k]).cpu(), torch.as_tensor(pg[k]).cpu()), f"{context}: optimizer {k}"
    se, sg = quantizer_state(eager.model), quantizer_state(graphed.model)
    assert se.keys() == sg.keys(), context
    for k in se:
        assert (torch.equal(se[k], sg[k]) if isinstance(se[k], torch.Tensor) else se[k] == sg[k]), f"{context}: {k}"


class _Pair:
    def __init__(self, device="cuda", optimizer="sgd", warmup_steps=2):
        model = mlp(device)
        self.eager = _Trainer(model, optimizer)
        self.graphed = _Trainer(copy.deepcopy(model), optimizer)
        self.step = te.make_graphed_step(self.graphed.step, self.graphed.model, warmup_steps=warmup_steps)
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.device = device
        self.kept = []  # every returned loss, to check none is overwritten later

    def run(self, recipe, context="", scale=1.0):
        x = torch.randn(64, 256, device=self.device, generator=self.gen).bfloat16()
        target = torch.randn(64, 256, device=self.device, generator=self.gen)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            self.eager.opt.zero_grad(set_to_none=True)
            out_e = self.eager.step(x, target, scale)
            out_g = self.step(x, target, scale)
        assert torch.equal(out_e["loss"], out_g["loss"]), f"{context}: loss differs"
        assert torch.equal(out_e["parts"][0], out_g["parts"][0]), f"{context}: returned tuple differs"
        assert out_g["loss"].grad_fn is None and not out_g["loss"].requires_grad
        self.kept.append((out_e["loss"].detach(), out_g["loss"]))
        _assert_same(self.eager, self.graphed, context)

    def check_kept(self):
        for i, (e, g) in enumerate(self.kept):
            assert torch.equal(e, g), f"returned loss of call {i} changed afterwards"


def test_bad_arguments_are_named():
    model = mlp("cpu")
    with pytest.raises(TypeError, match="make_graphed_step\\(step\\)"):
        te.make_graphed_step(3, model)
    with pytest.raises(TypeError, match="make_graphed_step\\(model\\)"):
        te.make_graphed_step(lambda: None, [model])
    with pytest.raises(ValueError, match="warmup_steps"):
        te.make_graphed_step(lambda: None, model, warmup_steps=0)
    step = te.make_graphed_step(lambda x, opts: None, model)
    with pytest.raises(TypeError, match="hashable, got list"):
        step(torch.zeros(2, device="cuda" if CUDA else "cpu"), [1, 2])


def test_cpu_steps_run_eagerly_and_each_starts_without_gradients():
    pair = _Pair(device="cpu")
    for i in range(3):
        pair.run(RECIPES["current"], context=f"cpu step {i}")
    stats = pair.step.stats
    assert (stats.eager_steps, stats.captures, stats.replays) == (3, 0, 0)


@needs_gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_replayed_steps_match_eager_bit_for_bit(recipe_name):
    pair = _Pair()
    for i in range(7):
        pair.run(RECIPES[recipe_name], context=f"{recipe_name} step {i}")
    pair.check_kept()
    stats = pair.step.stats
    assert (stats.eager_steps, stats.captures, stats.replays) == (2, 1, 5)


@needs_gpu
def test_adam_with_its_state_on_the_gpu():
    pair = _Pair(optimizer="adam capturable")
    for i in range(5):
        pair.run(RECIPES["delayed"], context=f"adam step {i}")
    assert pair.step.stats.replays == 3


@needs_gpu
def test_recipe_and_argument_changes_recapture_and_stay_bit_identical():
    pair = _Pair(warmup_steps=1)
    schedule = ["delayed", "delayed", "delayed", "current", "current", "current", "bf16", "delayed", "delayed"]
    for i, name in enumerate(schedule):
        pair.run(RECIPES[name], context=f"step {i} ({name})")
    pair.run(RECIPES["delayed"], context="a new non-tensor argument", scale=0.5)
    pair.run(RECIPES["delayed"], context="captured under it", scale=0.5)
    pair.check_kept()
    # delayed, current, delayed again, delayed with scale 0.5 (bf16 never got a second step)
    assert pair.step.stats.captures == 4


@needs_gpu
def test_an_uncapturable_step_is_refused_and_leaves_the_model_as_it_was():
    pair = _Pair(optimizer="adam")  # Adam keeps its step count on the host unless capturable=True
    recipe = RECIPES["delayed"]
    for i in range(2):
        pair.run(recipe, context=f"eager step {i}")
    before = {n: p.detach().clone() for n, p in pair.graphed.model.named_parameters()}
    grads = [p.grad for p in pair.graphed.model.parameters()]
    state = quantizer_state(pair.graphed.model)
    x = torch.randn(64, 256, device="cuda").bfloat16()
    with te.autocast(recipe=recipe), pytest.raises(RuntimeError, match="could not be captured.*capturable=True"):
        pair.step(x, torch.randn(64, 256, device="cuda"), 1.0)  # the key of the eager steps
    for n, p in pair.graphed.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(p.grad is g for p, g in zip(pair.graphed.model.parameters(), grads))
    after = quantizer_state(pair.graphed.model)
    assert all(torch.equal(state[k], after[k]) if isinstance(state[k], torch.Tensor) else state[k] == after[k]
               for k in state)


@needs_gpu
def test_replaced_parameter_storage_recaptures():
    pair = _Pair(warmup_steps=1)
    recipe = RECIPES["current"]
    for i in range(3):
        pair.run(recipe, context=f"step {i}")
    with torch.no_grad():
        for trainer in (pair.eager, pair.graphed):
            w = trainer.model[1].weight
            w.data = w.data.clone()  # new storage: the graph's reads would be stale
    for i in range(3):
        pair.run(recipe, context=f"after the swap, step {i}")
    assert pair.step.stats.captures == 2


@needs_gpu
def test_frozen_weight_written_in_place_is_read_by_the_replays():
    """The graph casts every weight on every replay, a frozen one too: a write to
    it is seen without a new capture."""
    pair = _Pair(warmup_steps=1)
    for trainer in (pair.eager, pair.graphed):
        trainer.model[1].weight.requires_grad_(False)
    recipe = RECIPES["delayed"]
    for i in range(3):
        pair.run(recipe, context=f"step {i}")
    with torch.no_grad():
        for trainer in (pair.eager, pair.graphed):
            trainer.model[1].weight.mul_(0.5)
    for i in range(2):
        pair.run(recipe, context=f"after the frozen weight changed, step {i}")
    assert pair.step.stats.captures == 1


@needs_gpu
def test_the_model_called_directly_between_steps_sees_the_replayed_updates():
    """Replays write the weights without autograd: an evaluation forward through the
    model itself must not reuse an FP8 weight cached before them."""
    pair = _Pair(warmup_steps=1)
    recipe = RECIPES["delayed"]
    x = torch.randn(64, 256, device="cuda").bfloat16()
    for i in range(6):
        pair.run(recipe, context=f"step {i}")
        if i % 2:
            with te.autocast(recipe=recipe), torch.no_grad():
                ye, yg = pair.eager.model(x), pair.graphed.model(x)
            assert torch.equal(ye, yg), f"evaluation after step {i} differs"
            _assert_same(pair.eager, pair.graphed, f"after the evaluation at step {i}")
    assert pair.step.stats.captures == 1 and pair.step.stats.replays == 5


@needs_gpu
def test_a_step_that_runs_ops_outside_its_model_is_refused():
    """Their scaling state would not be carried from replay to replay."""
    pair = _Pair(warmup_steps=1)
    other = te.ops.Sequential(te.ops.Linear(256, 256, name="outsider")).to("cuda", torch.bfloat16)

    def step(x, target, scale):
        loss = F.mse_loss(other(pair.graphed.model(x)).float(), target) * scale
        loss.backward()
        return loss

    graphed = te.make_graphed_step(step, pair.graphed.model, warmup_steps=1)
    x, target = torch.randn(64, 256, device="cuda").bfloat16(), torch.randn(64, 256, device="cuda")
    with te.autocast(recipe=RECIPES["delayed"]):
        graphed(x, target, 1.0)
        with pytest.raises(RuntimeError, match="not in its model.*outsider"):
            graphed(x, target, 1.0)
    graphed = te.make_graphed_step(step, torch.nn.ModuleList([pair.graphed.model, other]), warmup_steps=1)
    with te.autocast(recipe=RECIPES["delayed"]):
        for _ in range(3):
            graphed(x, target, 1.0)
    assert graphed.stats.replays == 2


@needs_gpu
def test_torch_autocast_and_grad_mode_are_part_of_the_key():
    model = te.ops.Sequential(te.ops.Linear(64, 64)).cuda()  # fp32 parameters
    seen = []

    def step(x):
        y = model(x)
        seen.append(y.dtype)  # runs at eager steps and the capture only
        y.float().sum().backward()
        return y

    graphed = te.make_graphed_step(step, model, warmup_steps=1)
    x = torch.randn(32, 64, device="cuda")
    with te.autocast(recipe=RECIPES["current"]):
        for _ in range(3):
            assert graphed(x).dtype == torch.float32
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                assert graphed(x).dtype == torch.bfloat16
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert graphed.stats.captures == 2 and graphed.stats.replays == 4
