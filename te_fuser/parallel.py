"""``te.sequence_parallel``: current scaling over activations sharded by tokens.

When the ranks of a process group each hold a slice of the tokens (sequence or
context parallelism: the weights whole on every rank, the activations and their
gradients split along their rows), a per-tensor current-scaling cast on each rank
would scale its slice by the slice's own amax, and the ranks would train on
different FP8 values than one process on the whole sequence. Under
``te.sequence_parallel(model, group)`` the current-scaling quantizers of the
model's activations and gradients (every role but the weights) all-reduce (max)
each cast's amax over ``group`` first: every rank casts its rows with the scale of
the whole tensor, and the shards' FP8 data are the rows of the unsharded cast.
Delayed scaling needs nothing of this (its amax reduction already covers the
group given to te.autocast); batch-sharded data parallelism (DDP, FSDP) needs it
neither: each rank's tensors are whole samples.
"""

from __future__ import annotations

from torch import nn

from .epoch import bump
from .ops.op import BasicOperation

__all__ = ["sequence_parallel"]


def sequence_parallel(module: nn.Module, group) -> nn.Module:
    """Mark every te_fuser op in ``module`` as running on token-sharded activations
    over ``group`` (a ``torch.distributed`` process group; ``None`` unmarks them).
    Applies to the quantizers installed now and to those later plans install;
    returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"te.sequence_parallel: module must be a torch.nn.Module, got {type(module).__name__}")
    if group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("te.sequence_parallel: torch.distributed has no initialized process group")
    ops = [m for m in module.modules() if isinstance(m, BasicOperation)]
    if not ops:
        raise ValueError(f"te.sequence_parallel: {type(module).__name__} holds no te_fuser op")
    for op in ops:
        op.sequence_parallel_group = group
        op.apply_sequence_parallel_group()
    bump()
    return module
