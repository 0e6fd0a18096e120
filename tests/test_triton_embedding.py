"""``kernels/triton/embedding.py``: the embedding's weight gradient against float64,
the same bits on every call, with one id read by a third of the tokens (a
byte-level model's space on real text); under the interpreter on the CPU, at the
yardstick GPT's batch on a GPU."""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels.triton.embedding import BLOCK_F, ROWS, embedding_grad
from tolerances import assert_close

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU tensors without a GPU


def _skewed(num, tokens, dim, dtype=torch.float32, device="cpu", seed=0):
    """ids with id 3 read by a third of the tokens, the others uniform; dy (tokens, dim)
    off-centre (-2.3 + 0.5·randn), so that an id's sum grows with its reads."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num, (tokens,), generator=gen)
    ids[torch.randperm(tokens, generator=gen)[: tokens // 3]] = min(3, num - 1)
    dy = (-2.3 + 0.5 * torch.randn(tokens, dim, generator=gen)).to(dtype)
    return ids.to(device), dy.to(device)


def _exact(ids, dy, num):
    return torch.zeros(num, dy.shape[1], dtype=torch.float64, device=dy.device).index_add_(0, ids, dy.double())


@pytest.mark.parametrize("num,tokens,dim", [(16, 700, 40), (50, 300, BLOCK_F + 72), (5, 3 * ROWS + 1, 8), (9, 1, 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_gradient_is_the_float64_sum_and_the_same_bits_every_call(num, tokens, dim, dtype):
    """Rows of ids nobody read are zeros; the others the float64 sum to fp32, bit for
    bit the same on a second call. bf16 gradients are read as they are (widened)."""
    ids, dy = _skewed(num, tokens, dim, dtype, DEVICE)
    dw = embedding_grad(ids, dy, num)
    assert dw.shape == (num, dim) and dw.dtype == torch.float32
    assert_close(dw, _exact(ids, dy, num), "embedding_grad_fp32", f"{num}x{dim} from {tokens} {dtype}", scaled=True)
    unread = torch.ones(num, dtype=torch.bool, device=DEVICE)
    unread[ids] = False
    assert torch.all(dw[unread] == 0)
    assert torch.equal(dw, embedding_grad(ids, dy, num))


def test_the_reference_adds_each_ids_rows_in_token_order():
    """The CPU oracle: one row after another in token order, bit for bit, and the
    dispatcher's choice for CPU tensors; the Triton kernel sits beside it within
    fp32's rounding."""
    from te_fuser import backend
    from te_fuser.kernels.reference import embedding_grad_reference

    ids, dy = _skewed(16, 500, 24)
    want = torch.zeros(16, 24)
    for i in range(ids.numel()):
        want[ids[i]] += dy[i]
    assert torch.equal(embedding_grad_reference(ids, dy, 16), want)
    assert backend.resolve("embedding_grad", torch.device("cpu")).backend == "reference"
    assert_close(embedding_grad(ids.to(DEVICE), dy.to(DEVICE), 16).cpu(), want.double(), "embedding_grad_fp32", "triton beside the reference",
                 scaled=True)


def test_no_tokens_gives_zeros_and_bad_ids_are_named():
    dw = embedding_grad(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 6), 4)
    assert dw.shape == (4, 6) and torch.all(dw == 0)
    with pytest.raises(TypeError, match="ids must be a 1-D int64"):
        embedding_grad(torch.zeros(3, dtype=torch.int32), torch.zeros(3, 6), 4)
    with pytest.raises(ValueError, match="one row each"):
        embedding_grad(torch.zeros(2, dtype=torch.int64), torch.zeros(3, 6), 4)
    with pytest.raises(TypeError, match="dy must be a 2-D float"):
        embedding_grad(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 6, dtype=torch.int32), 4)


@needs_gpu
def test_the_yardstick_batch_on_the_gpu():
    """16,384 tokens of a 256-byte vocabulary, a third of them one byte, width 1024:
    the float64 sum to fp32, and the same bits on every call."""
    ids, dy = _skewed(256, 16384, 1024, device="cuda", seed=1)
    grads = [embedding_grad(ids, dy, 256) for _ in range(3)]
    assert all(torch.equal(g, grads[0]) for g in grads[1:])
    assert_close(grads[0], _exact(ids, dy, 256), "embedding_grad_fp32", "yardstick batch", scaled=True)
