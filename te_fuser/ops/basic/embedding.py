"""Embedding: token lookup, ``y = weight[idx]``, with a weight that a te Linear head may share.

Its input is integer token ids, so it is not a fusible op: the fuser's plans are
keyed by a floating compute dtype and there is no quantized tensor in a lookup.
In a ``Sequential`` it runs as a plain module between the fused groups (as in
TransformerEngine, where embeddings stay outside the FP8 modules), and it is
called on its own like ``torch.nn.Embedding``, whose constructor, state-dict key
(``weight``) and initialisation (N(0, 1)) it has.

The forward is the gather; the backward a scatter-add of the output gradient
into the rows of the tokens that were read, accumulated in fp32 and written in
the weight's dtype, in a fixed order: the same bits on every run. The kernel is
the backend's ``embedding_grad``: on the CPU the reference, torch's embedding
backward, adding each row's gradients one after another in token order (torch's
CPU ``index_put_`` adds from several threads in no fixed order); on the GPU the
Triton kernel, the ids sorted stably and each id's rows taken in token order a
group of 32 at a time, each group's sum a fixed tree. Its order is not the CPU's,
and it does not serialise an id read thousands of times in a batch (torch's
accumulating ``index_put_``, the GPU reference, does: on real text the space alone
held the end of every GPT backward for milliseconds); ``index_add_`` and atomics
would add in arrival order, and a token read thousands of times would get
different last bits from run to run, and so would every later step. The output
has the weight's dtype (as torch's lookup, which ``torch.autocast`` leaves alone).

Tied weights: the weight is read live from the module's parameter dict at every
call, so a Parameter assigned later (``head.linear.weight = embedding.weight``,
or the other way round, ``load_state_dict(assign=True)``) is the one that is
read and receives the gradients, which autograd sums over both uses.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import backend
from ..op import WatchedModule

__all__ = ["Embedding"]


_is_compiling = torch.compiler.is_compiling


@torch.library.custom_op("te_fuser::embedding_grad", mutates_args=())
def _embedding_grad_op(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """The backend's ``embedding_grad`` as one op of a compiled graph."""
    return backend.resolve("embedding_grad", dy.device).fn(ids, dy, num_embeddings)


@_embedding_grad_op.register_fake
def _(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    return dy.new_empty((num_embeddings, dy.shape[1]), dtype=torch.float32)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(fctx, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        fctx.save_for_backward(idx)
        fctx.weight_meta = (weight.shape, weight.dtype)
        return weight.index_select(0, idx.reshape(-1)).reshape(*idx.shape, weight.shape[1])  # (..., dim)

    @staticmethod
    def backward(fctx, dy: torch.Tensor):
        (idx,) = fctx.saved_tensors
        shape, dtype = fctx.weight_meta
        ids, rows = idx.reshape(-1), dy.reshape(-1, shape[1])
        if _is_compiling():  # an opaque op in a compiled graph: the kernel's launcher is not traced
            dw = _embedding_grad_op(ids, rows, shape[0])
        else:
            dw = backend.resolve("embedding_grad", dy.device).fn(ids, rows, shape[0])  # (num, dim) fp32
        return None, (dw if dtype is torch.float32 else dw.to(dtype))


class Embedding(WatchedModule):
    """``weight[idx]`` for integer ``idx`` of any shape: (...,) -> (..., embedding_dim)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device=None, dtype=None, name=None) -> None:
        super().__init__()
        for field, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Embedding.{field}: must be a positive integer, got {value!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Embedding(name=...): must be a string, got {type(name).__name__}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.name = name or ""
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the table again as construction did (standard normal, as
        ``torch.nn.Embedding``), in place (after ``to_empty``, or to start over)."""
        with torch.no_grad():
            nn.init.normal_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"Embedding: input must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"Embedding: input must hold integer token ids, got dtype {idx.dtype}")
        if idx.device != weight.device:
            raise ValueError(f"Embedding: token ids on {idx.device}, the weight on {weight.device}")
        # (a compiled graph cannot branch on the ids' values: there index_select's own check raises)
        if idx.device.type == "cpu" and idx.numel() and not _is_compiling() and (
                int(idx.min()) < 0 or int(idx.max()) >= self.num_embeddings):
            raise IndexError(f"Embedding: token ids must lie in [0, {self.num_embeddings}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        return _Lookup.apply(idx.long(), weight)
