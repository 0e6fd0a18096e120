"""Current scaling on token-sharded activations (``te.sequence_parallel``): two gloo
ranks each hold half of every sequence; with the group, their FP8 casts are the
rows of the unsharded cast, so their outputs and input gradients are one
process's on the whole sequence, bit for bit, and the summed weight gradients
are its own within the fp32 tolerance; without it they are not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import te_fuser as te
from dist_testing import init, spawned
from tolerances import assert_bitwise, assert_close

RECIPE = te.recipe.Float8CurrentScaling()
B, T, D, F = 2, 16, 64, 128


def model():
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(D), te.ops.Linear(D, F), te.ops.GELU(), te.ops.Linear(F, D))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, D, generator=g)
    x[:, T // 2:] *= 9.0  # the second half of every sequence is larger: the halves' amaxes differ
    return x, torch.randn(B, T, D, generator=g)


def step(net, x, target, n_tokens):
    """Forward and backward of the summed squared error over ``n_tokens`` tokens in all."""
    x = x.clone().requires_grad_(True)
    with te.autocast(recipe=RECIPE):
        y = net(x)
    ((y - target) ** 2).sum().div(n_tokens).backward()
    return y.detach(), x.grad, [p.grad.clone() for p in net.parameters()]


def _worker(rank: int, folder: str, results) -> None:
    init(rank, 2, folder)
    x, target = data()
    full_y, full_dx, full_dw = step(model(), x, target, B * T)  # one process, the whole sequence
    rows = slice(rank * T // 2, (rank + 1) * T // 2)
    for reduced in (True, False):
        net = model()
        if reduced:
            te.sequence_parallel(net, dist.group.WORLD)
        y, dx, dw = step(net, x[:, rows], target[:, rows], B * T)
        for g in dw:
            dist.all_reduce(g)  # the weights' gradients: the sum of the ranks' shares
        results[(rank, reduced, "y")] = torch.equal(y, full_y[:, rows])
        results[(rank, reduced, "dx")] = torch.equal(dx, full_dx[:, rows])
        if reduced:
            assert_bitwise(y, full_y[:, rows], f"rank {rank} output")
            assert_bitwise(dx, full_dx[:, rows], f"rank {rank} input gradient")
            for i, (got, want) in enumerate(zip(dw, full_dw)):
                assert_close(got, want, torch.float32, f"rank {rank} parameter {i} gradient", scaled=True)
            # a later plan (eval, then training again) keeps the group on its quantizers
            with torch.no_grad(), te.autocast(recipe=RECIPE):
                net(x[:, rows])
            y2, _, _ = step(net, x[:, rows], target[:, rows], B * T)
            results[(rank, "again")] = torch.equal(y2, full_y[:, rows])
    dist.barrier()
    results[f"done {rank}"] = True
    dist.destroy_process_group()


def test_token_shards_cast_as_the_whole_sequence():
    results = spawned(_worker, 2)
    for rank in (0, 1):
        assert results[(rank, True, "y")] and results[(rank, True, "dx")], f"rank {rank}"
        assert results[(rank, "again")], f"rank {rank}: a rebuilt plan lost the group"
    # without the reduction the shards cast with their own scales: not the unsharded run
    assert not all(results[(rank, False, "y")] for rank in (0, 1))


def test_errors():
    with pytest.raises(TypeError, match="te.sequence_parallel: module must be a torch.nn.Module"):
        te.sequence_parallel("model", None)
    with pytest.raises(ValueError, match="holds no te_fuser op"):
        te.sequence_parallel(torch.nn.Linear(2, 2), None)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="no initialized process group"):
            te.sequence_parallel(model(), object())
