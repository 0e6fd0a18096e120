"""``torch.compile`` over te_fuser models: ``fullgraph=True`` compiles, training
steps give the eager numbers bit for bit, and a recipe change recompiles nothing
(each fused group is one custom op that picks its plan when it runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import te_fuser as te
from op_testing import FP8_RECIPES

H = 64
BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"  # CPU: no C++ compile per test
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Counting:
    """A torch.compile backend that counts the graphs it is handed."""

    def __init__(self, backend: str = BACKEND):
        self.graphs = 0
        self.backend = backend

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.backends.registry.lookup_backend(self.backend)(gm, example_inputs)


def mlp(seed=0):
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 2 * H), te.ops.GELU(),
                             te.ops.Linear(2 * H, H)).to(DEVICE)


class Block(nn.Module):
    """A pre-norm residual block with a plain module (attention-like) between te groups."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), nn.Tanh(), te.ops.Linear(H, H),
                                      te.ops.AddExtraInput())
        self.mlp = te.ops.Sequential(te.ops.RMSNorm(H), te.ops.Linear(H, 2 * H), te.ops.GELU(),
                                     te.ops.Linear(2 * H, H), te.ops.AddExtraInput())
        self.to(DEVICE)

    def forward(self, x):
        x = self.attn(x, x)
        return self.mlp(x, x)


SCHEDULE = [None, FP8_RECIPES["delayed"], FP8_RECIPES["current"], FP8_RECIPES["mxfp8"], FP8_RECIPES["delayed"]]


def _train_side_by_side(eager, compiled_model, params_e, params_c, steps_per_recipe=2):
    opt_e = torch.optim.AdamW(params_e, lr=1e-2)
    opt_c = torch.optim.AdamW(params_c, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for i, recipe in enumerate(r for r in SCHEDULE for _ in range(steps_per_recipe)):
        x = torch.randn(32, H, generator=gen).to(DEVICE)
        losses = []
        for model, opt in ((eager, opt_e), (compiled_model, opt_c)):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {i} ({type(recipe).__name__}): {losses}"


@pytest.mark.parametrize("how", ["module", "function"])
def test_fullgraph_training_equals_eager_and_a_recipe_change_recompiles_nothing(how):
    eager, model = mlp(), mlp()
    counter = Counting()
    if how == "module":
        compiled = torch.compile(model, fullgraph=True, backend=counter)
    else:
        compiled = torch.compile(lambda x: model(x), fullgraph=True, backend=counter)
    _train_side_by_side(eager, compiled, eager.parameters(), model.parameters())
    for p, q in zip(eager.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert counter.graphs == 1, f"{counter.graphs} graphs for five recipe phases"


def test_a_block_with_plain_modules_and_residuals_compiles_as_one_graph():
    eager, model = Block(), Block()
    counter = Counting()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    _train_side_by_side(eager, compiled, eager.parameters(), model.parameters(), steps_per_recipe=1)
    assert counter.graphs == 1


def test_te_autocast_inside_the_compiled_function_is_a_clear_error():
    model = mlp()

    def step(x):
        with te.autocast(recipe=FP8_RECIPES["current"]):
            return model(x)

    with pytest.raises(Exception, match="te.autocast inside a function that torch.compile traces"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(torch.randn(8, H, device=DEVICE))


def test_a_second_backward_through_the_compiled_graph_raises():
    model = mlp()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    with te.autocast(recipe=FP8_RECIPES["current"]):
        loss = compiled(torch.randn(16, H, device=DEVICE)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
