"""``te.make_graphed``: replayed steps are the eager steps, bit for bit.

Every GPU test trains an eager model and a graphed copy of it side by side on the
same inputs (SGD, several steps, recipe switches, eager steps in between) and
compares outputs, gradients, weights and the delayed-scaling state exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from graph_testing import RECIPES, mlp, needs_gpu, quantizer_state


def _step(model, recipe, x, dy, opt=None, backward=True):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    if backward:
        y.backward(dy)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return y.detach()




def _assert_same(eager, graphed, context):
    for (name, p), (_, q) in zip(eager.named_parameters(), graphed.model.named_parameters()):
        assert torch.equal(p, q), f"{context}: parameter {name} differs"
    se, sg = quantizer_state(eager), quantizer_state(graphed.model)
    assert se.keys() == sg.keys(), context
    for k in se:
        assert (torch.equal(se[k], sg[k]) if isinstance(se[k], torch.Tensor) else se[k] == sg[k]), f"{context}: {k}"


class _Pair:
    """An eager model and a graphed copy, each with its own SGD (``model``: a
    factory of the eager model from the device; 256 features in and out). The
    steps' objective, the output against a random gradient, has no minimum: the
    weights grow every step, faster as they grow, so ``lr`` keeps the outputs
    finite over a test's steps (bit-equality of NaNs says nothing)."""

    def __init__(self, device="cuda", model=mlp, lr=0.01):
        self.eager = model(device)
        self.graphed = te.make_graphed(copy.deepcopy(self.eager))
        self.opt_e = torch.optim.SGD(self.eager.parameters(), lr=lr)
        self.opt_g = torch.optim.SGD(self.graphed.parameters(), lr=lr)
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.device = device

    def step(self, recipe, backward=True, context="", optimize=True):
        x = torch.randn(64, 256, device=self.device, generator=self.gen).bfloat16().requires_grad_()
        dy = torch.randn(64, 256, device=self.device, generator=self.gen).bfloat16()
        x2 = x.detach().clone().requires_grad_()
        # both forwards before either optimizer step: any torch.optim step ends the reuse of
        # kept FP8 weights in the process, so one model's step must not fall between them
        ye = _step(self.eager, recipe, x, dy, None, backward)
        yg = _step(self.graphed, recipe, x2, dy, None, backward)
        if optimize and backward:
            for opt in (self.opt_e, self.opt_g):
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert torch.isfinite(ye).all(), f"{context}: the eager model's output is not finite (the steps diverged)"
        assert torch.equal(ye, yg), f"{context}: output differs"
        if backward:
            assert torch.equal(x.grad, x2.grad), f"{context}: input gradient differs"
        _assert_same(self.eager, self.graphed, context)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="make_graphed\\(model\\)"):
        te.make_graphed(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="warmup_steps"):
        te.make_graphed(te.ops.Sequential(te.ops.Identity()), warmup_steps=0)


def test_cpu_calls_run_the_model_eagerly():
    pair = _Pair(device="cpu")
    for i in range(3):
        pair.step(RECIPES["current"], context=f"cpu step {i}")
    assert pair.graphed.stats.captures == 0 and pair.graphed.stats.eager_steps == 3


@needs_gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_replayed_training_matches_eager_bit_for_bit(recipe_name):
    pair = _Pair()
    for i in range(6):
        pair.step(RECIPES[recipe_name], context=f"{recipe_name} step {i}")
    stats = pair.graphed.stats
    assert (stats.eager_steps, stats.captures, stats.replays) == (1, 1, 5)


def attention_block(device: str) -> te.ops.Sequential:
    """An attention sub-layer at head dim 64 (4 query heads, 2 kv heads, causal): the
    Hopper FP8 forward's under ``fp8_dpa`` and ``fp8_mha`` on an H100 / H200."""
    torch.manual_seed(0)
    return te.ops.Sequential(
        te.ops.LayerNorm(256), te.ops.Linear(256, 512), te.ops.DotProductAttention(4, 64, 2), te.ops.Linear(256, 256)
    ).to(device, torch.bfloat16)


@needs_gpu
def test_fp8_attention_replays_as_it_runs_eagerly_through_switches():
    """The attention kernels captured and replayed (the FP8 forward, its probabilities'
    cast, the backward) train as the eager steps, bit for bit, through switches in and
    out of FP8 attention and its FP8 hand-offs."""
    pair = _Pair(model=attention_block, lr=1e-3)  # at 0.01 its output passes 8000 by step 7 and overflows by step 9
    dpa = te.recipe.DelayedScaling(amax_history_len=4, fp8_dpa=True)
    mha = te.recipe.Float8CurrentScaling(fp8_mha=True)
    schedule = [dpa, dpa, dpa, RECIPES["delayed"], RECIPES["delayed"], mha, mha, mha, dpa, dpa]
    for i, recipe in enumerate(schedule):
        pair.step(recipe, context=f"step {i} ({recipe})")
    assert pair.graphed.stats.captures == 4  # dpa, delayed, mha, dpa again


@needs_gpu
def test_recipe_switches_recapture_and_stay_bit_identical():
    pair = _Pair()
    schedule = ["bf16", "delayed", "delayed", "delayed", "current", "current", "current", "delayed", "delayed"]
    for i, name in enumerate(schedule):
        pair.step(RECIPES[name], context=f"step {i} ({name})")
    assert pair.graphed.stats.captures == 3  # delayed, current, delayed again (bf16 never got a second step)


@needs_gpu
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_gradient_accumulation_reuses_the_fp8_weights_like_eager(recipe_name):
    """Three micro-batches per optimizer step inside te.reuse_quantized_weights():
    the eager model casts each weight once per step, the graphs too (the cached
    pair for micro-batches 2, 3); outside the scope both cast every micro-batch."""
    pair = _Pair()
    for i in range(4):
        with te.reuse_quantized_weights():
            for mb in range(3):
                pair.step(RECIPES[recipe_name], optimize=mb == 2, context=f"step {i} micro-batch {mb}")
    for mb in range(3):
        pair.step(RECIPES[recipe_name], optimize=mb == 2, context=f"outside the scope, micro-batch {mb}")
    stats = pair.graphed.stats
    assert stats.captures == 1 and stats.replays == 14  # all but the first call


@needs_gpu
def test_eager_steps_in_between_and_dropped_outputs_keep_the_state():
    pair = _Pair()
    recipe = RECIPES["delayed"]
    for i in range(3):
        pair.step(recipe, context=f"warm {i}")
    pair.step(recipe, backward=False, context="forward only, output dropped")
    pair.step(recipe, context="after a dropped forward")
    # an eager step on the wrapped model itself, then replays again
    x = torch.randn(64, 256, device="cuda").bfloat16()
    with te.autocast(recipe=recipe):
        pair.eager(x).float().sum().backward()
        pair.graphed.model(x).float().sum().backward()
    pair.opt_e.zero_grad(set_to_none=True)
    pair.opt_g.zero_grad(set_to_none=True)
    for i in range(2):
        pair.step(recipe, context=f"after an eager step {i}")
    with torch.no_grad():
        pair.step(recipe, backward=False, context="no_grad runs eagerly")


@needs_gpu
def test_a_second_forward_before_the_backward_raises():
    pair = _Pair()
    recipe = RECIPES["current"]
    for i in range(2):
        pair.step(recipe, context=f"step {i}")
    x = torch.randn(64, 256, device="cuda").bfloat16().requires_grad_()
    with te.autocast(recipe=recipe):
        y = pair.graphed(x)
        with pytest.raises(RuntimeError, match="before the previous forward's backward"):
            pair.graphed(x)
    y.float().sum().backward()  # the first forward's backward still runs
    assert pair.graphed.stats.replays == 2


@needs_gpu
def test_capture_while_the_previous_steps_graph_is_alive():
    """A training loop keeps the last step's output (and its autograd graph) alive
    into the next call, where the capture happens."""
    eager = mlp("cuda")
    graphed = te.make_graphed(copy.deepcopy(eager))
    recipe = RECIPES["delayed"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    kept = []
    for i in range(4):
        x = torch.randn(64, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
        for model in (eager, graphed):
            with te.autocast(recipe=recipe):
                y = model(x)
            y.backward(torch.ones_like(y))
            kept.append(y)  # every step's graph stays alive
        assert torch.equal(kept[-2], kept[-1]), f"step {i}: output differs"
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert (graphed.stats.captures, graphed.stats.replays) == (1, 3)


@needs_gpu
def test_freezing_a_weight_recaptures_and_stays_bit_identical():
    pair = _Pair()
    recipe = RECIPES["delayed"]
    for i in range(3):
        pair.step(recipe, context=f"step {i}")
    for model in (pair.eager, pair.graphed.model):
        model[1].linear.weight.requires_grad_(False)  # fc1's weight: no gradient is captured for it
    for i in range(3):
        pair.step(recipe, context=f"frozen step {i}")
    assert pair.graphed.stats.captures == 2


@needs_gpu
def test_accumulated_gradients_are_not_overwritten_by_the_next_replay():
    """Only biases and norm weights train: every replay runs the same pair. Autograd
    keeps a returned gradient as ``.grad`` when nobody else holds it, so gradients in
    the graphs' own memory would be overwritten by the next micro-batch's replay."""
    pair = _Pair()
    for model in (pair.eager, pair.graphed.model):
        for op in (model[1], model[3]):
            op.linear.weight.requires_grad_(False)
    recipe = RECIPES["current"]
    for i in range(3):
        for mb in range(3):
            pair.step(recipe, optimize=mb == 2, context=f"step {i} micro-batch {mb}")
    assert pair.graphed.stats.replays >= 6
