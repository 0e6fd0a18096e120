"""``te.checkpoint``: activation checkpointing of a region of te_fuser ops.

    y = te.checkpoint(block, x)          # as torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

The region's forward keeps none of its activations: the backward runs it again
to rebuild them, trading compute for memory as ``torch.utils.checkpoint`` does
(non-reentrant; its other arguments pass through). What te_fuser adds:

- every tensor the fused ops save goes through autograd's saved-tensor hooks,
  so the checkpoint drops it (outside a checkpointed region the ops keep their
  saved state on the autograd node, as before);
- the recomputation runs under the te.autocast state and kernel backend that the
  forward ran under, whatever is in force when the backward runs, so it runs
  the forward's published plan (no re-fusion) and gives the forward's bits;
- delayed scaling casts the recomputation with the scales the forward cast with
  and records no amax (``quantization/recompute.py``): the scaling state after
  the step is that of the same step without checkpointing.

A region called under ``torch.utils.checkpoint`` itself gets none of this: the
backward recomputes it under the te.autocast state in force then (usually
none), the fused ops keep their saved state (nothing is dropped), and the
recomputed forward is thrown away; gradients are right, nothing is saved.
That is the non-reentrant checkpoint. The reentrant one (``use_reentrant=True``,
or another library's ``autograd.Function`` named for checkpointing, as
DeepSpeed's and Megatron's are) runs the region's forward without autograd and
takes every gradient from the recomputation, so under an FP8 recipe they would be
a high-precision forward's: the fuser refuses it there, at the region's first
fused group whose input requires grad, before that group casts anything
(``ops/fuser.py``'s ``refuse_reentrant_checkpoint``). Without an FP8 recipe the
recomputation runs the forward's plan and trains as the region kept.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as _torch_checkpoint

from . import backend as _backend
from .autocast import STATE_STACK, current_state
from .quantization.recompute import ACTIVE, Frame

__all__ = ["checkpoint"]

_is_compiling = torch.compiler.is_compiling


class _Recording(contextlib.AbstractContextManager):
    """The region's forward: the state it runs under is noted, and delayed-scaling
    casts note their scales in ``frame``."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.outer = None

    def __enter__(self):
        frame = self.frame
        frame.state = current_state()
        frame.backend = _backend.get_backend()
        self.outer = ACTIVE[0]
        frame.outer = self.outer  # a nested region: its casts are the enclosing one's too
        ACTIVE[0] = frame
        return self

    def __exit__(self, *exc) -> None:
        ACTIVE[0] = self.outer


class _Replaying(contextlib.AbstractContextManager):
    """The region recomputed in the backward: under the forward's te.autocast state
    and backend, delayed-scaling casts taking the forward's scales."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.outer = self.recording = None
        self.depth = 0
        self.pushed = False

    def __enter__(self):
        frame = self.frame
        frame.rewind()
        self.depth = len(STATE_STACK)
        STATE_STACK.append(frame.state)
        self.pushed = frame.backend != _backend.get_backend()
        if self.pushed:
            _backend.push_override(frame.backend)
        self.outer, ACTIVE[1] = ACTIVE[1], frame
        # a recomputation notes nothing in a region being recorded around it (regions
        # nested in this one record their own frames while it runs)
        self.recording, ACTIVE[0] = ACTIVE[0], None
        return self

    def __exit__(self, *exc) -> None:
        ACTIVE[1], ACTIVE[0] = self.outer, self.recording
        if self.pushed:
            _backend.pop_override()
        del STATE_STACK[self.depth:]


def checkpoint(function, *args, use_reentrant: bool = False, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, **kwargs):
    """``function(*args, **kwargs)`` with its activations recomputed in the backward
    (see the module doc). TransformerEngine's signature: ``use_reentrant`` must be
    False (the reentrant checkpoint cannot restore the forward's FP8 state), and the
    tensor-parallel arguments (``distribute_saved_activations``,
    ``get_rng_state_tracker``, ``tp_group``) are not supported. Other keyword
    arguments go to ``torch.utils.checkpoint.checkpoint``, except ``context_fn``,
    which te_fuser sets."""
    if _is_compiling():
        raise RuntimeError("te.checkpoint inside a function that torch.compile traces: checkpoint the compiled "
                           "function instead (te.checkpoint(torch.compile(block), x)), or leave te.checkpoint out "
                           "of the compiled region")
    if use_reentrant is not False:
        raise ValueError("te.checkpoint(use_reentrant=True): not supported; the reentrant checkpoint runs the "
                         "recomputation outside autograd's saved-tensor hooks, where the forward's FP8 state cannot "
                         "be restored (use_reentrant=False is the default)")
    if distribute_saved_activations or get_rng_state_tracker is not None or tp_group is not None:
        raise ValueError("te.checkpoint: distribute_saved_activations, get_rng_state_tracker and tp_group (tensor "
                         "parallelism's saved-activation split) are not supported")
    if "context_fn" in kwargs:
        raise ValueError("te.checkpoint(context_fn=...): te_fuser sets the context (the forward's te.autocast state "
                         "and scales for the recomputation); call torch.utils.checkpoint.checkpoint for your own")
    frame = Frame(None, None)

    def contexts():
        return _Recording(frame), _Replaying(frame)

    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
