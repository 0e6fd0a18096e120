"""The hand-written Hopper bf16 / fp16 attention forward (``kernels/cuda/
attention_hp_kernels.cu`` through ``te_fuser.kernels.cuda.attention.
attention_forward_hopper``): o and lse against float64 attention on odd lengths
(one key tile and several, Tq above and below Tk, grouped kv heads, head dims 64
and 128, causal and not), with the Triton backward fed its o and lse (the pairing
the auto table would run) against float64 autograd, at real sizes against the
reference in fp32, uniform scores (P V apart from Q Kᵀ), the fused QKV tensor's
views read in place, the same bits on every run and with or without the
consumers' turns, and what it refuses with a reason. The kernel runs on sm_90a
only; the reasons also run here on the CPU."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from te_fuser.kernels import triton as tk
from te_fuser.kernels.triton import attention as triton_attention
from te_fuser.kernels.cuda import attention as cuda_attn
from test_attention_kernels import GPU_CASES, SHAPES, _randn, check_bf16_at_real_size, check_kernels
from test_cuda_attention_fp8 import hopper
from tolerances import assert_close


class HopperForward:
    """The Hopper forward beside the Triton backward, as ``check_kernels`` takes a backend."""

    attention_forward = staticmethod(cuda_attn.attention_forward_hopper)
    attention_backward = staticmethod(tk.attention_backward)


# test_attention_kernels' odd lengths (head dim 64), and head dim 128 over several key tiles
HOPPER_SHAPES = SHAPES + [(1, 4, 1, 300, 300, 128), (2, 2, 2, 1000, 1000, 128), (1, 8, 2, 200, 130, 128)]


@contextlib.contextmanager
def _turns(turns: bool):
    previous = cuda_attn.set_hopper_schedule(turns=turns)
    try:
        yield
    finally:
        cuda_attn.set_hopper_schedule(*previous)


@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", HOPPER_SHAPES)
def test_forward_and_the_triton_backward_against_float64(shape, causal):
    check_kernels(shape, torch.bfloat16, causal, kernels=HopperForward, name="cuda hopper")


@hopper
@pytest.mark.parametrize("shape", [HOPPER_SHAPES[0], HOPPER_SHAPES[4]])
def test_fp16_against_float64(shape):
    check_kernels(shape, torch.float16, True, kernels=HopperForward, name="cuda hopper")


@hopper
@pytest.mark.parametrize("T,D,causal", GPU_CASES)
def test_at_real_sizes(T, D, causal):
    check_bf16_at_real_size(HopperForward, T, D, causal, name="cuda hopper")


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_uniform_scores_average_the_values(D):
    """q = 0: every key a row sees has probability 1 (exact in bf16), so o is the
    mean of the values the row sees (rounded once) and lse ln(keys seen): P V
    through V's transposed descriptor, the masks and the sums, apart from Q Kᵀ."""
    B, H, Hkv, T = 1, 4, 2, 300
    q = torch.zeros(B, H, T, D, dtype=torch.bfloat16, device="cuda")
    k = _randn((B, Hkv, T, D), 3, torch.bfloat16)
    v = _randn((B, Hkv, T, D), 4, torch.bfloat16)
    o, lse = cuda_attn.attention_forward_hopper(q, k, v, True, 1 / math.sqrt(D))
    seen = torch.ones(T, T, dtype=torch.float64).tril()
    counts = seen.sum(1)
    want = (seen @ v.double().cpu().repeat_interleave(H // Hkv, dim=1)) / counts[:, None]
    assert_close(o.cpu(), want, "attention_bf16", f"uniform scores D={D}", scaled=True)
    assert_close(lse.cpu(), torch.log(counts).expand(B, H, T), "attention_fp32", f"uniform lse D={D}")


@hopper
def test_reads_the_fused_qkv_views_in_place():
    """q, k, v as head ranges of one fused (B, T, H + 2·Hkv, D) tensor: the same bits
    as from contiguous copies, and o stored (B, T, H, D)."""
    B, H, Hkv, T, D = 2, 8, 2, 200, 128
    heads = _randn((B, T, H + 2 * Hkv, D), 9, torch.bfloat16).transpose(1, 2)
    views = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    o, lse = cuda_attn.attention_forward_hopper(*views, True, 1 / math.sqrt(D))
    o_c, lse_c = cuda_attn.attention_forward_hopper(*(t.contiguous() for t in views), True, 1 / math.sqrt(D))
    assert o.transpose(1, 2).is_contiguous()
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_the_same_bits_on_every_run_and_with_or_without_turns(D):
    q, k, v = (_randn((2, heads, 777, D), seed, torch.bfloat16) for seed, heads in ((1, 8), (2, 2), (3, 2)))
    first = cuda_attn.attention_forward_hopper(q, k, v, True, 0.09)
    for turns in (True, False, True):
        with _turns(turns):
            again = cuda_attn.attention_forward_hopper(q, k, v, True, 0.09)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), turns


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_the_items_dealt_either_way_give_the_same_bits(D):
    """Over more items than three rounds of the persistent blocks: the rounds dealt
    forwards and backwards in turn (the default) and forwards every round give the
    same o and lse."""
    q, k, v = (_randn((4, heads, 900, D), seed, torch.bfloat16) for seed, heads in ((4, 16), (5, 4), (6, 4)))
    assert 8 * 4 * 16 > 3 * torch.cuda.get_device_properties(0).multi_processor_count
    mirrored = cuda_attn.attention_forward_hopper(q, k, v, True, 0.09)
    previous = cuda_attn.set_hopper_schedule(mirrored=False)
    try:
        forwards = cuda_attn.attention_forward_hopper(q, k, v, True, 0.09)
    finally:
        cuda_attn.set_hopper_schedule(*previous)
    assert all(torch.equal(a, b) for a, b in zip(mirrored, forwards))


def test_the_backends_forward_kernel_is_a_choice_of_two():
    """set_forward_kernel: cuDNN's (the default) or ours, the previous one returned; a
    name of neither refused before anything changes."""
    assert cuda_attn._forward_kernel["name"] == "cudnn"
    assert cuda_attn.set_forward_kernel("hopper") == "cudnn"
    try:
        with pytest.raises(ValueError, match="set_forward_kernel: name must be one of"):
            cuda_attn.set_forward_kernel("flash")
        assert cuda_attn._forward_kernel["name"] == "hopper"
    finally:
        assert cuda_attn.set_forward_kernel("cudnn") == "hopper"


@hopper
def test_the_backends_forward_runs_the_hopper_kernel_when_chosen():
    """With "hopper" the cuda backend's forward gives this kernel's bits (the operands
    it takes), and cuDNN's again after; a head dim it does not take goes to cuDNN."""
    from te_fuser.kernels import cuda as ck

    q, k, v = (_randn((2, heads, 300, 128), seed, torch.bfloat16) for seed, heads in ((1, 8), (2, 2), (3, 2)))
    mine = cuda_attn.attention_forward_hopper(q, k, v, True, 0.09)
    cudnn = ck.attention_forward(q, k, v, True, 0.09)
    previous = cuda_attn.set_forward_kernel("hopper")
    try:
        chosen = ck.attention_forward(q, k, v, True, 0.09)
        q32, k32, v32 = (_randn((1, 2, 40, 32), seed, torch.bfloat16) for seed in (4, 5, 6))
        small = ck.attention_forward(q32, k32, v32, True, 0.2)  # head dim 32: cuDNN's
    finally:
        cuda_attn.set_forward_kernel(previous)
    assert all(torch.equal(a, b) for a, b in zip(chosen, mine))
    assert all(torch.equal(a, b) for a, b in zip(ck.attention_forward(q, k, v, True, 0.09), cudnn))
    want = ck.attention_forward(q32, k32, v32, True, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(small, want))


def test_reasons_name_what_the_kernel_does_not_take():
    """Checked before anything runs, on any machine."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    reason = cuda_attn.attention_forward_hopper_unsupported_reason(q, q)
    assert reason is not None
    if q.device.type == "cpu":
        assert "CUDA tensors" in reason
    q32 = q.float()
    assert "bfloat16 and float16" in cuda_attn.attention_forward_hopper_unsupported_reason(q32, q32)
    with pytest.raises(ValueError, match="attention_forward_hopper: "):
        cuda_attn.attention_forward_hopper(q, q, q, True, 0.125)


@hopper
def test_layouts_it_refuses_on_the_gpu():
    q = torch.zeros(1, 2, 8, 32, dtype=torch.bfloat16, device="cuda")
    assert "head dims" in cuda_attn.attention_forward_hopper_unsupported_reason(q, q)
    odd = torch.zeros(1, 2, 8, 68, dtype=torch.bfloat16, device="cuda")[..., :64]  # rows 136 bytes apart
    assert "16-byte" in cuda_attn.attention_forward_hopper_unsupported_reason(odd, odd)
    with pytest.raises(ValueError, match="head dims"):
        cuda_attn.attention_forward_hopper(q, q, q, True, 0.125)


# -- the backward's two forms, then the dk / dv kernel ------------------------------------


def _backward_with_hopper_dkdv(q, k, v, o, lse, do, causal, scale):
    """Triton's dq kernel (with the delta it stores), then our Hopper dk and dv."""
    dq, delta = triton_attention.attention_dq(q, k, v, o, lse, do, causal, scale)
    return (dq, *cuda_attn.attention_dkdv_hopper(q, k, v, o, lse, do, causal, scale, delta=delta))


class HopperDkdv:
    """Triton's forward, then the backward with our dk / dv kernel, as ``check_kernels`` takes a backend."""

    attention_forward = staticmethod(tk.attention_forward)
    attention_backward = staticmethod(_backward_with_hopper_dkdv)


class HopperBackward:
    """Triton's forward, then our one-kernel Hopper backward, as ``check_kernels`` takes a backend."""

    attention_forward = staticmethod(tk.attention_forward)
    attention_backward = staticmethod(cuda_attn.attention_backward_hopper)


FORMS = {"dk/dv": (HopperDkdv, "cuda hopper dkdv"), "one kernel": (HopperBackward, "cuda hopper backward")}


@hopper
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", HOPPER_SHAPES)
def test_backward_against_float64(shape, causal, form):
    """Both forms (Triton's dq then our dk / dv kernel; our one kernel): dq, dk and dv
    on odd lengths (partial blocks of queries and keys, Tq above and below Tk,
    grouped kv heads summed over their query heads, head dims 64 and 128) against
    float64 attention fed the same o and lse."""
    kernels, name = FORMS[form]
    check_kernels(shape, torch.bfloat16, causal, kernels=kernels, name=name)


@hopper
@pytest.mark.parametrize("form", list(FORMS))
def test_backward_fp16_against_float64(form):
    kernels, name = FORMS[form]
    check_kernels(HOPPER_SHAPES[4], torch.float16, True, kernels=kernels, name=name)


@hopper
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("T,D,causal", GPU_CASES)
def test_backward_at_real_sizes(T, D, causal, form):
    kernels, name = FORMS[form]
    check_bf16_at_real_size(kernels, T, D, causal, name=name)

def _the_same_bits_thrice(kernel, D):
    """``kernel``'s gradients at T 777 (grouped kv heads 8:2, causal), asserted the same
    bits in three more calls: (its first result, its operands)."""
    q, k, v, do = (_randn((2, heads, 777, D), seed, torch.bfloat16) for seed, heads in ((1, 8), (2, 2), (3, 2), (4, 8)))
    o, lse = tk.attention_forward(q, k, v, True, 0.09)
    first = kernel(q, k, v, o, lse, do, True, 0.09)
    for _ in range(3):
        again = kernel(q, k, v, o, lse, do, True, 0.09)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    return first, (q, k, v, o, lse, do)


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_dkdv_the_same_bits_on_every_run(D):
    """No atomics: every dk and dv is written once, by the block of its keys."""
    first, (q, k, v, o, lse, do) = _the_same_bits_thrice(cuda_attn.attention_dkdv_hopper, D)
    delta = triton_attention.attention_dq(q, k, v, o, lse, do, True, 0.09)[1]  # the same sums, another order
    beside = cuda_attn.attention_dkdv_hopper(q, k, v, o, lse, do, True, 0.09, delta=delta)
    for a, b in zip(first, beside):
        assert_close(a, b, "attention_bf16", f"delta from torch and from Triton's dq kernel, D={D}", scaled=True)


@hopper
def test_dkdv_refuses_what_its_tensor_maps_do_not_describe():
    q = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    shared = torch.zeros(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16).expand(1, 2, 8, 64)
    lse = torch.zeros(1, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="attention_dkdv_hopper: .*tensor maps"):
        cuda_attn.attention_dkdv_hopper(q, shared, q, q, lse, q, True, 0.125)


def test_dkdv_names_what_it_does_not_take():
    """Checked before anything runs, on any machine: CPU tensors, another dtype."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="attention_dkdv_hopper: .*CUDA tensors"):
        cuda_attn.attention_dkdv_hopper(q, q, q, q, lse, q, True, 0.125)
    f32 = q.float()
    with pytest.raises(ValueError, match="attention_dkdv_hopper: "):
        cuda_attn.attention_dkdv_hopper(f32, f32, f32, f32, lse, f32, True, 0.125)


# -- the one kernel: dk / dv with dq added in a fixed order ---------------------------------


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_backward_the_same_bits_on_every_run_and_beside_triton(D):
    """No atomics: the same bits on every run; dq and the delta it writes as close to
    Triton's dq kernel's as bf16 products allow."""
    first, (q, k, v, o, lse, do) = _the_same_bits_thrice(cuda_attn.attention_backward_hopper, D)
    dq_triton = triton_attention.attention_dq(q, k, v, o, lse, do, True, 0.09)[0]
    assert_close(first[0], dq_triton, "attention_bf16", f"dq beside Triton's, D={D}", scaled=True)


@contextlib.contextmanager
def _stages(dq_in_kernel: bool, delta_in_kernel: bool):
    previous = cuda_attn.set_hopper_backward_stages(dq_in_kernel, delta_in_kernel)
    try:
        yield
    finally:
        cuda_attn.set_hopper_backward_stages(*previous)


STAGES = [(True, False), (False, True), (True, True)]


@hopper
@pytest.mark.parametrize("dq_in_kernel,delta_in_kernel", STAGES, ids=["dq", "delta", "dq+delta"])
@pytest.mark.parametrize("B,H,Hkv,Tq,Tk,D", [(2, 4, 4, 1000, 1000, 128), (1, 3, 3, 67, 67, 64), (2, 8, 8, 777, 777, 64),
                                              (1, 4, 4, 200, 330, 128), (1, 4, 4, 330, 200, 128), (2, 8, 2, 500, 500, 128),
                                              (1, 16, 16, 4096, 4096, 128)])
def test_backward_stages_in_the_kernel_give_the_same_bits(B, H, Hkv, Tq, Tk, D, dq_in_kernel, delta_in_kernel):
    """dq stored and delta made in the dk / dv kernel (set_hopper_backward_stages):
    the same dq, dk and dv bits as the kernels before and after it (the same fp32
    chunks converted, delta summed in the columns kernel's order), five calls in a
    row (a claim or a flag that never came would hang one), at odd lengths, Tq above
    and below Tk (delta then made before the kernel), grouped kv heads (likewise)
    and a real size; fp16 too at one shape."""
    for dtype in (torch.bfloat16, torch.float16) if Tq == 1000 else (torch.bfloat16,):
        q = _randn((B, H, Tq, D), 1, dtype)
        k, v = (_randn((B, Hkv, Tk, D), seed, dtype) for seed in (2, 3))
        do = _randn((B, H, Tq, D), 4, dtype)
        o, lse = tk.attention_forward(q, k, v, True, 1 / math.sqrt(D))
        with _stages(False, False):
            want = cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
        with _stages(dq_in_kernel, delta_in_kernel):
            for _ in range(5):
                got = cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
                for name, g, w in zip(("dq", "dk", "dv"), got, want):
                    assert torch.equal(g, w), (f"{name}, {dtype}, (B, H, Hkv, Tq, Tk, D) = {(B, H, Hkv, Tq, Tk, D)}, "
                                               f"stages {(dq_in_kernel, delta_in_kernel)}: max diff "
                                               f"{(g.float() - w.float()).abs().max().item():.3e}")
        assert cuda_attn.set_hopper_backward_stages() == (cuda_attn.BY_SHAPE, False), "the default restored"


@hopper
def test_backward_writes_the_fused_qkv_gradient_layout():
    """Equal lengths: dq, dk and dv are views of one (B, T, H + 2·Hkv, D) buffer, as
    Triton's backward writes them (the fused QKV tensor's gradient, no concatenation)."""
    q, k, v, do = (_randn((2, heads, 300, 64), seed, torch.bfloat16) for seed, heads in ((1, 4), (2, 2), (3, 2), (4, 4)))
    o, lse = tk.attention_forward(q, k, v, True, 0.125)
    dq, dk, dv = cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, True, 0.125)
    base = dq.untyped_storage().data_ptr()
    assert dk.untyped_storage().data_ptr() == base and dv.untyped_storage().data_ptr() == base
    assert dq.stride() == (300 * 8 * 64, 64, 8 * 64, 1) and dk.stride() == dq.stride() == dv.stride()
    want = tk.attention_backward(q, k, v, o, lse, do, True, 0.125)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(g, w, "attention_bf16", f"{name} beside Triton's", scaled=True)


def test_the_backends_backward_kernel_is_a_choice_of_three():
    """set_backward_kernel: the fastest deterministic one (the default), ours wherever
    it runs, or cuDNN's; the previous one returned; another name refused before
    anything changes."""
    assert cuda_attn._backward_kernel["name"] == "fastest"
    assert cuda_attn.set_backward_kernel("hopper") == "fastest"
    try:
        with pytest.raises(ValueError, match="set_backward_kernel: name must be one of"):
            cuda_attn.set_backward_kernel("flash")
        assert cuda_attn._backward_kernel["name"] == "hopper"
        assert cuda_attn.set_backward_kernel("cudnn") == "hopper"
    finally:
        cuda_attn.set_backward_kernel("fastest")


@pytest.mark.parametrize("tk_, d, kv_heads, causal, form", [
    (4096, 64, 16, True, "one kernel"), (2048, 128, 16, True, "one kernel"), (4096, 128, 4, True, "dk/dv"),
    (2048, 64, 16, True, None), (1024, 128, 16, True, None), (1024, 64, 4, True, None),
    (4096, 128, 16, False, None), (4096, 128, 4, False, None)])
def test_the_hopper_backward_is_chosen_where_it_was_measured_faster(tk_, d, kv_heads, causal, form):
    """The shapes of RESULTS.md runs 219-221 on either side of the rule (keys · head
    dim of 2^18 or more, causal; grouped kv heads take the dk / dv kernel after
    Triton's dq), judged from the shapes alone (meta tensors)."""
    q = torch.empty(4, 16, tk_, d, device="meta")
    k = torch.empty(4, kv_heads, tk_, d, device="meta")
    assert cuda_attn.hopper_backward_form(q, k, causal) == form


@hopper
@pytest.mark.parametrize("t, d, kv_heads", [(2048, 128, 2), (2048, 128, 1), (1024, 64, 2)])
def test_the_backends_default_backward_is_ours_or_tritons_by_shape(t, d, kv_heads):
    """The default choice gives the bits of the form the rule names (our one kernel,
    Triton's dq then our dk / dv kernel) or of the Triton kernels, in the fused
    gradient's layout, the same bits on every run."""
    q, k, v, do = (_randn((1, heads, t, d), seed, torch.bfloat16)
                   for seed, heads in ((1, 2), (2, kv_heads), (3, kv_heads), (4, 2)))
    o, lse = tk.attention_forward(q, k, v, True, d ** -0.5)
    form = cuda_attn.hopper_backward_form(q, k, True)
    assert form == {2048: "one kernel" if kv_heads == 2 else "dk/dv", 1024: None}[t]
    kernel = {"one kernel": cuda_attn.attention_backward_hopper, "dk/dv": _backward_with_hopper_dkdv,
              None: tk.attention_backward}[form]
    want = kernel(q, k, v, o, lse, do, True, d ** -0.5)
    got = cuda_attn.attention_backward(q, k, v, o, lse, do, True, d ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(g.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr() for g in got)
    again = cuda_attn.attention_backward(q, k, v, o, lse, do, True, d ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@hopper
def test_the_backends_backward_runs_the_hopper_kernels_when_chosen():
    """With "hopper" the cuda backend's backward gives our kernels' bits, in the fused
    gradient's layout, at a shape the default sends to Triton."""
    q, k, v, do = (_randn((2, heads, 300, 64), seed, torch.bfloat16) for seed, heads in ((1, 4), (2, 2), (3, 2), (4, 4)))
    o, lse = tk.attention_forward(q, k, v, True, 0.125)
    ours = cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, True, 0.125)
    previous = cuda_attn.set_backward_kernel("hopper")
    try:
        got = cuda_attn.attention_backward(q, k, v, o, lse, do, True, 0.125)
    finally:
        cuda_attn.set_backward_kernel(previous)
    assert all(torch.equal(a, b) for a, b in zip(got, ours))
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()


@hopper
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["one kernel", "dk/dv"])
def test_the_attention_op_trains_on_the_hopper_backward_under_auto(kv_heads):
    """The op under auto (cuDNN's forward, the cuda backend's default backward) at a
    shape the rule gives our kernels: the same bits on every run, and the gradient
    of the fused QKV input within the bf16 bound of the Triton backend's."""
    import te_fuser as te
    from te_fuser import backend
    from op_testing import run

    op = te.ops.DotProductAttention(2, 128, kv_heads, causal=True)
    x = _randn((1, 2048, (2 + 2 * kv_heads) * 128), 5, torch.bfloat16)
    dy = _randn((1, 2048, 2 * 128), 6, torch.bfloat16)
    with backend.use_backend("auto"):
        assert backend.resolve("attention_backward", "cuda").backend == "cuda"
        out, grads = run(op, x, dy=dy)
        again = run(op, x, dy=dy)[1]
    with backend.use_backend("triton"):
        out_t, grads_t = run(op, x, dy=dy)
    assert torch.equal(grads["x"], again["x"])
    assert_close(out[0], out_t[0], "attention_bf16", "output beside Triton's", scaled=True)
    assert_close(grads["x"], grads_t["x"], "attention_bf16", "the QKV gradient beside Triton's", scaled=True)


@hopper
def test_a_graphed_step_through_the_hopper_backward_replays_the_eager_bits():
    """An attention sub-layer (QKV projection, attention at a shape the rule gives our
    one kernel, projection) trained eagerly and through ``te.make_graphed_step`` side
    by side: the captured backward (its counters, chunks and tensor maps) replays the
    eager losses, gradients and weights bit for bit."""
    import copy

    import torch.nn.functional as F

    import te_fuser as te

    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(256, 6 * 128), te.ops.DotProductAttention(2, 128, causal=True),
                              te.ops.Linear(256, 256)).to("cuda", torch.bfloat16)
    assert cuda_attn.hopper_backward_form(torch.empty(1, 2, 2048, 128, device="meta"),
                                          torch.empty(1, 2, 2048, 128, device="meta"), True) == "one kernel"

    def trainer(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)

        def step(x, target):
            loss = F.mse_loss(m(x).float(), target)
            loss.backward()
            opt.step()
            return loss

        return opt, step

    eager_model, graphed_model = model, copy.deepcopy(model)
    eager_opt, eager_step = trainer(eager_model)
    _, graphed_step = trainer(graphed_model)
    step = te.make_graphed_step(graphed_step, graphed_model, warmup_steps=1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i in range(4):
        x = torch.randn(1, 2048, 256, device="cuda", generator=gen).bfloat16()
        target = torch.randn(1, 2048, 256, device="cuda", generator=gen)
        eager_opt.zero_grad(set_to_none=True)
        assert torch.equal(eager_step(x, target), step(x, target)), f"step {i}: loss"
        for (name, p), (_, q) in zip(eager_model.named_parameters(), graphed_model.named_parameters()):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad), f"step {i}: {name}"
    assert step.stats.replays == 3  # the captured step replays too


@hopper
@pytest.mark.parametrize("fp8_field", ["fp8_dpa", "fp8_mha"])
def test_fp8_attention_trains_on_the_hopper_backward_under_auto(fp8_field):
    """FP8 attention under auto at a shape the rule gives our one kernel: our FP8
    forward's o and lse into our Hopper backward, the same bits on every run, and the
    QKV input's gradient within the FP8-attention bound of the Triton backend's."""
    import te_fuser as te
    from te_fuser import backend
    from te_fuser import recipe as R
    from op_testing import run

    recipe = R.Float8CurrentScaling(**{fp8_field: True})
    op = te.ops.DotProductAttention(2, 128, causal=True)
    x = _randn((1, 2048, 6 * 128), 7, torch.bfloat16)
    dy = _randn((1, 2048, 2 * 128), 8, torch.bfloat16)
    with backend.use_backend("auto"):
        out, grads = run(op, x, recipe=recipe, dy=dy)
        again = run(op, x, recipe=recipe, dy=dy)[1]
    with backend.use_backend("triton"):
        out_t, grads_t = run(op, x, recipe=recipe, dy=dy)
    assert torch.equal(grads["x"], again["x"])
    assert_close(out[0].float(), out_t[0].float(), "attention_fp8_op", f"{fp8_field} output beside Triton's",
                 scaled=True)
    assert_close(grads["x"].float(), grads_t["x"].float(), "attention_fp8_op",
                 f"{fp8_field} QKV gradient beside Triton's", scaled=True)


def test_backward_stages_are_settings_checked_before_they_change_and_chosen_by_shape():
    """set_hopper_backward_stages takes True, False or BY_SHAPE (None leaves one) and
    names the argument it refuses, changing nothing; by shape, dq is stored in the dk /
    dv kernel at head dim 128 up to 8192 keys (where it was measured faster) and delta
    is made before it. Pure Python: runs without the extension."""
    q128, k128 = torch.empty(1, 2, 64, 128), torch.empty(1, 2, 4096, 128)
    q64, k64 = torch.empty(1, 2, 64, 64), torch.empty(1, 2, 4096, 64)
    long_k = torch.empty(1, 2, 16384, 128)
    previous = cuda_attn.set_hopper_backward_stages()
    try:
        assert previous == (cuda_attn.BY_SHAPE, False)
        assert cuda_attn._in_kernel_stages(q128, k128) == 1
        assert cuda_attn._in_kernel_stages(q64, k64) == 0
        assert cuda_attn._in_kernel_stages(q128, long_k) == 0
        with pytest.raises(ValueError, match="delta_in_kernel must be True, False, 'by shape' or None, got 'yes'"):
            cuda_attn.set_hopper_backward_stages(True, "yes")
        with pytest.raises(ValueError, match="dq_in_kernel must be"):
            cuda_attn.set_hopper_backward_stages(torch.tensor(1.0))
        assert cuda_attn.set_hopper_backward_stages() == previous, "a refused setting changes nothing"
        cuda_attn.set_hopper_backward_stages(False, True)
        assert cuda_attn._in_kernel_stages(q128, k128) == 2
        cuda_attn.set_hopper_backward_stages(True, cuda_attn.BY_SHAPE)
        assert cuda_attn._in_kernel_stages(q64, k64) == 1
    finally:
        cuda_attn.set_hopper_backward_stages(*previous)
