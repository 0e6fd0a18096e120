"""The cuda backend's attention (cuDNN's fused flash attention through torch's
SDPA operators): forward, lse and gradients against float64 on representable
inputs, the Triton FP8 forward's o and lse through its backward (the FP8
recipe's pairing), the fused gradient layout, what goes to Triton per call, and
which backend the auto table picks. GPU only: cuDNN has no CPU kernels."""

from __future__ import annotations

import math

import pytest
import torch

from te_fuser import backend
from te_fuser.kernels import cuda as ck
from te_fuser.kernels.cuda import attention as cuda_attn
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.ops.basic.attention import _fused_gradient
from test_attention_kernels import (SHAPES, _context, _randn, check_bf16_at_real_size, check_kernels, dequantized,
                                    exact_attention, fp8_qkv, qkv)
from tolerances import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on a CUDA GPU")

# Tq == Tk (what cuDNN is sent): grouped heads 2:1 and 4:1 and none, odd lengths
SHAPES_SQUARE = [(1, 4, 2, 67, 67, 64), (2, 8, 2, 45, 45, 128), (1, 4, 4, 33, 33, 32)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES_SQUARE)
def test_cudnn_bf16_forward_and_backward_against_float64(shape, causal):
    check_kernels(shape, torch.bfloat16, causal, kernels=ck, name="cuda")


def test_cudnn_fp16_against_float64():
    check_kernels(SHAPES_SQUARE[0], torch.float16, True, kernels=ck, name="cuda")


def test_the_op_layout_in_and_out():
    """q, k, v as views of one fused (B, T, H + 2·Hkv, D) tensor (what the op passes):
    o's merge is a view, and the gradients are the fused input's gradient."""
    B, H, Hkv, T, D = 2, 8, 2, 61, 64
    x = _randn((B, T, H + 2 * Hkv, D), 5, torch.bfloat16)
    heads = x.transpose(1, 2)
    q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    o, lse = ck.attention_forward(q, k, v, True, 0.125)
    assert o.transpose(1, 2).is_contiguous()  # (B, T, H, D) storage
    do = _randn((B, T, H, D), 6, torch.bfloat16).transpose(1, 2)
    got = ck.attention_backward(q, k, v, o, lse, do, True, 0.125)
    fused = _fused_gradient(*got)
    assert fused is not None and tuple(fused.shape) == (B, T, H + 2 * Hkv, D)
    want = ref.attention_backward_reference(*(t.float() for t in (q, k, v, o)), lse, do.float(), True, 0.125)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, "attention_bf16", f"fused-layout {name}", scaled=True)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_fp8_forward_then_cudnn_backward(causal):
    """The FP8 recipe's pairing: the Triton FP8 forward's o and lse (natural log, as
    cuDNN's) into cuDNN's backward on the dequantized operands."""
    shape = (1, 4, 2, 67, 67, 64)
    fp8s, scale_invs = fp8_qkv(*shape, seed=3, scale_invs=(2.0**-5, 2.0**-5, 2.0**-3))
    scale = 1 / math.sqrt(shape[-1])
    o, lse = tk.attention_forward_fp8(*fp8s, *scale_invs, torch.tensor(448.0, device="cuda"), causal, scale,
                                      torch.bfloat16)
    q, k, v = dequantized(fp8s, scale_invs, torch.bfloat16)
    do = _randn(o.shape, 11, torch.bfloat16)
    _, _, grads = exact_attention(q, k, v, causal, scale, do)
    for name, g, want in zip(("dq", "dk", "dv"), ck.attention_backward(q, k, v, o, lse, do, causal, scale), grads):
        assert_close(g, want, "attention_fp8_backward", _context(f"fp8 forward, cuDNN {name}", shape, "bf16", causal),
                     scaled=True)


@pytest.mark.parametrize("T,D,causal", [(1000, 64, True), (4096, 128, True), (1024, 64, False)])
def test_cudnn_at_real_sizes(T, D, causal):
    check_bf16_at_real_size(ck, T, D, causal, "gpu cuda")


def test_what_cudnn_does_not_take_goes_to_triton():
    q, k, v, do = qkv(*SHAPES[1], torch.bfloat16)  # Tq 67, Tk 45
    assert "different lengths" in ck.attention_forward_unsupported_reason(q, k)
    assert "takes bf16 and fp16" in ck.attention_forward_unsupported_reason(q.float(), k.float())
    fwd = backend.resolve("attention_forward", "cuda", backend="cuda").fn
    o, lse = fwd(q, k, v, True, 0.125)
    o_t, lse_t = tk.attention_forward(q, k, v, True, 0.125)
    assert torch.equal(o, o_t) and torch.equal(lse, lse_t)
    with pytest.raises(ValueError, match="attention_forward: queries and keys of different lengths"):
        ck.attention_forward(q, k, v, True, 0.125)


def test_auto_sends_the_forwards_and_the_deterministic_backward_to_cuda():
    """The bf16 forward to cuDNN, the FP8 forward to our Hopper kernel, the backward to
    the cuda backend, whose default choice is deterministic (ours or Triton's)."""
    assert cuda_attn._backward_kernel["name"] == "fastest"
    with backend.use_backend("auto"):
        assert backend.resolve("attention_forward", "cuda").backend == "cuda"
        assert backend.resolve("attention_backward", "cuda").backend == "cuda"
        assert backend.resolve("attention_forward_fp8", "cuda").backend == "cuda"


def test_cudnn_forward_then_triton_backward_against_float64():
    """What auto runs: cuDNN's o (in q's stride order) and lse into the Triton backward."""
    shape = SHAPES_SQUARE[1]
    q, k, v, do = qkv(*shape, torch.bfloat16, seed=7)
    scale = 1 / math.sqrt(shape[-1])
    o, lse = ck.attention_forward(q, k, v, True, scale)
    _, _, grads = exact_attention(q, k, v, True, scale, do)
    for name, g, want in zip(("dq", "dk", "dv"), tk.attention_backward(q, k, v, o, lse, do, True, scale), grads):
        assert_close(g, want, "attention_bf16", _context(f"cuDNN forward, triton {name}", shape, "bf16", True),
                     scaled=True)


def test_deterministic_mode_keeps_the_backward_off_cudnn():
    """With cuDNN's backward chosen, deterministic algorithms refuse it (and the backend
    sends the call to Triton); the default choice runs under them."""
    q, k, v, do = qkv(*SHAPES_SQUARE[0], torch.bfloat16)
    o, lse = ck.attention_forward(q, k, v, True, 0.125)
    want = tk.attention_backward(q, k, v, o, lse, do, True, 0.125)
    torch.use_deterministic_algorithms(True, warn_only=True)
    previous = cuda_attn.set_backward_kernel("cudnn")
    try:
        assert "not deterministic" in ck.attention_backward_unsupported_reason(q, k)
        with pytest.raises(ValueError, match="attention_backward: cuDNN's attention backward is not deterministic"):
            ck.attention_backward(q, k, v, o, lse, do, True, 0.125)
        bwd = backend.resolve("attention_backward", "cuda", backend="cuda").fn
        assert all(torch.equal(g, w) for g, w in zip(bwd(q, k, v, o, lse, do, True, 0.125), want))
        cuda_attn.set_backward_kernel(previous)
        assert ck.attention_backward_unsupported_reason(q, k) is None
        assert all(torch.equal(g, w) for g, w in zip(ck.attention_backward(q, k, v, o, lse, do, True, 0.125), want))
    finally:
        cuda_attn.set_backward_kernel(previous)
        torch.use_deterministic_algorithms(False)
