"""The hand-written Hopper FP8 attention forward (``kernels/cuda/attention_kernels.cu``
through ``te_fuser.kernels.cuda.attention.attention_forward_fp8``): o within the FP8
forward's error bound of exact attention and lse within its tolerance, on odd
lengths (one key tile and many, Tq above and below Tk, grouped kv heads, head dims
64 and 128, causal and not, every output dtype), the probabilities cast with
p_scale, the fused QKV tensor's views read in place (the same bits as contiguous
copies), the same bits on every run and with or without the consumers' turns (the
overlapped schedule: its own bits, within the same bound),
V handed with its keys inner (read as it lies, K's rows copied permuted), the
Triton FP8 forward beside it at real sizes, the backend's dispatch (Triton's kernel for
what this one does not take), the default schedule, and what the kernel refuses with a
reason. The kernel runs on sm_90a only; the reasons also run here on the CPU."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.cuda import attention as cuda_attn
from test_attention_kernels import (P_SCALE_CASES, _context, _randn, assert_within_fp8_bound, dequantized,
                                    exact_attention, fp8_qkv, two_value_scores)
from tolerances import assert_close


def _hopper_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from te_fuser.kernels.cuda._build import unavailable_reason

    return unavailable_reason()


_REASON = _hopper_reason()
hopper = pytest.mark.skipif(_REASON is not None, reason=f"the kernel runs on sm_90a: {_REASON}")
E4M3 = torch.float8_e4m3fn

# (B, H, Hkv, Tq, Tk, D): one partial key tile; Tq > Tk and Tq < Tk; several tiles
# with a partial last one and grouped heads 4:1; head dim 128 over 8 tiles of keys
SHAPES = [(1, 4, 2, 67, 67, 64), (1, 8, 2, 67, 45, 64), (2, 4, 4, 45, 67, 64), (1, 8, 2, 1000, 1000, 64),
          (2, 4, 1, 300, 300, 128), (1, 2, 2, 1000, 1000, 128)]


@contextlib.contextmanager
def _schedule(turns: bool | None, overlap: bool | None, v_in_kernel: bool | None = None):
    previous = cuda_attn.set_hopper_schedule(turns, overlap, v_in_kernel)
    try:
        yield
    finally:
        cuda_attn.set_hopper_schedule(*previous)


def _forward(fp8s, scale_invs, p_scale, causal, scale, out_dtype):
    return cuda_attn.attention_forward_fp8(*fp8s, *scale_invs, p_scale, causal, scale, out_dtype)


def _extension_call(name, *args):
    from te_fuser.kernels.cuda._build import extension, stream_of_index

    index = torch.cuda.current_device()
    return getattr(extension(), name)(*args, index, stream_of_index(index))


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_the_keys_inner_rewrite_of_v(D):
    """What the forward reads for V (a head range of a fused tensor here): (B·Hkv,
    D, T rounded up to 128) bytes whose position 16g + 4w + b holds key 16g + 2w +
    (0, 1, 8, 9)[b], the order in which the S accumulator's registers serve as P,
    and zeros past the last key."""
    B, Hkv, T = 2, 3, 300
    fused = _randn((B, T, 2 + Hkv, D), 7, std=24.0).clamp(-448, 448).to(E4M3)
    v = fused.transpose(1, 2)[:, 2:]
    vt = _extension_call("attention_fp8_keys_inner", v)
    pitch = -(-T // 128) * 128
    order = torch.tensor([16 * g + 2 * w + off for g in range(pitch // 16) for w in range(4) for off in (0, 1, 8, 9)])
    padded = torch.zeros(B, Hkv, pitch, D, dtype=torch.uint8, device="cuda")
    padded[:, :, :T] = v.view(torch.uint8)
    want = padded[:, :, order].permute(0, 1, 3, 2).reshape(B * Hkv, D, pitch)
    assert vt.shape == want.shape and torch.equal(vt, want)


@hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_uniform_scores_average_the_values(D, causal):
    """q = 0: every key a row sees scores 0, its probability times p_scale is 448
    exactly, and o is the mean of the values the row sees; lse is ln(keys seen).
    P·V, the keys' order in Vᵀ, the masks and the row sums, apart from Q Kᵀ."""
    B, H, Hkv, T = 1, 4, 2, 300
    q8 = torch.zeros(B, H, T, D, device="cuda").to(E4M3)
    k8 = _randn((B, Hkv, T, D), 3, std=24.0).clamp(-448, 448).to(E4M3)
    v8 = _randn((B, Hkv, T, D), 4, std=8.0).clamp(-448, 448).to(E4M3)
    ones = torch.tensor(1.0, device="cuda")
    o, lse = cuda_attn.attention_forward_fp8(q8, k8, v8, ones, ones, ones, torch.tensor(448.0, device="cuda"), causal,
                                             1 / math.sqrt(D), torch.float32)
    v = v8.double().cpu().repeat_interleave(H // Hkv, dim=1)
    seen = torch.ones(T, T, dtype=torch.float64).tril() if causal else torch.ones(T, T, dtype=torch.float64)
    counts = seen.sum(1)
    want = (seen @ v) / counts[:, None]
    assert_close(o.cpu(), want, "fp8_gemm_tensor_core", f"uniform scores D={D} causal={causal}", scaled=True)
    assert_close(lse.cpu(), torch.log(counts).expand(B, H, T), "attention_fp32", f"uniform lse D={D}")


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_one_key_per_row(D):
    """T = D keys k_j = 16·e_j and queries q_i = 16·e_π(i): row i sees one key far
    above the others (exp(-22) or less: probability 0 once cast), so o_i is
    v_π(i). Q Kᵀ's operands as the tensor cores read them, apart from the rest."""
    B, H, T = 1, 2, D
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(D))
    eye = torch.eye(D)
    q = (16.0 * eye[perm]).expand(B, H, T, D).to(E4M3).cuda()
    k = (16.0 * eye).expand(B, 1, T, D).to(E4M3).cuda()
    v8 = _randn((B, 1, T, D), 6, std=8.0).clamp(-448, 448).to(E4M3)
    ones = torch.tensor(1.0, device="cuda")
    o, _ = cuda_attn.attention_forward_fp8(q, k, v8, ones, ones, ones, torch.tensor(448.0, device="cuda"), False,
                                           1 / math.sqrt(D), torch.float32)
    want = v8.double().cpu()[:, :, perm].expand(B, H, T, D)
    assert_close(o.cpu(), want, "fp8_gemm_tensor_core", f"one key per row D={D}", scaled=True)


@hopper
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_within_its_bound(shape, causal, overlap):
    out_dtype = (torch.bfloat16, torch.float32, torch.float16)[SHAPES.index(shape) % 3]
    fp8s, scale_invs = fp8_qkv(*shape, seed=sum(shape))
    p_scale = torch.tensor(448.0, device="cuda")
    scale = 1 / math.sqrt(shape[-1])
    with _schedule(True, overlap):
        o, lse = _forward(fp8s, scale_invs, p_scale, causal, scale, out_dtype)
    context = _context(f"cuda fp8 o (overlap={overlap})", shape, out_dtype, causal)
    assert o.dtype == out_dtype and o.shape == fp8s[0].shape and lse.dtype == torch.float32
    assert o.transpose(1, 2).is_contiguous()  # (B, T, H, D) storage: the (B, T, H·D) merge is a view
    q64, k64, v64 = dequantized(fp8s, scale_invs)
    assert_within_fp8_bound(o, q64, k64, v64, causal, scale, 448.0, context)
    _, lse_exact = exact_attention(q64, k64, v64, causal, scale)
    assert_close(lse, lse_exact, "attention_fp8_lse", context.replace(" o", " lse"))


@hopper
@pytest.mark.parametrize("p_scale,factor", P_SCALE_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_probabilities_are_cast_with_p_scale(p_scale, factor, causal):
    """Scores of two values (``two_value_scores``, two key tiles, head dim 64): o is
    e4m3(p_scale) / p_scale times the mean of the top keys' values (300 rounds to
    288, 1000 saturates to 448), up to the FP8 tensor cores' accumulation."""
    args, want, lse_want = two_value_scores((1, 2, 1, 140, 150, 64), p_scale, factor, causal)
    o, lse = cuda_attn.attention_forward_fp8(*args)
    context = f"p_scale={p_scale} causal={causal}"
    assert_close(o.cpu(), want, "fp8_gemm_tensor_core", context, scaled=True)
    assert_close(lse.cpu(), lse_want, "attention_fp32", f"lse {context}")


@hopper
def test_reads_the_fused_qkv_views_in_place():
    """q, k, v as the attention op hands them: head ranges of one fused (B, T, H +
    2·Hkv, D) E4M3 tensor. The same bits as from contiguous copies of the three."""
    B, H, Hkv, T, D = 2, 8, 2, 200, 128
    fused = _randn((B, T, H + 2 * Hkv, D), 9, std=24.0).clamp(-448, 448).to(E4M3)
    heads = fused.transpose(1, 2)
    views = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    scale_invs = tuple(torch.tensor(s, device="cuda") for s in (0.0371, 0.0298, 0.125))
    p_scale = torch.tensor(448.0, device="cuda")
    o, lse = _forward(views, scale_invs, p_scale, True, 1 / math.sqrt(D), torch.bfloat16)
    o_c, lse_c = _forward(tuple(t.contiguous() for t in views), scale_invs, p_scale, True, 1 / math.sqrt(D),
                          torch.bfloat16)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)


@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_the_same_bits_on_every_run_and_schedule(D):
    """Run after run; with the consumers taking turns at the tensor cores or not,
    V rewritten in the kernel or before it (the same bits); overlapped (its own
    bits, the same on every run, with turns or without)."""
    fp8s, scale_invs = fp8_qkv(2, 8, 2, 777, 777, D, seed=4)
    p_scale = torch.tensor(448.0, device="cuda")
    results = {}
    for turns, overlap in ((True, False), (False, False), (True, True), (False, True), (True, False), (True, True)):
        for v_in_kernel in (False, True):
            with _schedule(turns, overlap, v_in_kernel):
                got = _forward(fp8s, scale_invs, p_scale, True, 0.09, torch.bfloat16)
            first = results.setdefault(overlap, got)
            assert all(torch.equal(a, b) for a, b in zip(first, got)), (turns, overlap, v_in_kernel)


@hopper
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_v_rewritten_in_the_kernel_gives_the_same_bits(shape, causal, overlap):
    """The producer warpgroup's rewrite of each V tile in shared memory (a raw tile
    copied in, its keys turned inner and permuted) against the launch before the
    forward that rewrites all of V: the same Vᵀ tiles, so the same o and lse, on
    partial tiles (zeros past the last key), grouped heads, both head dims, and V as
    a head range of the fused tensor."""
    B, H, Hkv, Tq, Tk, D = shape
    fp8s, scale_invs = fp8_qkv(*shape, seed=sum(shape) + 1)
    if Tq == Tk:  # q, k, v as the op hands them: views of one fused (B, T, H + 2·Hkv, D) tensor
        fused = torch.cat([t.view(torch.uint8).transpose(1, 2) for t in fp8s], dim=2)
        heads = fused.transpose(1, 2).view(E4M3)
        fp8s = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    p_scale = torch.tensor(448.0, device="cuda")
    with _schedule(None, overlap, v_in_kernel=False):
        launched = _forward(fp8s, scale_invs, p_scale, causal, 1 / math.sqrt(D), torch.bfloat16)
    with _schedule(None, overlap, v_in_kernel=True):
        in_kernel = _forward(fp8s, scale_invs, p_scale, causal, 1 / math.sqrt(D), torch.bfloat16)
    assert torch.equal(launched[0], in_kernel[0]) and torch.equal(launched[1], in_kernel[1])


def _beside_triton(shape, causal, overlap, seed):
    """The Hopper FP8 forward of random E4M3 q, k, v of ``shape`` within the bound of
    exact attention (fp32), its lse as the reference's and as Triton's, and Triton's
    FP8 forward within the same bound (it is tested so in test_attention_kernels.py)."""
    D = shape[-1]
    fp8s, scale_invs = fp8_qkv(*shape, seed=seed)
    scale = 1 / math.sqrt(D)
    p_scale = torch.tensor(448.0, device="cuda")
    with _schedule(True, overlap):
        o, lse = _forward(fp8s, scale_invs, p_scale, causal, scale, torch.bfloat16)
    q32, k32, v32 = dequantized(fp8s, scale_invs, torch.float32)
    assert_within_fp8_bound(o, q32, k32, v32, causal, scale, 448.0, _context("cuda fp8 o", shape, "bf16", causal))
    _, lse32 = ref.attention_forward_reference(q32, k32, v32, causal, scale)
    assert_close(lse, lse32, "attention_fp8_lse", _context("cuda fp8 lse", shape, "bf16", causal))
    o_t, lse_t = tk.attention_forward_fp8(*fp8s, *scale_invs, p_scale, causal, scale, torch.bfloat16)
    assert_within_fp8_bound(o_t, q32, k32, v32, causal, scale, 448.0, _context("triton fp8 o", shape, "bf16", causal))
    assert_close(lse, lse_t, "attention_fp8_lse", "cuda against triton lse")


@hopper
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("T,D,causal", [(4096, 128, True), (4096, 64, True), (1024, 128, False)])
def test_at_real_sizes_beside_triton(T, D, causal, overlap):
    """Both FP8 forwards within the bound of exact attention at real sizes, and their
    lse alike."""
    _beside_triton((1, 8, 2, T, T, D), causal, overlap, seed=T + D)


@hopper
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape,causal", [((8, 16, 4, 300, 300, 64), True), ((8, 16, 4, 300, 300, 64), False),
                                          ((4, 16, 16, 700, 700, 128), True)])
def test_a_block_works_through_several_items(shape, causal, overlap):
    """More items (128 queries of one head) than twice the SMs, so each persistent
    block works through several, of unlike tile counts (causal), its Q buffers and
    ring stages reused across them: every item's o within the FP8 bound and its lse
    as the reference's and Triton's."""
    B, H, _, T, _, D = shape
    assert -(-T // 128) * B * H > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    _beside_triton(shape, causal, overlap, seed=T + D + B)


@hopper
@pytest.mark.parametrize("shape,causal", [((8, 16, 4, 400, 400, 64), True), ((4, 16, 16, 900, 900, 128), True),
                                          ((4, 16, 16, 900, 900, 128), False)])
def test_the_items_dealt_either_way_give_the_same_bits(shape, causal):
    """Which block takes an item changes nothing an item computes: the rounds dealt
    forwards and backwards in turn (the default) and forwards every round give the
    same o and lse, over more items than three rounds."""
    B, H, _, T, _, D = shape
    assert -(-T // 128) * B * H > 3 * torch.cuda.get_device_properties(0).multi_processor_count
    fp8s, scale_invs = fp8_qkv(*shape, seed=T + B)
    p_scale = torch.tensor(448.0, device="cuda")
    mirrored = _forward(fp8s, scale_invs, p_scale, causal, D ** -0.5, torch.bfloat16)
    previous = cuda_attn.set_hopper_schedule(mirrored=False)
    try:
        forwards = _forward(fp8s, scale_invs, p_scale, causal, D ** -0.5, torch.bfloat16)
    finally:
        cuda_attn.set_hopper_schedule(*previous)
    assert all(torch.equal(a, b) for a, b in zip(mirrored, forwards))


def keys_inner_copy(v: torch.Tensor, layout: str) -> torch.Tensor:
    """v (B, Hkv, Tk, D) as a view of a transposed copy, its keys inner: of (B, Hkv,
    D, Tk) storage ("heads"), or of the (Hkv·D, B·Tk) columns a transposing cast of a
    fused QKV tensor writes ("tokens": v[b, h, t, d] at row h·D + d, column b·Tk + t)."""
    raw = v.view(torch.uint8)
    if layout == "heads":
        return raw.transpose(2, 3).contiguous().transpose(2, 3).view(E4M3)
    B, Hkv, T, D = v.shape
    vt = raw.permute(1, 3, 0, 2).reshape(Hkv * D, B * T).contiguous()
    return vt.view(Hkv, D, B, T).permute(2, 0, 3, 1).view(E4M3)


def _fused(fp8s):
    """q, k, v as head ranges of one fused (B, T, H + 2·Hkv, D) tensor (Tq = Tk)."""
    H, Hkv = fp8s[0].shape[1], fp8s[1].shape[1]
    fused = torch.cat([t.view(torch.uint8).transpose(1, 2) for t in fp8s], dim=2)
    heads = fused.transpose(1, 2).view(E4M3)
    return heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]


KEYS_INNER_SHAPES = [(1, 8, 2, 144, 144, 64), (2, 4, 4, 160, 160, 128), (1, 8, 2, 67, 1040, 64),
                     (2, 4, 1, 1024, 1024, 128), (3, 2, 2, 48, 16, 64)]


@hopper
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["heads", "tokens"])
@pytest.mark.parametrize("shape", KEYS_INNER_SHAPES)
def test_v_with_its_keys_inner_is_read_as_it_lies(shape, layout, causal, overlap):
    """V handed as a transposed copy (keys inner) is read as it lies and K's rows are
    copied permuted instead: o within the FP8 bound of exact attention and lse within
    its tolerance, beside the forward that rewrites V; k's batches folded into its
    heads (contiguous q, k) or into its keys (views of the fused QKV tensor, Tq = Tk);
    partial last tiles, Tq above and below Tk, grouped heads, both head dims; the same
    bits on every run and with or without the consumers' turns."""
    B, H, Hkv, Tq, Tk, D = shape
    fp8s, scale_invs = fp8_qkv(*shape, seed=sum(shape) + 5)
    if layout == "tokens":
        if Tq != Tk:
            pytest.skip("views of one fused tensor have one length")
        fp8s = _fused(fp8s)
    v_inner = keys_inner_copy(fp8s[2], layout)
    assert v_inner.stride(2) == 1 and cuda_attn.keys_inner_reason(fp8s[1], v_inner) is None
    p_scale = torch.tensor(448.0, device="cuda")
    scale = 1 / math.sqrt(D)
    with _schedule(True, overlap):
        o, lse = _forward((fp8s[0], fp8s[1], v_inner), scale_invs, p_scale, causal, scale, torch.bfloat16)
        again = _forward((fp8s[0], fp8s[1], v_inner), scale_invs, p_scale, causal, scale, torch.bfloat16)
        rewritten = _forward(fp8s, scale_invs, p_scale, causal, scale, torch.bfloat16)
    with _schedule(False, overlap):
        no_turns = _forward((fp8s[0], fp8s[1], v_inner), scale_invs, p_scale, causal, scale, torch.bfloat16)
    for other in (again, no_turns):
        assert torch.equal(o, other[0]) and torch.equal(lse, other[1])
    context = _context(f"cuda fp8 o, v keys inner ({layout}, overlap={overlap})", shape, torch.bfloat16, causal)
    q64, k64, v64 = dequantized(fp8s, scale_invs)
    assert_within_fp8_bound(o, q64, k64, v64, causal, scale, 448.0, context)
    _, lse_exact = exact_attention(q64, k64, v64, causal, scale)
    assert_close(lse, lse_exact, "attention_fp8_lse", context.replace(" o", " lse"))
    assert_close(lse, rewritten[1], "attention_fp8_lse", context.replace(" o", " lse against V rewritten"))


@hopper
@pytest.mark.parametrize("T,D", [(4096, 128), (4096, 64)])
def test_v_with_its_keys_inner_at_real_sizes(T, D):
    """The fused QKV tensor's views with V as the cast's transposed columns, causal,
    at the sizes it is for: within the bound, lse as the reference's."""
    shape = (2, 8, 2, T, T, D)
    fp8s, scale_invs = fp8_qkv(*shape, seed=T + D + 7)
    fp8s = _fused(fp8s)
    scale = 1 / math.sqrt(D)
    p_scale = torch.tensor(448.0, device="cuda")
    o, lse = _forward((fp8s[0], fp8s[1], keys_inner_copy(fp8s[2], "tokens")), scale_invs, p_scale, True, scale,
                      torch.bfloat16)
    q32, k32, v32 = dequantized(fp8s, scale_invs, torch.float32)
    context = _context("cuda fp8 o, v keys inner", shape, "bf16", True)
    assert_within_fp8_bound(o, q32, k32, v32, True, scale, 448.0, context)
    _, lse32 = ref.attention_forward_reference(q32, k32, v32, True, scale)
    assert_close(lse, lse32, "attention_fp8_lse", context.replace(" o", " lse"))


@hopper
def test_a_keys_inner_v_it_cannot_read_as_it_lies_is_copied():
    """Tk not a multiple of 16 (a group of K's permuted rows would span two heads):
    V is copied to the layout the forward rewrites, with that forward's bits."""
    fp8s, scale_invs = fp8_qkv(1, 4, 2, 200, 200, 64, seed=21)
    v_inner = keys_inner_copy(fp8s[2], "heads")
    assert "multiple of 16" in cuda_attn.keys_inner_reason(fp8s[1], v_inner)
    p_scale = torch.tensor(448.0, device="cuda")
    got = _forward((fp8s[0], fp8s[1], v_inner), scale_invs, p_scale, True, 0.125, torch.bfloat16)
    want = _forward(fp8s, scale_invs, p_scale, True, 0.125, torch.bfloat16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_why_a_keys_inner_v_is_not_read_as_it_lies():
    """:func:`keys_inner_reason` on any machine."""
    k = torch.zeros(2, 2, 64, 64, dtype=torch.uint8)
    v = torch.zeros(2, 2, 64, 64, dtype=torch.uint8).transpose(2, 3)  # keys inner, (B, Hkv, Tk, D) view
    assert cuda_attn.keys_inner(v) and not cuda_attn.keys_inner(k)
    assert cuda_attn.keys_inner_reason(k, v) is None
    assert "Tk 56 is not a multiple of 16" in cuda_attn.keys_inner_reason(k[:, :, :56], v[:, :, :56])
    pitch_72 = torch.zeros(2, 2, 64, 72, dtype=torch.uint8)[..., :64].transpose(2, 3)  # head dims 72 bytes apart
    assert "16-byte" in cuda_attn.keys_inner_reason(k, pitch_72)
    gapped = torch.zeros(2, 3, 64, 64, dtype=torch.uint8)[:, :2]  # a head left out between batches
    assert "k's batch stride" in cuda_attn.keys_inner_reason(gapped, v)


def test_reasons_name_what_the_kernel_does_not_take():
    """Checked before anything runs, on any machine."""
    q = torch.zeros(1, 2, 8, 64).to(E4M3)
    reason = cuda_attn.attention_forward_fp8_unsupported_reason(q, q)
    assert reason is not None
    if q.device.type == "cpu":
        assert "CUDA tensors" in reason
    bf16 = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    assert "float8_e4m3fn" in cuda_attn.attention_forward_fp8_unsupported_reason(bf16, bf16)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="attention_forward_fp8: "):
        cuda_attn.attention_forward_fp8(q, q, q, one, one, one, one, True, 0.125, torch.bfloat16)
    shared = torch.zeros(1, 1, 8, 64).to(E4M3).expand(1, 2, 8, 64)  # one kv head broadcast over two
    assert "strides (512, 0, 64, 1)" in cuda_attn._tensor_map_reason(shared, "k")
    assert cuda_attn._tensor_map_reason(shared[:, :1], "k") is None  # stride 0 over one element reads nothing twice


@hopper
def test_layouts_it_refuses_on_the_gpu():
    q = torch.zeros(1, 2, 8, 32, device="cuda").to(E4M3)
    assert "head dims" in cuda_attn.attention_forward_fp8_unsupported_reason(q, q)
    wide = torch.zeros(1, 2, 8, 65 * 2, device="cuda").to(E4M3)[..., 1:129:2]  # head dim 64, stride 2
    assert "16-byte" in cuda_attn.attention_forward_fp8_unsupported_reason(wide, wide)
    odd = torch.zeros(1, 2, 8, 72, device="cuda").to(E4M3)[..., :64]  # rows 72 bytes apart
    assert "16-byte" in cuda_attn.attention_forward_fp8_unsupported_reason(odd, odd)
    shared = torch.zeros(1, 1, 8, 64, device="cuda").to(E4M3).expand(1, 2, 8, 64)
    plain = torch.zeros(1, 2, 8, 64, device="cuda").to(E4M3)
    for q_, k_, name in ((plain, shared, "k"), (shared, plain, "q")):
        reason = cuda_attn.attention_forward_fp8_unsupported_reason(q_, k_)
        assert "tensor maps" in reason and f"{name} has shape" in reason
    assert cuda_attn.attention_forward_fp8_unsupported_reason(plain, plain) is None
    one = torch.tensor(1.0, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        cuda_attn.attention_forward_fp8(q, q, q, one, one, one, one, True, 0.125, torch.bfloat16)


@hopper
def test_the_backend_runs_it_and_sends_what_it_refuses_to_triton():
    """The auto table's FP8 forward is this kernel: through ``backend.resolve`` the
    same bits as the direct call (default schedule); a head dim it does not take
    (32) goes to Triton's kernel per call, with Triton's bits; a v whose rows its
    copies cannot read, beside a q and k they can, is refused by name."""
    from te_fuser import backend

    with backend.use_backend("auto"):
        choice = backend.resolve("attention_forward_fp8", "cuda")
    assert choice.backend == "cuda"
    p_scale = torch.tensor(448.0, device="cuda")
    fp8s, scale_invs = fp8_qkv(2, 8, 2, 300, 300, 128, seed=11)
    got = choice.fn(*fp8s, *scale_invs, p_scale, True, 0.09, torch.bfloat16)
    want = _forward(fp8s, scale_invs, p_scale, True, 0.09, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    fp8s, scale_invs = fp8_qkv(1, 4, 2, 67, 67, 32, seed=12)
    assert "head dims" in cuda_attn.attention_forward_fp8_unsupported_reason(fp8s[0], fp8s[1])
    got = choice.fn(*fp8s, *scale_invs, p_scale, False, 0.2, torch.bfloat16)
    want = tk.attention_forward_fp8(*fp8s, *scale_invs, p_scale, False, 0.2, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q = torch.zeros(1, 2, 8, 64, device="cuda").to(E4M3)
    odd_v = torch.zeros(1, 2, 8, 72, device="cuda").to(E4M3)[..., :64]
    one = torch.tensor(1.0, device="cuda")
    with pytest.raises(ValueError, match="attention_forward_fp8: .*v has strides"):
        choice.fn(q, q, odd_v, one, one, one, one, True, 0.125, torch.bfloat16)


@hopper
def test_the_default_schedule_is_the_overlapped_one():
    """The process starts overlapped with turns (what the auto table's choice was
    timed with), V rewritten in the kernel by shape; in order gives other bits,
    both within the bound (above)."""
    assert cuda_attn.set_hopper_schedule() == (True, True, cuda_attn.BY_SHAPE, True)
    fp8s, scale_invs = fp8_qkv(1, 4, 4, 1000, 1000, 128, seed=13)
    p_scale = torch.tensor(448.0, device="cuda")
    default = _forward(fp8s, scale_invs, p_scale, True, 0.09, torch.bfloat16)
    with _schedule(True, True):
        overlapped = _forward(fp8s, scale_invs, p_scale, True, 0.09, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(default, overlapped))


def test_a_v_setting_that_is_not_one_is_refused_before_anything():
    """``v_in_kernel`` takes True, False, BY_SHAPE or None; anything else is refused
    by name before the extension is built or a setting changes (on any machine)."""
    with pytest.raises(ValueError, match="v_in_kernel is True, False, BY_SHAPE or None, not 'always'"):
        cuda_attn.set_hopper_schedule(v_in_kernel="always")
