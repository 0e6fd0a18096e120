"""``te.warmup``: compile every kernel a model needs under a list of recipes, in advance.

    te.warmup(model, [te.recipe.DelayedScaling(), te.recipe.MXFP8BlockScaling()], x)

Runs one forward and backward of ``model`` on ``sample_input`` under each recipe,
and (``evaluation=True``, the default) a forward without autograd as an evaluation
runs it, so that Triton and CUDA kernels for those recipes, shapes and dtypes are
compiled and cached and the fusers keep the plan templates of both (a training
step's and an evaluation's: fusion rules match once per recipe and kind); then
puts everything back as it was: parameters (never written; an
FP8 parameter that a recipe's plan re-cast into its layout gets its bytes back),
gradients, buffers, the RNG state, every op's installed quantizers, their scaling
state (amax histories included), published plans and fusion statistics (a weight
cast kept by ``te.reuse_quantized_weights()`` is dropped: the next forward casts
again). A later switch to one of these recipes, and a validation pass
under one, builds only its quantizers: no compilation, no rule matching.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn

from .autocast import autocast
from .epoch import CHANGES as _EPOCH
from .ops.find import fusers_of
from .ops.fp8_parameters import restore_fp8_parameter_snapshot, snapshot_fp8_parameters
from .ops.op import BasicOperation
from .recipe import Recipe

__all__ = ["warmup"]


class _Snapshot:
    """Everything a warm-up run could change, to be put back afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.grads = [(p, p.grad) for p in model.parameters()]
        for p in model.parameters():
            p.grad = None  # the warm-up's gradients go to fresh tensors, dropped afterwards
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.fp8_parameters = snapshot_fp8_parameters(model)  # a recipe's plan may re-cast them into its layout
        self.ops = [(op, op.snapshot_quantizers()) for op in model.modules() if isinstance(op, BasicOperation)]
        self.fusers = [(f, f.snapshot()) for f in fusers_of(model)]
        self.epoch = _EPOCH[0]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        restore_fp8_parameter_snapshot(self.fp8_parameters)
        for p, g in self.grads:
            p.grad = g
        for op, quantizers in self.ops:
            op.restore_quantizers(quantizers)  # a kept weight cast is dropped: the next forward casts again
        for f, fuser_snapshot in self.fusers:
            f.restore(fuser_snapshot)
        _EPOCH[0] += 1  # plans re-check their ops' quantizers once
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def warmup(
    model: nn.Module,
    recipes: Iterable[Recipe | None],
    sample_input: torch.Tensor,
    *extra_inputs: torch.Tensor,
    backward: bool = True,
    evaluation: bool = True,
) -> None:
    """Compile the kernels ``model`` needs under each recipe (``None``: high
    precision) for inputs like ``sample_input``, leaving the model's state untouched.
    ``backward``: a training step's forward and backward (else a forward without
    autograd only); ``evaluation``: also a forward without autograd, as a
    validation pass runs under the recipe."""
    recipes = list(recipes)
    for i, r in enumerate(recipes):
        if r is not None and not isinstance(r, Recipe):
            raise TypeError(f"warmup(recipes=...): item {i} must be a recipe or None, got {type(r).__name__}")
    snapshot = _Snapshot(model)
    try:
        for recipe in recipes:
            for train in (True, False) if backward and evaluation else (backward,):
                x = sample_input.detach().clone().requires_grad_(train and sample_input.is_floating_point())
                with autocast(enabled=recipe is not None, recipe=recipe), (
                    contextlib.nullcontext() if train else torch.no_grad()
                ):
                    out = model(x, *extra_inputs)
                if train:
                    outs = out if isinstance(out, tuple) else (out,)
                    torch.autograd.backward([o for o in outs if o.requires_grad],
                                            [torch.ones_like(o) for o in outs if o.requires_grad])
    finally:
        snapshot.restore()
