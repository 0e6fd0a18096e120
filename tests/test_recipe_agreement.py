"""Ranks agree on the recipe (``te_fuser/recipe_agreement.py``), two gloo ranks:
switching together passes, and back to a recipe agreed before costs no check; a
rank that switches alone stops with an error naming the rank that did not follow
and the recipe it last trained under; unkeyed callables (per-process tokens)
still agree; evaluation plans are never checked."""

from __future__ import annotations

import torch
import torch.distributed as dist

import te_fuser as te
from dist_testing import init, spawned


def _model():
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.Linear(32, 32), te.ops.GELU(), te.ops.Linear(32, 32))


def _step(model, recipe):
    with te.autocast(recipe=recipe):
        model(torch.randn(8, 32)).square().mean().backward()


def _worker(rank: int, folder: str, results) -> None:
    from te_fuser import recipe_agreement

    init(rank, 2, folder)
    recipe_agreement.AGREEMENT_TIMEOUT_S = 3.0
    model = _model()
    current, rowwise = te.recipe.Float8CurrentScaling(), te.recipe.Float8RowwiseScaling()
    for recipe in (current, rowwise, current):  # together; back to an agreed one: no check
        _step(model, recipe)
    agreed, checks = recipe_agreement._agreed[dist.group.WORLD]
    results[(rank, "checks")] = checks[0]
    with torch.no_grad(), te.autocast(recipe=te.recipe.Float8CurrentScaling(power_2_scales=True)):
        model(torch.randn(8, 32))  # evaluation under a recipe of its own, on this rank alone: not checked
    # unkeyed callables: the keys differ between the processes only in their per-object tokens
    algo = lambda history: history.amax(dim=0)  # noqa: E731
    _step(model, te.recipe.DelayedScaling(amax_compute_algo=algo, reduce_amax=False))
    message = "no error"
    if rank == 1:  # switches alone
        try:
            _step(model, te.recipe.Float8CurrentScaling(input_amax_epsilon=1e-6))
        except RuntimeError as err:
            message = str(err)
    results[(rank, "alone")] = message
    dist.barrier()
    results[f"done {rank}"] = True
    dist.destroy_process_group()


def test_ranks_switching_together_pass_and_one_switching_alone_is_named():
    results = spawned(_worker, 2)
    assert results[(0, "checks")] == results[(1, "checks")] == 2  # current, rowwise; current again is agreed
    assert results[(0, "alone")] == "no error"
    message = results[(1, "alone")]
    assert "rank 1 trains under" in message and "input_amax_epsilon=1e-06" in message, message
    assert "ranks [0] had not switched to a new recipe" in message, message
    assert "DelayedScaling" in message, message  # what rank 0 last trained under


def test_an_nccl_group_turns_the_cuda_casts_one_launch_off(monkeypatch):
    """A plan on a CUDA device built under an NCCL process group sets the CUDA casts
    to their separate launches (a cooperative launch waits for the whole GPU, which
    an NCCL kernel of another stream may hold until the peers join); gloo, or a CPU
    plan, leaves them as they are. The setting is kept for an extension not loaded
    yet (this machine has none)."""
    from te_fuser.kernels import cuda as cuda_kernels
    from te_fuser.recipe_agreement import casts_beside_collectives

    previous = cuda_kernels.set_one_launch_casts(True)
    try:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
        casts_beside_collectives(torch.device("cuda", 0))
        assert cuda_kernels.one_launch_casts() is True
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        casts_beside_collectives(torch.device("cpu"))
        assert cuda_kernels.one_launch_casts() is True
        casts_beside_collectives(torch.device("cuda", 0))
        assert cuda_kernels.one_launch_casts() is False
    finally:
        cuda_kernels.set_one_launch_casts(previous)
