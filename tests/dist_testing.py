"""Running a test's ranks: local processes on gloo, sharing a temporary folder.

``spawned(worker, nprocs)`` runs ``worker(rank, folder, results)`` in ``nprocs``
processes and returns what they put in ``results``. The ranks are forked from the
test process where the platform allows and the machine has no GPU (they start
with torch and te_fuser imported: seconds saved per rank), each on one
intra-op thread (the ranks share the machine's cores).

With ``TE_FUSER_TEST_DIST=nccl`` the tests whose workers are written for it
(``spawned(..., gpus=True)``) run on GPUs: NCCL, one GPU per rank (``device()``
is ``cuda:<rank>``), ranks spawned (a forked process cannot use CUDA), NVLink
multicast off; a test of more ranks than GPUs is skipped. Such workers put their
models and data on ``device()``, build meshes and autocast regions for
``device_type()`` and hand back host values (booleans, numbers, CPU tensors)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawned", "gathered", "init", "device", "device_type", "NCCL"]

NCCL = os.environ.get("TE_FUSER_TEST_DIST", "gloo") == "nccl"
_ON_GPU = [False]  # in a rank: whether it runs on its GPU (set by spawned)


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if _ON_GPU[0] else torch.device("cpu")


def device_type() -> str:
    return "cuda" if _ON_GPU[0] else "cpu"


def _one_thread(rank: int, worker, folder: str, results, on_gpu: bool) -> None:
    torch.set_num_threads(1)
    _ON_GPU[0] = on_gpu
    if on_gpu:
        torch.cuda.set_device(rank)
    worker(rank, folder, results)


def spawned(worker, nprocs: int, gpus: bool = False) -> dict:
    """What the ranks of ``worker(rank, folder, results)`` put in ``results``. Each
    rank marks ``done <rank>`` after its last collective: a process that then dies
    while gloo tears its group down (an abort seen now and then on a loaded
    machine) has finished what the tests check; any other death fails the test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    on_gpu = gpus and NCCL
    if on_gpu:
        if torch.cuda.device_count() < nprocs:
            pytest.skip(f"{nprocs} ranks need {nprocs} GPUs under NCCL, this machine has {torch.cuda.device_count()}")
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    # Where a GPU is present, autograd starts its device threads at this process's first
    # backward (on CPU tensors too), and a rank forked after that refuses to run its own
    # backward: spawn there.
    method = "fork" if "fork" in mp.get_all_start_methods() and not torch.cuda.is_available() else "spawn"
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        shared = manager.dict()
        try:
            mp.start_processes(_one_thread, args=(worker, folder, shared, on_gpu), nprocs=nprocs,
                               start_method=method)
        except mp.ProcessExitedException:
            if not all(f"done {rank}" in shared for rank in range(nprocs)):
                raise
        return dict(shared)


def init(rank: int, world: int, folder: str, name: str = "store") -> None:
    """Join a process group of ``world`` ranks (gloo, or NCCL with this rank's GPU)
    through a file store in ``folder`` (a file, not a TCP port: no race for a free
    port with other processes)."""
    dist.init_process_group("nccl" if _ON_GPU[0] else "gloo", init_method=f"file://{folder}/{name}", rank=rank,
                            world_size=world)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank of the default group, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out
