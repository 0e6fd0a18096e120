"""Delayed scaling's deferred state updates: one batch per pass for all of a
step's amaxes, and across ranks one collective for them (with the ranks' recipe
keys compared in it).

A delayed-scaling quantizer records each cast's amax here (:data:`PENDING`)
instead of updating its state at once; :func:`flush_amax_reductions` reduces the
amaxes of quantizers under a reduction group over their group, then updates every
waiting quantizer: those of one configuration (history length, format, margin,
algorithm) with one ``delayed_scale_update_many`` over their stacked state, a
quantizer alone or with a callable algorithm through its own ``_update``. A
quantizer flushes before it reads or shows its state, so every cast sees the
scale an update at once would have given, bit for bit.
"""

from __future__ import annotations

import zlib

import torch

from ..recipe_agreement import different_recipes

__all__ = ["WORLD", "default_group", "PENDING", "flush_amax_reductions", "discard_pending"]


# The default process group, whichever is initialized when a cast runs (a name,
# not an object, so that a copied or unpickled quantizer still means it).
WORLD = "world"


def _world_state():
    """torch's record of the default process group (``distributed_c10d._world``), read
    for its ``_default_pg`` without the three calls ``is_initialized`` makes (every
    delayed-scaling cast asks); None where this torch lacks it or has no distributed."""
    dist = torch.distributed
    if not dist.is_available():
        return None
    world = getattr(dist.distributed_c10d, "_world", None)
    return world if world is not None and hasattr(world, "_default_pg") else None


_WORLD_STATE = _world_state()


def default_group():
    """The default process group when one is initialized with more than one rank, else None."""
    world = _WORLD_STATE
    if world is not None:
        if world._default_pg is None:  # nothing initialized: the common case, one attribute read
            return None
    elif not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    dist = torch.distributed
    if dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class _PendingAmaxes:
    """Amaxes recorded but not applied yet, with their quantizers and reduction
    groups (None: none), in record order. :func:`flush_amax_reductions` reduces
    them in one collective per group and applies the updates. It runs when a
    te.autocast region ends (the forward's casts), when a backward that cast under
    a group ends (an engine callback), and before any quantizer with a pending
    amax uses or shows its state: every rank runs the same model, so every rank
    flushes at the same points and the collectives match."""

    def __init__(self) -> None:
        self.entries: list = []  # (quantizer, amax (1,) fp32, group)
        self.callback_queued = False

    def add(self, quantizer, amax: torch.Tensor, group) -> None:
        self.entries.append((quantizer, amax, group))
        quantizer._pending += 1
        # Under a group every rank must flush at the same points: also when a backward
        # ends. Without one the next use of the state flushes, on the stream that uses it.
        if group is not None and not self.callback_queued and torch._C._current_graph_task_id() != -1:
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
    reduced = [amax for _, amax, _ in entries]
    if any(group is not None for _, _, group in entries):
        _reduce(entries, reduced)
    _apply(entries, reduced)
    _compare_recipes()  # host-side digests (gloo on CPU) are there already


def discard_pending() -> None:
    """Drop every waiting amax unapplied: what a failed CUDA-graph capture recorded
    (its tensors were never computed)."""
    for quantizer, _, _ in PENDING.entries:
        quantizer._pending -= 1
    PENDING.entries = []
    PENDING.callback_queued = False


def _reduce(entries: list, reduced: list) -> None:
    """All-reduce (max) the amaxes of the entries under a group, one collective
    per group and device, each carrying the ranks' recipe digests; ``reduced[i]``
    becomes entry ``i``'s reduced amax."""
    dist = torch.distributed
    batches: dict = {}  # (group, device) -> indices, in first-appearance order
    for i, (_, amax, group) in enumerate(entries):
        if group is not None:
            batches.setdefault((id(group), amax.device), (group, []))[1].append(i)
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


def _apply(entries: list, amaxes: list) -> None:
    """Update each entry's quantizer with its amax, in record order per quantizer.
    A quantizer waits with at most one amax in the usual case (it flushes before
    its next cast); any later ones of the same quantizer follow, round by round."""
    for quantizer, _, _ in entries:
        quantizer._pending -= 1
    pairs = [(quantizer, amax) for (quantizer, _, _), amax in zip(entries, amaxes)]
    while pairs:
        seen, first, later = set(), [], []
        for quantizer, amax in pairs:
            (later if id(quantizer) in seen else first).append((quantizer, amax))
            seen.add(id(quantizer))
        type(first[0][0]).update_together(first)  # the delayed-scaling quantizers record here
        pairs = later
