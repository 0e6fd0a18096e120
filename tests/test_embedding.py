"""te.ops.Embedding: the lookup and its scatter-add backward against torch's, and a
weight tied to a te Linear head (both read the one Parameter live)."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te


def test_lookup_and_gradient_match_torch_with_repeated_tokens():
    torch.manual_seed(0)
    te_emb = te.ops.Embedding(50, 24)
    torch_emb = torch.nn.Embedding(50, 24)
    torch_emb.load_state_dict(te_emb.state_dict())  # the same key: weight
    idx = torch.tensor([[1, 7, 7, 49], [0, 1, 1, 1]])
    dy = torch.randn(2, 4, 24)
    y_te, y_torch = te_emb(idx), torch_emb(idx)
    assert torch.equal(y_te, y_torch)
    y_te.backward(dy)
    y_torch.backward(dy)
    torch.testing.assert_close(te_emb.weight.grad, torch_emb.weight.grad, rtol=1e-6, atol=1e-6)
    assert te_emb.weight.grad[2].abs().sum() == 0


def test_bf16_weight_accumulates_its_gradient_in_fp32():
    emb = te.ops.Embedding(4, 8, dtype=torch.bfloat16)
    idx = torch.zeros(300, dtype=torch.long)
    emb(idx).backward(torch.full((300, 8), 1.0 / 3, dtype=torch.bfloat16))
    expected = (torch.full((300,), 1.0 / 3, dtype=torch.bfloat16).float().sum()).to(torch.bfloat16)
    assert emb.weight.grad.dtype == torch.bfloat16 and torch.all(emb.weight.grad[0] == expected)


@pytest.mark.parametrize("recipe", [None, te.recipe.Float8CurrentScaling()], ids=["bf16", "current"])
def test_a_weight_tied_to_a_te_linear_head_is_read_live_and_gets_both_gradients(recipe):
    torch.manual_seed(0)
    emb = te.ops.Embedding(64, 32)
    head = te.ops.Sequential(te.ops.Linear(32, 64, bias=False))
    idx = torch.randint(0, 64, (4, 8))
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        head(emb(idx)).sum().backward()  # a plan built before the tying
    head[0].linear.weight = emb.weight  # tie after the first step
    emb.weight.grad = None
    with torch.no_grad():
        emb.weight.mul_(0.5)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        logits = head(emb(idx))
    logits.sum().backward()
    w = emb.weight.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.embedding(idx, w) @ w.t()
    ref.sum().backward()
    for got, want in ((logits, ref), (emb.weight.grad, w.grad)):  # FP8: relative to the largest element
        atol = 0.125 * want.abs().max().item() if recipe is not None else 1e-5
        torch.testing.assert_close(got, want, rtol=0.25 if recipe is not None else 1e-5, atol=atol)
    assert head[0].weight is emb.weight


def test_bad_inputs_are_named():
    emb = te.ops.Embedding(10, 4)
    with pytest.raises(TypeError, match="integer token ids"):
        emb(torch.zeros(3))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        emb(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"Embedding\.num_embeddings"):
        te.ops.Embedding(0, 4)


def test_each_row_sums_its_gradients_in_token_order_on_every_run():
    """A batch that reads each of 16 rows about 256 times, with several CPU threads:
    the weight gradient is the fp32 sum of each row's gradients taken one after
    another in token order, bit for bit, on every backward (torch's CPU
    ``index_put_`` adds from several threads, in no fixed order)."""
    emb = te.ops.Embedding(16, 64)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 16, (4096,), generator=gen)
    dy = torch.randn(4096, 64, generator=gen)
    want = torch.zeros(16, 64)
    for i in range(idx.numel()):
        want[idx[i]] += dy[i]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        for _ in range(3):
            emb.weight.grad = None
            emb(idx).backward(dy)
            assert torch.equal(emb.weight.grad, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's backward runs on a GPU only")
def test_the_gradient_is_the_same_bits_every_run_on_the_gpu():
    """A batch that reads each of 256 rows about 64 times (a byte-level model's
    embedding): the weight gradient is bit for bit the same on every backward
    (a scatter-add with float atomics is not), and equals the fp64 sum to fp32
    (``tests/test_triton_embedding.py`` has the skewed batch of real text)."""
    emb = te.ops.Embedding(256, 512, device="cuda")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (16, 1024), generator=gen).cuda()
    dy = torch.randn(16, 1024, 512, generator=gen).cuda()
    grads = []
    for _ in range(4):
        emb.weight.grad = None
        emb(idx).backward(dy)
        grads.append(emb.weight.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads[1:])
    want = torch.zeros(256, 512, dtype=torch.float64, device="cuda").index_add_(0, idx.reshape(-1),
                                                                               dy.reshape(-1, 512).double())
    torch.testing.assert_close(grads[0].double(), want, rtol=1e-5, atol=1e-4)


def test_a_compiled_lookup_and_its_gradient_are_the_eager_ones():
    """A lookup under ``torch.compile(fullgraph=True)`` traces whole: its backward's
    kernel is one opaque op (``te_fuser::embedding_grad``) in the compiled backward,
    the output and weight gradient those of eager."""
    torch.manual_seed(0)
    emb = te.ops.Embedding(40, 16)
    idx = torch.randint(0, 40, (3, 50))
    dy = torch.randn(3, 50, 16)
    want = emb(idx)
    want.backward(dy)
    want_grad, emb.weight.grad = emb.weight.grad.clone(), None
    torch._dynamo.reset()
    got = torch.compile(lambda ids: emb(ids) * 1.0, backend="aot_eager", fullgraph=True)(idx)
    got.backward(dy)
    assert torch.equal(got, want) and torch.equal(emb.weight.grad, want_grad)
