"""``te.checkpoint``: activation checkpointing of te_fuser ops, as users train with it.

Training with a region checkpointed must be training without it, bit for bit
(parameters, losses, delayed-scaling state) under every recipe and across recipe
switches; the region's saved tensors must really be dropped and rebuilt; the
recomputation must run the forward's plan whatever te.autocast is in force when
the backward runs."""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES
from te_fuser.models.gpt import GPT, GPTConfig
from te_fuser.quantization import DelayedScalingQuantizer
from te_fuser.quantization.tensor import QuantizedTensor

H, F = 64, 256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Block(torch.nn.Module):
    """A pre-norm MLP sub-layer with its residual (``seq(x, x)``), twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H),
                              te.ops.AddExtraInput()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, x)
        return x


class _Model(torch.nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.block = _Block()
        self.head = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H))
        self.checkpointed = checkpointed

    def forward(self, x):
        x = te.checkpoint(self.block, x) if self.checkpointed else self.block(x)
        return self.head(x)


def _delayed_state(model) -> list:
    out = []
    for module in model.modules():
        for q in getattr(module, "installed_quantizers", {}).values():
            if isinstance(q, DelayedScalingQuantizer):
                out.append((q.amax_history.clone(), q.scale.clone(), q.nonfinite_amax_count.clone()))
    return out


def _train(model, schedule, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for recipe, steps in schedule:
        for _ in range(steps):
            x = torch.randn(64, H, generator=gen).to(DEVICE).requires_grad_()
            with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            loss = y.float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return torch.stack(losses)


def _assert_trains_as_kept(model_class, schedule, seed: int):
    """A ``model_class(checkpointed=False)`` and its copy run checkpointed, trained
    through ``schedule``: the same losses, parameters and delayed-scaling state, bit
    for bit; returns the two models."""
    torch.manual_seed(seed)
    kept = model_class(False).to(DEVICE)
    recomputed = copy.deepcopy(kept)
    recomputed.checkpointed = True
    assert torch.equal(_train(kept, schedule), _train(recomputed, schedule))
    for p, q in zip(kept.parameters(), recomputed.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_delayed_state(kept), _delayed_state(recomputed), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    return kept, recomputed


@pytest.mark.parametrize("name", ["none", "delayed", "current", "mxfp8", "block", "rowwise"])
def test_a_checkpointed_region_trains_as_the_same_region_kept(name):
    """Four steps of AdamW on a residual MLP block (the fusers' extra inputs too):
    the losses, the parameters and every delayed-scaling history, scale and count
    are those of the run that keeps the activations, bit for bit; no re-fusion is
    added."""
    kept, recomputed = _assert_trains_as_kept(_Model, [(RECIPES[name], 4)], seed=0)
    assert te.fusion_stats(recomputed).total.builds == te.fusion_stats(kept).total.builds


class _DerivedWeights(_Model):
    """The model with a weight-normed and a pruned Linear in its checkpointed block."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__(checkpointed)
        torch.nn.utils.parametrizations.weight_norm(self.block.layers[0][1].linear, "weight")
        mask = (torch.arange(F)[None, :] % 3 > 0).float().expand(H, F).clone()
        torch.nn.utils.prune.custom_from_mask(self.block.layers[1][3].linear, "weight", mask)


@pytest.mark.parametrize("name", ["none", "delayed", "current"])
def test_a_region_with_parametrized_and_pruned_weights_trains_as_kept(name):
    """A checkpointed block whose weights are read through a parametrization and a
    pruning mask: the recomputation reads them as the forward did (the forward saves
    no more tensors than the recomputation), and four steps give the kept run's
    losses, parameters and scaling state, bit for bit. (Built twice from one seed: a
    pruned module, its weight not a leaf, cannot be deep-copied.)"""
    models = []
    for checkpointed in (False, True):
        torch.manual_seed(3)
        models.append(_DerivedWeights(checkpointed).to(DEVICE))
    kept, recomputed = models
    schedule = [(RECIPES[name], 4)]
    assert torch.equal(_train(kept, schedule), _train(recomputed, schedule))
    for p, q in zip(kept.parameters(), recomputed.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(_delayed_state(kept), _delayed_state(recomputed), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_switching_recipes_with_a_checkpointed_region_is_bit_identical():
    """bf16 -> delayed -> current -> block -> delayed -> bf16, the region
    checkpointed throughout: every loss and the final delayed-scaling state are the
    kept run's (delayed scaling entered twice: seeded in a recorded forward once,
    then continued)."""
    schedule = [(None, 2), (RECIPES["delayed"], 3), (RECIPES["current"], 2), (RECIPES["block"], 2),
                (RECIPES["delayed"], 2), (None, 1)]
    _assert_trains_as_kept(_Model, schedule, seed=1)


def test_the_gpt_trains_alike_with_every_block_checkpointed():
    """The yardstick GPT (te attention, rotary, FP8 attention under fp8_mha) at its
    smoke size, every block recomputed (``GPTConfig(checkpoint=True)``), through a
    schedule of recipes: the same loss bits as keeping the activations."""
    schedule = [(None, 2), (RECIPES["delayed"], 2), (RECIPES["delayed_mha"], 2), (RECIPES["current"], 2),
                (RECIPES["current_mha"], 2), (None, 1)]
    runs = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        config = GPTConfig.smoke().replace(n_layer=2, seq_len=32, batch_size=2, checkpoint=checkpoint)
        model = GPT(config, device=DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for recipe, steps in schedule:
            for _ in range(steps):
                idx = torch.randint(0, 256, (config.batch_size, config.seq_len + 1), generator=gen).to(DEVICE)
                with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(enabled=recipe is not None,
                                                                                 recipe=recipe):
                    logits = model(idx[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
        runs.append((torch.stack(losses), model.refusions()))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def _tensors_in(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (tuple, list)):
        return sum(_tensors_in(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensors_in(v) for v in value.values())
    if isinstance(value, QuantizedTensor):
        return sum(_tensors_in(op.data) + _tensors_in(op.scale_inv)
                   for op in (value.rowwise, value.columnwise) if op is not None)
    return 0


def _saved_tensors_held(y) -> int:
    """Tensors held in the op contexts of ``y``'s fuser node (not through autograd)."""
    fuser_state = y.grad_fn.state
    return sum(_tensors_in(v) for ctx in fuser_state[2] for v in ctx.saved.values())


@pytest.mark.parametrize("name", ["none", "delayed", "current"])
def test_the_region_drops_what_its_ops_saved_and_recomputes_it_once(name):
    """Inside te.checkpoint the ops' saved tensors (FP8 copies included) go to
    autograd, which drops them: the fuser's node holds none after the forward, the
    forward runs again once in the backward. Without it the node holds them."""
    recipe = RECIPES[name]
    seq = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H)).to(DEVICE)
    calls = []
    seq.register_forward_pre_hook(lambda module, args: calls.append(1))
    x = torch.randn(32, H, device=DEVICE, requires_grad=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        kept = seq(x)
        recomputed = te.checkpoint(seq, x)
    assert _saved_tensors_held(kept) > 0
    assert _saved_tensors_held(recomputed) == 0
    assert len(calls) == 2
    recomputed.sum().backward()
    assert len(calls) == 3


def test_the_recomputation_runs_the_forwards_recipe_whatever_is_in_force_in_the_backward():
    """The backward runs outside te.autocast, then inside another recipe's region:
    the recomputation still runs the forward's plan (no plan built, the published
    one unchanged) and the gradients are the kept run's."""
    torch.manual_seed(2)
    seq = te.ops.Sequential(te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H)).to(DEVICE)
    twin = copy.deepcopy(seq)
    x = torch.randn(32, H, device=DEVICE)
    recipe = RECIPES["delayed"]
    for backward_under in (None, RECIPES["current"]):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ya = seq(xa)
            yb = te.checkpoint(twin, xb)
        builds = twin.fusion_stats().builds
        with te.autocast(enabled=backward_under is not None, recipe=backward_under):
            ya.sum().backward()
            yb.sum().backward()
        assert twin.fusion_stats().builds == builds
        assert twin.fusion_plan().groups[0].recipe_key == str(recipe)
        assert torch.equal(xa.grad, xb.grad)
        for p, q in zip(seq.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


class _Nested(torch.nn.Module):
    """A checkpointed region holding two checkpointed blocks and a plain one."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.checkpointed = checkpointed

    def inner(self, x):
        x = te.checkpoint(self.blocks[0], x) if self.checkpointed else self.blocks[0](x)
        x = self.blocks[1](x)
        return te.checkpoint(self.blocks[2], x) if self.checkpointed else self.blocks[2](x)

    def forward(self, x):
        return te.checkpoint(self.inner, x) if self.checkpointed else self.inner(x)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_nested_checkpointed_regions_train_alike(name):
    """Regions inside a checkpointed region: recomputing the outer one runs the inner
    ones' forwards again (their scales noted afresh for their own recomputation);
    losses, parameters and delayed-scaling state as without any checkpoint."""
    _assert_trains_as_kept(_Nested, [(RECIPES[name], 3)], seed=4)


def test_retain_graph_backs_a_checkpointed_region_twice():
    seq = te.ops.Sequential(te.ops.Linear(H, H)).to(DEVICE)
    twin = copy.deepcopy(seq)
    x = torch.randn(16, H, device=DEVICE)
    with te.autocast(recipe=RECIPES["current"]):
        ya, yb = seq(x.clone().requires_grad_()), te.checkpoint(twin, x.clone().requires_grad_())
    for _ in range(2):
        ya.sum().backward(retain_graph=True)
        yb.sum().backward(retain_graph=True)
    assert torch.equal(seq[0].weight.grad, twin[0].weight.grad)


def test_unsupported_arguments_are_named():
    seq = te.ops.Sequential(te.ops.Linear(H, H))
    x = torch.randn(4, H, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        te.checkpoint(seq, x, use_reentrant=True)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        te.checkpoint(seq, x, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="context_fn"):
        te.checkpoint(seq, x, context_fn=None)


@pytest.mark.skipif(DEVICE != "cuda", reason="memory: on the GPU")
def test_a_checkpointed_block_keeps_less_memory_until_its_backward():
    """The activation memory a checkpointed region holds between its forward and
    backward is its input's, not its layers' (FP8 recipe, 8k tokens)."""
    torch.manual_seed(3)
    block = _Block().to(DEVICE)
    x = torch.randn(8192, H, device=DEVICE, requires_grad=True)
    held = {}
    for checkpointed in (False, True):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(recipe=RECIPES["current"]):
            y = te.checkpoint(block, x) if checkpointed else block(x)
        held[checkpointed] = torch.cuda.memory_allocated() - before
        y.float().sum().backward()
        del y
    assert held[True] < held[False] / 3, held


def test_under_torch_compile_a_checkpointed_region_runs_eagerly_or_names_the_way():
    """torch.compile of a model that calls te.checkpoint: the region breaks the graph
    and runs eagerly (the gradients of the uncompiled run); with fullgraph=True the
    error says to checkpoint the compiled function instead, which trains alike."""
    torch.manual_seed(5)
    seq = te.ops.Sequential(te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))
    twins = [copy.deepcopy(seq) for _ in range(2)]
    x = torch.randn(32, H)
    recipe = RECIPES["delayed"]

    def step(fn, model):
        xx = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = fn(xx)
        y.sum().backward()
        return [p.grad for p in model.parameters()]

    want = step(seq, seq)
    torch._dynamo.reset()
    got = step(torch.compile(lambda t: te.checkpoint(twins[0], t)), twins[0])
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="te.checkpoint inside a function that torch.compile traces"):
        step(torch.compile(lambda t: te.checkpoint(twins[1], t), fullgraph=True), twins[1])
    torch._dynamo.reset()
    for p in twins[1].parameters():
        p.grad = None
    got = step(lambda t: te.checkpoint(torch.compile(twins[1]), t), twins[1])
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_torch_checkpoint_on_te_ops_warns_once_and_names_te_checkpoint(monkeypatch):
    """torch.utils.checkpoint (or any saved-tensor hook) on te ops directly: the
    gradients are right, and one warning per process says the hooks do not see the
    ops' saved tensors and to call te.checkpoint; te.checkpoint itself warns nothing."""
    from te_fuser.ops import fuser as fuser_module

    monkeypatch.setattr(fuser_module, "_HOOKS_WARNED", [])
    seq = te.ops.Sequential(te.ops.Linear(H, H), te.ops.GELU())
    x = torch.randn(8, H, requires_grad=True)
    with pytest.warns(UserWarning, match=r"outside te.checkpoint.*call te.checkpoint\(function, \*args\)"):
        torch.utils.checkpoint.checkpoint(seq, x, use_reentrant=False).sum().backward()
    want = x.grad.clone()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.utils.checkpoint.checkpoint(seq, x, use_reentrant=False)  # once a process
        monkeypatch.setattr(fuser_module, "_HOOKS_WARNED", [])
        x.grad = None
        te.checkpoint(seq, x).sum().backward()
    assert torch.equal(x.grad, want)


class _ReentrantCheckpointed(_Model):
    """The model with its block under torch's reentrant checkpoint (the habit of
    older training code and of libraries that default to it)."""

    def forward(self, x):
        if self.checkpointed:
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        else:
            x = self.block(x)
        return self.head(x)


def test_torch_reentrant_checkpoint_without_fp8_trains_as_the_same_region_kept():
    """Without an FP8 recipe the reentrant checkpoint's recomputation runs the plan its
    forward ran: four steps of AdamW give the kept run's losses and parameters, bit
    for bit."""
    _assert_trains_as_kept(_ReentrantCheckpointed, [(None, 4)], seed=2)


@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8"])
def test_torch_reentrant_checkpoint_under_fp8_is_refused_before_anything_changes(name):
    """Under an FP8 recipe the reentrant checkpoint's forward is refused at its first
    te op, naming the checkpoint and te.checkpoint, before any cast: once where the
    group has no plan for a forward without autograd (a miss), once where a forward
    under no_grad published and armed one (a hit). The scaling state is as it was,
    and steps without the checkpoint then train as a twin that never met it."""
    torch.manual_seed(3)
    refused = _ReentrantCheckpointed(False).to(DEVICE)
    twin = copy.deepcopy(refused)
    recipe = RECIPES[name]
    for model in (refused, twin):
        _train(model, [(recipe, 1)])
    x = torch.randn(64, H).to(DEVICE).requires_grad_()
    refusal = r"LayerNorm.*torch.utils.checkpoint.checkpoint\(\.\.\., use_reentrant=True\) under an FP8 recipe.*te.checkpoint"
    for armed in (False, True):
        if armed:
            for model in (refused, twin):
                with torch.no_grad(), te.autocast(recipe=recipe):
                    model.block(x)
        before = _delayed_state(refused)
        refused.checkpointed = True
        with pytest.raises(RuntimeError, match=refusal), te.autocast(recipe=recipe):
            refused(x)
        refused.checkpointed = False
        for a, b in zip(before, _delayed_state(refused), strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(_train(refused, [(recipe, 2)], seed=4), _train(twin, [(recipe, 2)], seed=4))
    for p, q in zip(refused.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_another_librarys_reentrant_checkpoint_is_named_and_no_grad_around_a_leaf_is_not_refused():
    """A reentrant checkpoint of another library (an autograd.Function whose name
    says checkpoint, as DeepSpeed's and Megatron's do) is refused by its name; a
    forward under no_grad whose input requires grad, outside any checkpoint, runs."""

    class CheckpointFunction(torch.autograd.Function):  # the shape of DeepSpeed's and Megatron's
        @staticmethod
        def forward(ctx, run_function, *args):
            ctx.run_function = run_function
            ctx.save_for_backward(*args)
            with torch.no_grad():
                return run_function(*args)

        @staticmethod
        def backward(ctx, *grads):
            raise AssertionError("not reached")

    seq = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H)).to(DEVICE)
    x = torch.randn(8, H).to(DEVICE).requires_grad_()
    with te.autocast(recipe=RECIPES["current"]):
        with pytest.raises(RuntimeError, match=r"runs inside CheckpointFunction under an FP8 recipe"):
            CheckpointFunction.apply(seq, x)
        with torch.no_grad():
            y = seq(x)
    assert not y.requires_grad


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_gradient_accumulation_with_kept_weight_casts_trains_alike_checkpointed(name):
    """Three micro-batches a step inside te.reuse_quantized_weights() (the weights
    cast once a step and reused), each through te.checkpoint: the recomputations
    reuse the kept casts as their forwards did; three steps of AdamW give the
    weights of the run that keeps its activations, bit for bit."""
    torch.manual_seed(6)
    seq = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H)).to(DEVICE)
    twin = copy.deepcopy(seq)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (seq, twin)]
    gen = torch.Generator().manual_seed(7)
    recipe = RECIPES[name]
    for _ in range(3):
        micro = [torch.randn(32, H, generator=gen).to(DEVICE) for _ in range(3)]
        for model, opt, checkpointed in ((seq, opts[0], False), (twin, opts[1], True)):
            with te.reuse_quantized_weights():
                for x in micro:
                    x = x.clone().requires_grad_()
                    with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(recipe=recipe):
                        y = te.checkpoint(model, x) if checkpointed else model(x)
                    y.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(seq.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_delayed_state(seq), _delayed_state(twin), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_checkpointed_model_resumes_from_its_state_dict_with_an_evaluation_between():
    """Delayed scaling, the region checkpointed: two steps, an evaluation pass without
    FP8, a state_dict saved (model and AdamW) and loaded into a fresh model, two more
    steps; the losses, weights and scaling state are those of one uninterrupted run
    that keeps its activations, bit for bit (a recomputation records nothing that a
    checkpoint would carry)."""
    recipe = RECIPES["delayed"]
    torch.manual_seed(8)
    kept = _Model(False).to(DEVICE)
    first = copy.deepcopy(kept)
    first.checkpointed = True
    want = _train(kept, [(recipe, 4)], seed=9)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(9)

    def steps(model, opt, n):
        losses = []
        for _ in range(n):
            x = torch.randn(64, H, generator=gen).to(DEVICE).requires_grad_()
            with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(recipe=recipe):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    losses = steps(first, opt, 2)
    with torch.no_grad():  # validation outside te.autocast: high precision, no scaling state touched
        first.eval()
        first(torch.randn(64, H, device=DEVICE))
        first.train()
    saved = copy.deepcopy((first.state_dict(), opt.state_dict()))
    resumed = _Model(True).to(DEVICE)
    resumed.load_state_dict(saved[0])
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(saved[1])
    losses += steps(resumed, opt, 2)
    assert torch.equal(torch.stack(losses), want)
    for p, q in zip(kept.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_delayed_state(kept), _delayed_state(resumed), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
