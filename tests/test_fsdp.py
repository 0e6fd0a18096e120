"""FSDP2 over te_fuser models, two CPU processes on gloo (or two GPUs on NCCL, see
``dist_testing``): ``fully_shard`` on the
root alone, and on every op then the root, before or after a first forward,
trains exactly as one process training on the whole batch.

Sharding replaces the ops' Parameters (sharded ones, then gathered ones around
every forward and backward): the ops read their parameters live and run the
module hooks FSDP2 registers on them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_testing import device, device_type, init, spawned

WORLD = 2
CONFIGS = [  # (recipe name, shard every op too, one forward before sharding, the model run under te.checkpoint,
    # the model made on the meta device, sharded, then to_empty and reset_parameters)
    ("none", False, False, False, False), ("none", True, False, False, False), ("current", False, True, False, False),
    ("current", True, False, False, False), ("current", True, True, False, False), ("block", True, True, False, False),
    ("mxfp8", True, False, False, False), ("none", True, False, True, False), ("current", True, False, True, False),
    ("none", False, False, False, True), ("current", True, False, False, True),
]


def _build(on_meta: bool = False):
    import te_fuser as te

    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            return te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(),
                                     te.ops.Linear(128, 64))
    return te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(),
                             te.ops.Linear(128, 64)).to(device())


def _run(rank: int, recipe_name: str, per_op: bool, warm: bool, checkpointed: bool, on_meta: bool) -> float:
    """Train a sharded model (its activations recomputed in the backward when
    ``checkpointed``: FSDP2 gathers the weights again for the recomputation; made
    on the meta device and initialised after sharding, as large models are, when
    ``on_meta``: the twin then starts from its gathered weights) and a one-process
    twin; the largest weight difference."""
    import te_fuser as te
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    recipe = {"none": None, "current": te.recipe.Float8CurrentScaling(), "block": te.recipe.Float8BlockScaling(),
              "mxfp8": te.recipe.MXFP8BlockScaling()}[recipe_name]
    mesh = init_device_mesh(device_type(), (WORLD,))
    model, twin = _build(on_meta), _build()
    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(1)).to(device())
    if warm:
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            model(x[0, :32])
    if per_op:
        for module in model:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if on_meta:  # FSDP2's deferred initialisation: storage for the shards, then every module's own init
        model.to_empty(device=device())
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        start = {key: value.full_tensor() for key, value in model.state_dict().items()
                 if not key.endswith("_extra_state")}
        assert all(v.isfinite().all() for v in start.values()), "an initialised weight is not finite"
        assert start["1.bias"].abs().max() > 0, "the Linear's bias lost its uniform init"
        twin.load_state_dict(start, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for step in range(3):
        half = x[step].chunk(WORLD)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = te.checkpoint(model, half[rank]) if checkpointed else model(half[rank])
            loss = y.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            twin_loss = sum(twin(h).square().mean() for h in half) / WORLD
        twin_loss.backward()
        twin_opt.step()
        twin_opt.zero_grad()
    if not on_meta:
        start = _build().state_dict()
    worst = 0.0
    for key, value in twin.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        full = model.state_dict()[key].full_tensor()
        assert not torch.equal(value, start[key]), f"{key} did not train"
        worst = max(worst, (full - value).abs().max().item())
    return worst


def _worker(rank: int, folder: str, results) -> None:
    init(rank, WORLD, folder)
    try:
        for config in CONFIGS:
            worst = _run(rank, *config)
            if rank == 0:
                results[config] = worst
        dist.barrier()  # no rank tears the group down while another still talks through it
        results[f"done {rank}"] = True
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    return spawned(_worker, WORLD, gpus=True)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{'per_op' if c[1] else 'root'}"
                         f"{'-after_a_forward' if c[2] else ''}{'-checkpointed' if c[3] else ''}"
                         f"{'-made_on_meta' if c[4] else ''}")
def test_fully_shard_trains_as_one_process(results, config):
    assert results[config] == 0.0, f"{config}: weights differ from one process by {results[config]}"
