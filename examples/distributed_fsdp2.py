"""FSDP2 per layer, with the linears' weights all-gathered in FP8.

Run it as it is (two local processes: gloo on CPU, or NCCL when two GPUs are
there) or under torchrun: ``torchrun --nproc-per-node 2 examples/distributed_fsdp2.py``.
``fully_shard`` goes on every op, then on the root, as on any torch model.
``te.enable_fsdp_fp8_all_gather`` (before ``fully_shard``) makes FSDP2 gather a
linear's weight in FP8 wherever the step before ran it under delayed or current
scaling: 1 byte per element on the wire instead of 4 (fp32) or 2 (bf16), cast
with the one scale of the whole weight, and not cast again by the linear.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import te_fuser as te


def train(rank: int, world: int) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    model = te.ops.Sequential(
        te.ops.LayerNorm(128, device=device),
        te.ops.Linear(128, 256, device=device),
        te.ops.GELU(),
        te.ops.Linear(256, 128, device=device),
    )
    te.enable_fsdp_fp8_all_gather(model)  # before fully_shard and before the optimizer
    for op in model:
        if any(True for _ in op.parameters()):
            fully_shard(op, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for recipe in (te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling()):
        for _ in range(3):
            x = torch.randn(world, 32, 128, generator=data)[rank].to(device)  # this rank's slice
            with te.autocast(recipe=recipe):
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            print(f"{type(recipe).__name__}: loss {loss.item():.4f} (rank 0's slice)")
    if rank == 0:
        gathers = te.fp8_all_gather_stats(model)  # the first step of each recipe gathers in high precision
        print(f"weight all-gathers: {gathers['fp8']} in FP8, {gathers['high_precision']} in high precision")
        print(f"re-fusions: {model.fusion_stats().builds}")
    dist.barrier()  # no rank tears the group down while another still talks through it
    dist.destroy_process_group()


def _spawned(rank: int, world: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    train(rank, world)


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:  # two local processes, meeting on a free port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        mp.spawn(_spawned, args=(2,), nprocs=2)
