"""DDP: every rank trains its own slice of the batch; te_fuser reduces the amaxes.

Run it as it is (two local processes: gloo on CPU, or NCCL when two GPUs are
there) or under torchrun: ``torchrun --nproc-per-node 2 examples/distributed_ddp.py``.
Under ``DelayedScaling()`` (``reduce_amax=True``) every rank's amaxes are
all-reduced over the default process group, one collective for a forward's
casts and one for a backward's, so the ranks keep one scaling state.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import te_fuser as te


def train(rank: int, world: int) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = te.ops.Sequential(
        te.ops.LayerNorm(128, device=device),
        te.ops.Linear(128, 256, device=device),
        te.ops.GELU(),
        te.ops.Linear(256, 128, device=device),
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for recipe in (te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling()):
        for _ in range(3):
            x = torch.randn(world, 32, 128, generator=data)[rank].to(device)  # this rank's slice
            with te.autocast(recipe=recipe):
                loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            print(f"{type(recipe).__name__}: loss {loss.item():.4f} (rank 0's slice)")
    if rank == 0:
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
