"""The embedding's weight gradient, deterministic and parallel: ``embedding_grad``.

``dw[v] = sum of dy[i] over the tokens i with ids[i] == v``, in fp32. The ids are
sorted stably (each id's tokens stay in token order) and each id's range of the
sorted order is found by a binary search; one program per id and block of
features then walks its tokens ``ROWS`` at a time, gathering ``ROWS`` rows of dy
at once and adding their sum (a fixed tree) to its accumulator, with ``STAGES``
steps' loads in flight (the loop's software pipeline). Nothing adds in arrival
order, so a backward gives the same bits on every run.

Why not torch's accumulating ``index_put_``, which is deterministic too: it adds
an id's rows one after another, each add waiting for the load before it, in 8
warps per id of a 1024-wide row. Uniform ids read about 64 rows each; a byte-level
model on real text reads the space about 4,800 times in a 16,384-token batch, and
that one id's serial walk then held the end of every backward for milliseconds.
Here the walk loads ``ROWS`` rows per step, several steps ahead, in ``D / BLOCK_F``
programs side by side.

The order (token order in groups of ``ROWS``, each group a tree) is not the CPU
path's one-after-another order, so the GPU's bits are its own; both are within
fp32's rounding of the float64 sum (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.embedding import check_embedding_grad
from ._common import cdiv
from ._launch import launch

__all__ = ["embedding_grad"]

ROWS = 32  # dy rows gathered per step of an id's walk
BLOCK_F = 64  # features per program: an id read thousands of times walks in D / 64 programs at once
STAGES = 4  # steps of a walk whose loads are in flight together (the loop's software pipeline)


@triton.jit
def _embedding_grad_kernel(dy_ptr, perm_ptr, bounds_ptr, dw_ptr, D, stride_dy, stride_dw,
                           ROWS: tl.constexpr, BLOCK_F: tl.constexpr, STAGES: tl.constexpr):
    v = tl.program_id(0).to(tl.int64)  # the id
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < D
    start = tl.load(bounds_ptr + v)
    end = tl.load(bounds_ptr + v + 1)
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)
    for j in tl.range(start, end, ROWS, num_stages=STAGES):
        r = j + tl.arange(0, ROWS)
        r_ok = r < end
        tokens = tl.load(perm_ptr + r, mask=r_ok, other=0).to(tl.int64)  # (ROWS,) in token order
        tile = tl.load(dy_ptr + tokens[:, None] * stride_dy + f[None, :], mask=r_ok[:, None] & f_ok[None, :],
                       other=0.0).to(tl.float32)  # (ROWS, BLOCK_F)
        acc += tl.sum(tile, axis=0)
    tl.store(dw_ptr + v * stride_dw + f, acc, mask=f_ok)


def embedding_grad(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """:func:`embedding_grad_reference`'s (num_embeddings, D) fp32, each id's rows in
    groups of ``ROWS`` in token order (``dy`` (M, D) of any float dtype, widened as
    read). The ids must lie in [0, num_embeddings) (the op checks them in its forward)."""
    check_embedding_grad(ids, dy, num_embeddings)
    M, D = dy.shape
    dw = torch.empty((num_embeddings, D), dtype=torch.float32, device=dy.device)
    if num_embeddings == 0 or D == 0:
        return dw
    if M == 0:
        return dw.zero_()
    sorted_ids, perm = torch.sort(ids, stable=True)  # (M,) each: tokens grouped by id, in token order
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_embeddings + 1, device=ids.device))  # (V + 1,)
    dy = dy.contiguous()
    launch(_embedding_grad_kernel, (num_embeddings, cdiv(D, BLOCK_F)), dy, perm, bounds, dw, D, dy.stride(0),
           dw.stride(0), ROWS=ROWS, BLOCK_F=BLOCK_F, STAGES=STAGES, num_warps=4)
    return dw
