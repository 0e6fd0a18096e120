"""te_fuser's own Python calls in one steady training step stay within a budget.

A small model's eager step is its host's time, and on a GPU host each Python call
of the library's layers (the Sequential, the fuser's guard and plan, the ops'
bodies, the quantizers' bookkeeping, the GEMM's dispatch) costs about a
microsecond beside a few microseconds a kernel launch. So the unchanged-recipe
step is kept lean by count, which on the CPU is exact and the same every run:
the calls whose code lives in the ``te_fuser`` package, counted over one step
after three that built the plans and seeded delayed scaling's scales (autograd's
device threads off, so the backward's calls are seen; kernels, torch and the
backends' code not counted). A change that adds calls on this path must say
why here, with the new count; one that removes calls lowers the budget.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import te_fuser as te
from te_fuser.models.gpt import GPT, GPTConfig

PACKAGE = os.path.dirname(te.__file__) + os.sep

RECIPES = {"bf16": None, "delayed": te.recipe.DelayedScaling(), "current": te.recipe.Float8CurrentScaling()}

# Calls a step measured on the CPU stack (torch 2.13), then about 5% of headroom.
GPT_BUDGET = {"bf16": (466, 490), "delayed": (1153, 1210), "current": (846, 890)}
LINEAR_BUDGET = {"bf16": (36, 38), "delayed": (130, 137), "current": (80, 84)}


def _own_calls(step) -> collections.Counter:
    """The package's Python calls in one call of ``step``, by (file, function), after three warm-up calls."""
    calls: collections.Counter = collections.Counter()

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE):
                calls[(code.co_filename[len(PACKAGE):], code.co_name)] += 1

    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(3):
            step()
        sys.setprofile(hook)
        try:
            step()
        finally:
            sys.setprofile(None)
    return calls


def _gpt_step(recipe, n_layer: int = 2):
    """The yardstick GPT at ``n_layer`` layers of width 64 (te attention), fused AdamW, bf16 autocast."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=n_layer, d_model=64, n_head=4, d_ffn=256, seq_len=32, batch_size=1, attention="te")
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = torch.randint(0, config.vocab_size, (1, config.seq_len + 1))
    x, y = batch[:, :-1], batch[:, 1:]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _linear_step(recipe):
    """One Linear (64 -> 256, 32 tokens), forward and backward under bf16 autocast."""
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(64, 256))
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 256, dtype=torch.bfloat16)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.backward(dy)

    return step


def _check(calls: collections.Counter, measured: int, budget: int, what: str) -> None:
    total = sum(calls.values())
    top = ", ".join(f"{f}:{fn} {n}" for (f, fn), n in calls.most_common(8))
    assert total <= budget, (f"{what}: {total} calls of te_fuser's own in a steady step, over the budget of {budget} "
                             f"(measured {measured} when it was set); the most called: {top}")


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_steady_gpt_step_keeps_to_its_python_calls(name):
    measured, budget = GPT_BUDGET[name]
    _check(_own_calls(_gpt_step(RECIPES[name])), measured, budget, f"the GPT's step under {name}")


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_steady_linear_step_keeps_to_its_python_calls(name):
    measured, budget = LINEAR_BUDGET[name]
    _check(_own_calls(_linear_step(RECIPES[name])), measured, budget, f"the Linear's step under {name}")


def test_the_count_sees_the_backward_and_grows_with_the_layers():
    """The count is of the whole step, backward included (a count that missed the
    backward's thread would pass any budget): the fuser's backward runs in it, and
    a third layer adds about a layer's calls."""
    recipe = RECIPES["delayed"]
    two = _own_calls(_gpt_step(recipe))
    assert two[("ops/fuser.py", "run_backward")] > 0
    three = sum(_own_calls(_gpt_step(recipe, n_layer=3)).values())
    assert three > sum(two.values()) * 1.2, (three, sum(two.values()))
