"""Running a test's ranks: local processes on gloo, sharing a temporary folder.

``spawned(worker, nprocs)`` runs ``worker(rank, folder, results)`` in ``nprocs``
processes and returns what they put in ``results``. The ranks are forked from the
test process where the platform allows (they start with torch and te_fuser
imported: seconds saved per rank), each on one intra-op thread (the ranks share
the machine's cores)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawned", "gathered", "init"]


def _one_thread(rank: int, worker, folder: str, results) -> None:
    torch.set_num_threads(1)
    worker(rank, folder, results)


def spawned(worker, nprocs: int) -> dict:
    """What the ranks of ``worker(rank, folder, results)`` put in ``results``. Each
    rank marks ``done <rank>`` after its last collective: a process that then dies
    while gloo tears its group down (an abort seen now and then on a loaded
    machine) has finished what the tests check; any other death fails the test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        shared = manager.dict()
        try:
            mp.start_processes(_one_thread, args=(worker, folder, shared), nprocs=nprocs, start_method=method)
        except mp.ProcessExitedException:
            if not all(f"done {rank}" in shared for rank in range(nprocs)):
                raise
        return dict(shared)


def init(rank: int, world: int, folder: str, name: str = "store") -> None:
    """Join a gloo process group of ``world`` ranks through a file store in ``folder``
    (a file, not a TCP port: no race for a free port with other processes)."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/{name}", rank=rank, world_size=world)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank of the default group, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out
