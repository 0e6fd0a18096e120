"""The embedding's weight gradient: ``dw[v]`` is the sum of the output gradient's rows
of the tokens that read id ``v``, in fp32 (any float ``dy`` is widened), each id's
rows added one after another in token order. A backend may add in another fixed
order (the Triton kernel adds groups of rows), never in arrival order: a backward
gives the same bits on every run.
"""

from __future__ import annotations

import torch

__all__ = ["embedding_grad_reference", "check_embedding_grad"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_embedding_grad(ids, dy, num_embeddings) -> None:
    """The checks every backend runs before an embedding-gradient launch (naming the argument)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise TypeError(f"embedding_grad: ids must be a 1-D int64 tensor, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)} of {getattr(ids, 'dim', lambda: '?')()} dims")
    if not isinstance(dy, torch.Tensor) or dy.dim() != 2 or dy.dtype not in _FLOATS:
        raise TypeError(f"embedding_grad: dy must be a 2-D float tensor, got "
                        f"{getattr(dy, 'dtype', type(dy).__name__)} of {getattr(dy, 'dim', lambda: '?')()} dims")
    if ids.shape[0] != dy.shape[0] or ids.device != dy.device:
        raise ValueError(f"embedding_grad: ids {tuple(ids.shape)} on {ids.device} and dy {tuple(dy.shape)} on "
                         f"{dy.device} must have one row each, on one device")
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 0:
        raise ValueError(f"embedding_grad: num_embeddings must be an integer >= 0, got {num_embeddings!r}")


def embedding_grad_reference(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """(num_embeddings, D) fp32: each id's rows of ``dy`` (M, D) added in token order.
    On the CPU through torch's embedding backward (its ``index_put_`` adds from
    several threads in no fixed order), on a GPU through the accumulating
    ``index_put_``, which sorts the ids stably and walks each id's rows in turn."""
    check_embedding_grad(ids, dy, num_embeddings)
    rows = dy.float()
    if rows.is_cuda:
        return torch.zeros(num_embeddings, dy.shape[1], dtype=torch.float32, device=dy.device).index_put_(
            (ids,), rows, accumulate=True)
    return torch.ops.aten.embedding_dense_backward(rows, ids, num_embeddings, -1, False)
