"""Delayed scaling's amax reduction across ranks: which group, and one collective
per pass for all of a step's amaxes (with the ranks' recipe keys compared in it).

A delayed-scaling quantizer under a reduction group records its amax here
(:data:`PENDING`) instead of updating its state at once; :func:`flush_amax_reductions`
reduces every pending amax and hands each back to its quantizer's ``_update``.
"""

from __future__ import annotations

import zlib

import torch

from ..recipe_agreement import different_recipes

__all__ = ["WORLD", "default_group", "PENDING", "flush_amax_reductions"]


# The default process group, whichever is initialized when a cast runs (a name,
# not an object, so that a copied or unpickled quantizer still means it).
WORLD = "world"


def default_group():
    """The default process group when one is initialized with more than one rank, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class _PendingAmaxes:
    """Amaxes recorded under a reduction group but not reduced yet, with their
    quantizers, in record order. :func:`flush_amax_reductions` reduces them all in
    one collective per group and applies the updates in that order. It runs when
    a te.autocast region ends (the forward's casts), when a backward that cast
    ends (an engine callback), and before any quantizer with a pending amax uses
    or shows its state: every rank runs the same model, so every rank flushes at
    the same points and the collectives match."""

    def __init__(self) -> None:
        self.entries: list = []  # (quantizer, amax (1,) fp32, group)
        self.callback_queued = False

    def add(self, quantizer, amax: torch.Tensor, group) -> None:
        self.entries.append((quantizer, amax, group))
        quantizer._pending += 1
        if not self.callback_queued and torch._C._current_graph_task_id() != -1:  # inside a backward
            torch.autograd.Variable._execution_engine.queue_callback(flush_amax_reductions)
            self.callback_queued = True


PENDING = _PendingAmaxes()


def _keys_digest(keys: list) -> float:
    """24 bits of the recipe keys, in order: exact in fp32 (and >= 0)."""
    return float(zlib.crc32("\n".join(str(k) for k in keys).encode()) & 0xFFFFFF)


# The ranks' digests of the flushes so far, still to be compared: (digests on the
# host, the event after which they are there or None, this rank's digest and
# keys, this rank). Compared at the next flush once copied, never waited for.
_CHECKS: list = []


def _compare_recipes() -> None:
    keep = []
    for host, event, mine, keys, rank in _CHECKS:
        if event is not None and not event.query():
            keep.append((host, event, mine, keys, rank))
            continue
        digests = host.tolist()
        if any(d != mine for d in digests):
            _CHECKS.clear()
            raise different_recipes(digests, "by delayed scaling's amax reduction", rank, sorted({str(k) for k in keys}))
    _CHECKS[:] = keep


def flush_amax_reductions() -> None:
    """All-reduce (max) every pending amax, one collective per group and device, in
    the order the groups first appear, then record each into its quantizer. The
    same collective carries each rank's digest of its recipe keys in a slot of its
    own: ranks that switched recipes apart fail (at the next flush, without
    waiting on the device) with an error naming them and this rank's keys, instead
    of training on each other's scales."""
    entries, PENDING.entries = PENDING.entries, []
    PENDING.callback_queued = False
    _compare_recipes()
    if not entries:
        return
    dist = torch.distributed
    batches: dict = {}  # (group, device) -> indices, in first-appearance order
    for i, (_, amax, group) in enumerate(entries):
        batches.setdefault((id(group), amax.device), (group, []))[1].append(i)
    reduced = [amax for _, amax, _ in entries]
    for group, indices in batches.values():
        keys = [entries[i][0].recipe_key for i in indices]
        mine, rank, world = _keys_digest(keys), dist.get_rank(group), dist.get_world_size(group)
        device = entries[indices[0]][1].device
        slots = torch.full((world,), -1.0, dtype=torch.float32, device=device)
        slots[rank] = mine
        buffer = torch.cat([*(entries[i][1].reshape(1) for i in indices), slots])
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
        digests = buffer[len(indices):]
        if device.type == "cuda":
            host = torch.empty(world, dtype=torch.float32, pin_memory=True)
            host.copy_(digests, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            _CHECKS.append((host, event, mine, keys, rank))
        else:
            _CHECKS.append((digests, None, mine, keys, rank))
        for j, i in enumerate(indices):
            reduced[i] = buffer[j : j + 1]
    for (quantizer, _, _), amax in zip(entries, reduced):
        quantizer._pending -= 1
        quantizer._update(amax)
    _compare_recipes()  # host-side digests (gloo on CPU) are there already
