"""The one-kernel attention backward (``BACKWARD = "ordered"``): its gradients
against float64 on the shapes the two-kernel backward is held to, dk and dv
bit for bit the two kernels' (the same loop), dq within the tolerance of theirs
and the same bits run to run (the parts of a dq tile are added in key-block
order, whatever the timing), the counters' order check, and the switch.

Without a GPU the kernels run under the interpreter (programs one after another,
the turns checked instead of waited for); with one, compiled, where the
programs wait for their turns, and the tests marked ``gpu`` add real sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.triton import attention as attn
from test_attention_kernels import (DEVICE, SHAPES, _context, check_bf16_at_real_size, check_kernels, gpu, qkv)
from tolerances import assert_bitwise, assert_close


@pytest.fixture
def ordered():
    old = attn.set_backward("ordered")
    yield
    attn.set_backward(old)


def _both(shape, dtype, causal, seed=0):
    """The two backwards' (dq, dk, dv) of the same inputs, the ordered one twice."""
    q, k, v, do = qkv(*shape, dtype, seed)
    scale = 1 / math.sqrt(shape[-1])
    o, lse = tk.attention_forward(q, k, v, causal, scale)
    old = attn.set_backward("split")
    try:
        split = tk.attention_backward(q, k, v, o, lse, do, causal, scale)
        attn.set_backward("ordered")
        first = tk.attention_backward(q, k, v, o, lse, do, causal, scale)
        again = tk.attention_backward(q, k, v, o, lse, do, causal, scale)
    finally:
        attn.set_backward(old)
    return split, first, again


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_ordered_backward_against_float64(shape, causal, ordered):
    check_kernels(shape, torch.bfloat16, causal, name="ordered")


@pytest.mark.parametrize("shape,dtype,causal,layout", [
    ((1, 8, 2, 67, 45, 64), torch.float16, True, "contiguous"),
    ((1, 8, 2, 67, 45, 64), torch.float32, False, "contiguous"),
    ((1, 2, 1, 40, 40, 128), torch.bfloat16, True, "contiguous"),  # the head dim of the benchmarks
    ((1, 4, 1, 33, 50, 16), torch.float32, True, "contiguous"),    # the smallest head dim, 4:1 groups
    ((2, 4, 2, 35, 35, 32), torch.bfloat16, False, "bthd"),         # strided heads, no copies
])
def test_ordered_backward_other_dtypes_head_dims_and_layouts(shape, dtype, causal, layout, ordered):
    check_kernels(shape, dtype, causal, layout=layout, name="ordered")


@pytest.mark.parametrize("shape,causal", [((1, 8, 2, 67, 45, 64), True), ((2, 4, 4, 45, 67, 64), False),
                                          ((1, 4, 2, 100, 100, 32), True)])
def test_ordered_dk_dv_are_the_split_kernels_bits_and_dq_is_the_same_run_to_run(shape, causal):
    """dk and dv come from the dk / dv kernel's loop, unchanged: the same bits. dq
    adds the same products in the same key order, but as a sum of products where
    the dq kernel accumulates in the tensor cores: within the bf16 tolerance of
    it, and the same bits every run."""
    split, first, again = _both(shape, torch.bfloat16, causal)
    assert_bitwise(first[1], split[1], "ordered dk against split")
    assert_bitwise(first[2], split[2], "ordered dv against split")
    assert_close(first[0], split[0].double(), "attention_bf16", _context("ordered dq against split", shape, "bf16",
                                                                         causal), scaled=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        assert_bitwise(a, b, f"ordered {name}, run to run")


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter checks the turns; a GPU waits for them")
def test_a_part_added_out_of_turn_is_an_error(monkeypatch, ordered):
    """Counters that do not start at turn 0 (a part added before the ones it must
    follow) fail the call instead of giving other bits."""
    monkeypatch.setattr(attn, "_turn_counters", lambda n, device: torch.ones(n, dtype=torch.int32, device=device))
    q, k, v, do = qkv(1, 2, 1, 40, 40, 32, torch.bfloat16)
    o, lse = tk.attention_forward(q, k, v, True, 0.2)
    with pytest.raises(RuntimeError, match="out of key-block order"):
        tk.attention_backward(q, k, v, o, lse, do, True, 0.2)


def test_set_backward_names_the_kernels():
    with pytest.raises(ValueError, match=r"set_backward: kernel must be one of \('split', 'ordered'\)"):
        attn.set_backward("fused")
    assert attn.BACKWARD == "split"


def test_ordered_backward_of_an_empty_batch(ordered):
    q, k, v, do = qkv(0, 4, 2, 8, 8, 32, torch.bfloat16)
    o, lse = tk.attention_forward(q, k, v, True, 0.2)
    dq, dk, dv = tk.attention_backward(q, k, v, o, lse, do, True, 0.2)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_the_op_trains_through_the_ordered_backward(ordered, monkeypatch):
    """DotProductAttention's gradients on the triton backend with the ordered
    backward in force come from it and are the float64 reference's."""
    import te_fuser as te

    calls = []
    kernel = attn._ordered_backward
    monkeypatch.setattr(attn, "_ordered_backward", lambda *args: calls.append(1) or kernel(*args))
    torch.manual_seed(0)
    H, Hkv, D, T = 4, 2, 32, 37
    op = te.ops.DotProductAttention(H, D, num_kv_heads=Hkv, causal=True)
    x = torch.randn(2, T, (H + 2 * Hkv) * D, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    with te.backend.use_backend("triton"):
        y = te.ops.Sequential(op)(x)
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert calls == [1]
    x64 = x.detach().double().requires_grad_()
    q, k, v = x64.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2).split((H, Hkv, Hkv), dim=1)
    o64, lse64 = ref.attention_forward_reference(q, k, v, True, 1 / math.sqrt(D))
    (want,) = torch.autograd.grad(o64.transpose(1, 2).flatten(-2), x64, dy.double())
    assert_close(dx, want, "attention_bf16", "DotProductAttention dx under the ordered backward", scaled=True)


# ------------------------------------------------------------- GPU, real sizes


@gpu
@pytest.mark.parametrize("T,D,causal", [(T, D, causal) for T in (1000, 4096) for D in (64, 128)
                                        for causal in (False, True)])
def test_gpu_ordered_backward_at_real_sizes(T, D, causal, ordered):
    check_bf16_at_real_size(tk, T, D, causal, name="gpu ordered")


@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_ordered_backward_is_the_same_run_to_run_under_load(D):
    """Many programs at once (B 4, 16 heads, T 2048), where the turns are waited
    for: the same bits ten times, dk and dv the split kernels'."""
    shape = (4, 16, 16, 2048, 2048, D)
    split, first, _ = _both(shape, torch.bfloat16, True, seed=D)
    assert_bitwise(first[1], split[1], "ordered dk against split")
    assert_bitwise(first[2], split[2], "ordered dv against split")
    q, k, v, do = qkv(*shape, torch.bfloat16, D)
    scale = 1 / math.sqrt(D)
    o, lse = tk.attention_forward(q, k, v, True, scale)
    old = attn.set_backward("ordered")
    try:
        for _ in range(10):
            got = tk.attention_backward(q, k, v, o, lse, do, True, scale)
            for name, a, b in zip(("dq", "dk", "dv"), got, first):
                assert_bitwise(a, b, f"ordered {name}, run to run")
    finally:
        attn.set_backward(old)
