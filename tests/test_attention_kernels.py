"""Flash attention kernels (``attention_forward``, ``attention_backward``,
``attention_forward_fp8``): the reference against a plain float64 formula, the
Triton kernels against float64 on representable inputs (forward, lse and the
three gradients), the FP8 forward against its error bound, the FP8 recipe's
backward (the bf16 backward on dequantized operands with the FP8 forward's o and
lse), and the argument checks.

Without a GPU the Triton kernels run under the interpreter (conftest sets
TRITON_INTERPRET=1) at small sizes; with one, the same tests run compiled, and the
tests marked ``gpu`` add real sizes (T = 1000 and 4096, head dims 64 and 128).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from te_fuser import backend
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from tolerances import TOLERANCES, assert_bitwise, assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
_KEYS = {torch.bfloat16: "attention_bf16", torch.float16: "attention_fp16", torch.float32: "attention_fp32"}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (B, H, Hkv, Tq, Tk, D): grouped heads 2:1 and 4:1, sequences that are not a multiple
# of any block, Tq > Tk and Tq < Tk (causal rows that see every key; keys no query sees)
SHAPES = [(1, 4, 2, 67, 67, 64), (1, 8, 2, 67, 45, 64), (2, 4, 4, 45, 67, 64)]


def _randn(shape, seed: int, dtype=torch.float32, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (mean + std * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def qkv(B, H, Hkv, Tq, Tk, D, dtype, seed=0, offcentre=False):
    """Representable q, k, v, do in ``dtype`` (their float64 copies are exact)."""
    mean, std = (-2.3, 0.5) if offcentre else (0.0, 1.0)
    q = _randn((B, H, Tq, D), seed, dtype, mean * 0.3, std)
    k = _randn((B, Hkv, Tk, D), seed + 1, dtype, mean * 0.3, std)
    v = _randn((B, Hkv, Tk, D), seed + 2, dtype, mean, std)
    do = _randn((B, H, Tq, D), seed + 3, dtype)
    return q, k, v, do


def exact_attention(q, k, v, causal, scale, do=None):
    """softmax(q kᵀ · scale, masked) v in float64 by the plain formula (kv heads
    repeated), its lse, and with ``do`` the autograd gradients."""
    q, k, v = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ vv
    lse = torch.logsumexp(s, dim=-1)
    if do is None:
        return o.detach(), lse.detach()
    grads = torch.autograd.grad(o, (q, k, v), do.double())
    return o.detach(), lse.detach(), grads


def _context(kind, shape, dtype, causal) -> str:
    return f"{kind} (B, H, Hkv, Tq, Tk, D)={shape} {dtype} causal={causal}"


# ------------------------------------------------------------------ reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_the_plain_formula_in_float64(shape, causal):
    B, H, Hkv, Tq, Tk, D = shape
    q, k, v, do = (t.double() for t in qkv(*shape, torch.float32))
    scale = 1 / math.sqrt(D)
    o, lse = ref.attention_forward_reference(q, k, v, causal, scale)
    o_exact, lse_exact, grads = exact_attention(q, k, v, causal, scale, do)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64 and lse.shape == (B, H, Tq)
    torch.testing.assert_close(o, o_exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_exact, rtol=1e-12, atol=1e-12)
    got = ref.attention_backward_reference(q, k, v, o, lse, do, causal, scale)
    for name, g, want in zip(("dq", "dk", "dv"), got, grads):
        assert g.shape == want.shape and g.dtype == torch.float64, name
        torch.testing.assert_close(g, want, rtol=1e-11, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_computes_in_fp32_and_rounds_once(dtype):
    shape = SHAPES[1]
    q, k, v, do = qkv(*shape, dtype)
    scale = 0.3
    o, lse = ref.attention_forward_reference(q, k, v, True, scale)
    o_exact, lse_exact, grads = exact_attention(q, k, v, True, scale, do)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_exact, _KEYS[dtype], _context("reference", shape, dtype, True), scaled=True)
    assert_close(lse, lse_exact, "attention_fp32", _context("reference lse", shape, dtype, True))
    for name, g, want in zip(("dq", "dk", "dv"), ref.attention_backward_reference(q, k, v, o, lse, do, True, scale),
                             grads):
        assert g.dtype == dtype
        assert_close(g, want, _KEYS[dtype], _context(f"reference {name}", shape, dtype, True), scaled=True)


# --------------------------------------------------------------------- triton


def check_kernels(shape, dtype, causal, scale=None, seed=0, offcentre=False, layout="contiguous", true_grads=True,
                  kernels=tk, name="triton"):
    """``kernels``' (a backend module's) o and lse against float64 attention; the gradients against the float64
    reference backward fed the kernel's own o and lse (the backward's error alone)
    and, with ``true_grads``, against float64 autograd (also o's rounding, which
    reaches dq and dk through delta = rowsum(o · do))."""
    q, k, v, do = qkv(*shape, dtype, seed, offcentre)
    if layout == "bthd":  # (B, T, H, D) storage seen as (B, H, T, D), as a fused projection leaves it
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    scale = 1 / math.sqrt(shape[-1]) if scale is None else scale
    o, lse = kernels.attention_forward(q, k, v, causal, scale)
    o_exact, lse_exact, grads = exact_attention(q, k, v, causal, scale, do)
    key = _KEYS[dtype]
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_close(o, o_exact, key, _context(f"{name} o", shape, dtype, causal), scaled=True)
    assert_close(lse, lse_exact, "attention_fp32", _context(f"{name} lse", shape, dtype, causal))
    got = kernels.attention_backward(q, k, v, o, lse, do, causal, scale)
    same_o = ref.attention_backward_reference(*(t.double() for t in (q, k, v, o, lse, do)), causal, scale)
    for grad, g, want, want_same_o, like in zip(("dq", "dk", "dv"), got, grads, same_o, (q, k, v)):
        assert g.dtype == dtype and g.shape == like.shape, grad
        assert_close(g, want_same_o, key, _context(f"{name} {grad} (its o)", shape, dtype, causal), scaled=True)
        if true_grads:
            assert_close(g, want, key, _context(f"{name} {grad}", shape, dtype, causal), scaled=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_bf16_forward_and_backward_against_float64(shape, causal):
    check_kernels(shape, torch.bfloat16, causal)


@pytest.mark.parametrize("dtype,causal", [(torch.float16, True), (torch.float32, False)])
def test_triton_fp16_fp32_against_float64(dtype, causal):
    check_kernels(SHAPES[1], dtype, causal)


@pytest.mark.parametrize("shape,dtype,causal,layout", [
    ((1, 2, 1, 40, 40, 128), torch.bfloat16, True, "contiguous"),  # the head dim of the benchmarks
    ((1, 4, 1, 33, 50, 16), torch.float32, True, "contiguous"),    # the smallest head dim, 4:1 groups
    ((2, 4, 2, 35, 35, 32), torch.bfloat16, False, "bthd"),         # strided heads, no copies
])
def test_triton_other_head_dims_and_layouts(shape, dtype, causal, layout):
    check_kernels(shape, dtype, causal, layout=layout)


def test_triton_offcentre_peaked_scores():
    """Off-centre q, k, v (-2.3 + 0.5·randn style): large scores, nearly one-hot rows,
    values of one sign (a biased accumulation would show). The true gradients are
    ill-conditioned here (dp - delta cancels to a few percent of delta, so o's bf16
    rounding is amplified: 3% of max|dq| in the reference fed a bf16 o too); the
    backward is held to the float64 reference fed its own o."""
    check_kernels(SHAPES[0], torch.bfloat16, True, scale=0.5, offcentre=True, true_grads=False)


def test_backend_sends_float64_to_the_reference_and_bf16_to_triton():
    q, k, v, do = qkv(*SHAPES[0], torch.bfloat16)
    fwd = backend.resolve("attention_forward", DEVICE, backend="triton")
    assert fwd.backend == "triton"
    assert_bitwise(fwd.fn(q, k, v, True, 0.125)[0], tk.attention_forward(q, k, v, True, 0.125)[0], "bf16 on triton")
    q64, k64, v64 = q.double(), k.double(), v.double()
    o64, lse64 = fwd.fn(q64, k64, v64, True, 0.125)
    assert_bitwise(o64, ref.attention_forward_reference(q64, k64, v64, True, 0.125)[0], "float64 on the reference")
    bwd = backend.resolve("attention_backward", DEVICE, backend="triton")
    got = bwd.fn(q64, k64, v64, o64, lse64, do.double(), True, 0.125)
    want = ref.attention_backward_reference(q64, k64, v64, o64, lse64, do.double(), True, 0.125)
    for g, w in zip(got, want):
        assert_bitwise(g, w, "float64 backward on the reference")
    with pytest.raises(ValueError, match="attention_forward: the triton attention kernels compute in fp32"):
        tk.attention_forward(q64, k64, v64, True, 0.125)


# ------------------------------------------------------------------------ FP8


def fp8_qkv(B, H, Hkv, Tq, Tk, D, seed=0, scale_invs=(0.0371, 0.0298, 0.125)):
    """E4M3 q, k, v spread over the format's range, and their fp32 scale_invs."""
    q8 = _randn((B, H, Tq, D), seed, std=24.0).clamp(-448, 448).to(E4M3)
    k8 = _randn((B, Hkv, Tk, D), seed + 1, std=24.0).clamp(-448, 448).to(E4M3)
    v8 = _randn((B, Hkv, Tk, D), seed + 2, std=8.0).clamp(-448, 448).to(E4M3)
    return (q8, k8, v8), tuple(torch.tensor(s, dtype=torch.float32, device=DEVICE) for s in scale_invs)


def dequantized(fp8s, scale_invs, dtype=torch.float64):
    return tuple((t.to(torch.float64) * s.to(torch.float64)).to(dtype) for t, s in zip(fp8s, scale_invs))


def assert_within_fp8_bound(o, q, k, v, causal, scale, p_scale, context):
    """|o - exact| <= rtol · Σ_j p_ij |v_j| + n_keys · 2^-10 / p_scale · max|v| + atol
    (``tests/tolerances.py``'s ``attention_fp8``), with q, k, v the dequantized
    operands; exact attention in float64 (fp32 on a GPU at real sizes)."""
    work = torch.float64 if q.numel() < 2**22 else torch.float32
    q, k, v = q.to(work), k.to(work), v.to(work)
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = q @ kk.transpose(-1, -2) * scale
    Tq, Tk = s.shape[-2:]
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device)
    if causal:
        visible = visible.tril()
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    exact, weighted = p @ vv, p @ vv.abs()
    tol = TOLERANCES["attention_fp8"]
    n_keys = visible.sum(dim=1).to(work)[:, None]  # (Tq, 1)
    bound = tol["rtol"] * weighted + n_keys * 2.0**-10 / float(p_scale) * v.abs().max() + tol["atol"]
    ratio = (o.to(work) - exact).abs() / bound
    worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    assert ratio.max().item() <= 1.0, (
        f"{context} shape={tuple(o.shape)} tol[attention_fp8]={tol}: worst at {idx}: got {o[idx].item()!r}, "
        f"exact {exact[idx].item()!r}, bound {bound[idx].item()!r} ({ratio.max().item():.2f} of it)")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,out_dtype", [(SHAPES[0], torch.bfloat16), (SHAPES[1], torch.float32)])
def test_fp8_forward_within_its_bound(shape, out_dtype, causal):
    fp8s, (qs, ks, vs) = fp8_qkv(*shape)
    p_scale = torch.tensor(448.0 if out_dtype == torch.bfloat16 else 200.0, device=DEVICE)
    scale = 1 / math.sqrt(shape[-1])
    q64, k64, v64 = dequantized(fp8s, (qs, ks, vs))
    _, lse_exact = exact_attention(q64, k64, v64, causal, scale)
    for name, fn in (("triton", tk.attention_forward_fp8), ("reference", ref.attention_forward_fp8_reference)):
        o, lse = fn(*fp8s, qs, ks, vs, p_scale, causal, scale, out_dtype)
        context = _context(f"{name} fp8 o", shape, out_dtype, causal)
        assert o.dtype == out_dtype and o.shape == fp8s[0].shape and lse.dtype == torch.float32
        assert_within_fp8_bound(o, q64, k64, v64, causal, scale, p_scale.item(), context)
        assert_close(lse, lse_exact, "attention_fp8_lse", context.replace(" o", " lse"))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_reads_a_keys_inner_v_as_it_lies(causal):
    """V handed as a transposed copy (keys inner, as a transposing cast writes it):
    the Triton kernel reads it in place and the reference takes it as any view, with
    the bits of the contiguous V."""
    shape = (2, 4, 2, 37, 48, 64)
    fp8s, scales = fp8_qkv(*shape, seed=3)
    v_inner = fp8s[2].view(torch.uint8).transpose(2, 3).contiguous().transpose(2, 3).view(E4M3)
    assert v_inner.stride(2) == 1 and torch.equal(v_inner.view(torch.uint8), fp8s[2].view(torch.uint8))
    p_scale = torch.tensor(448.0, device=DEVICE)
    for name, fn in (("triton", tk.attention_forward_fp8), ("reference", ref.attention_forward_fp8_reference)):
        want = fn(*fp8s, *scales, p_scale, causal, 0.125, torch.bfloat16)
        got = fn(fp8s[0], fp8s[1], v_inner, *scales, p_scale, causal, 0.125, torch.bfloat16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


P_SCALE_CASES = [(448.0, 1.0), (300.0, 288.0 / 300.0), (1000.0, 448.0 / 1000.0)]  # (p_scale, e4m3(p_scale) / p_scale)


def two_value_scores(shape, p_scale: float, factor: float, causal: bool):
    """A forward's arguments whose scores take two values, the row maximum (keys
    j % 7 == 0) and 22 below it, and the (o, lse) they give on the CPU: the top
    keys' probability 1 is cast as p_scale, the rest to 0, so o is ``factor`` =
    e4m3(p_scale) / p_scale times the mean of the top keys' values, exactly."""
    B, H, Hkv, Tq, Tk, D = shape
    c = 8.0
    q = torch.zeros(B, H, Tq, D)
    q[..., 0] = c
    top = torch.arange(Tk) % 7 == 0
    k = torch.zeros(B, Hkv, Tk, D)
    k[..., 0] = torch.where(top, c, -c)
    v = _randn((B, Hkv, Tk, D), 5, std=4.0).cpu().to(E4M3)
    ones = torch.tensor(1.0, device=DEVICE)
    args = (q.to(E4M3).to(DEVICE), k.to(E4M3).to(DEVICE), v.to(DEVICE), ones, ones, ones,
            torch.tensor(p_scale, device=DEVICE), causal, 1 / math.sqrt(D), torch.float32)
    seen = top[None, :].expand(Tq, Tk)
    if causal:
        seen = seen & torch.ones(Tq, Tk, dtype=torch.bool).tril()
    v_top = (seen.double() @ v.double()[0, 0]) / seen.sum(1, keepdim=True)  # (Tq, D)
    want = (factor * v_top).expand(B, H, Tq, D)
    lse_want = (c * c / math.sqrt(D) + torch.log(seen.sum(1).double())).expand(B, H, Tq)
    return args, want, lse_want


@pytest.mark.parametrize("p_scale,factor", P_SCALE_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_probabilities_are_cast_with_p_scale(p_scale, factor, causal):
    """Scores of two values (``two_value_scores``): o = e4m3(p_scale) / p_scale times
    the mean of the top keys' values (300 rounds to 288, 1000 saturates to 448),
    exactly, in the reference and in every tile of the kernel (tiles without a top
    key are rescaled to nothing); on a GPU up to the FP8 tensor cores' accumulation."""
    args, want, lse_want = two_value_scores((1, 2, 1, 40, 50, 32), p_scale, factor, causal)
    for name, fn in (("triton", tk.attention_forward_fp8), ("reference", ref.attention_forward_fp8_reference)):
        o, lse = (t.cpu() for t in fn(*args))
        # Hopper's FP8 tensor cores add P·V's products in their narrow accumulator
        # (the GEMMs' bound); the reference and the interpreter add them in fp32
        key = "fp8_gemm_tensor_core" if name == "triton" and DEVICE == "cuda" else "attention_fp32"
        assert_close(o, want, key, f"{name} p_scale={p_scale} causal={causal}", scaled=True)
        assert_close(lse, lse_want, "attention_fp32", f"{name} lse p_scale={p_scale} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_then_bf16_backward(causal):
    """The FP8 recipe: the FP8 forward's o (bf16) and lse, then the bf16 backward on
    the dequantized operands (power-of-2 scale_invs: exact in bf16)."""
    shape = SHAPES[1]
    fp8s, scale_invs = fp8_qkv(*shape, seed=3, scale_invs=(2.0**-5, 2.0**-5, 2.0**-3))
    scale = 1 / math.sqrt(shape[-1])
    o, lse = tk.attention_forward_fp8(*fp8s, *scale_invs, torch.tensor(448.0, device=DEVICE), causal, scale,
                                      torch.bfloat16)
    q, k, v = dequantized(fp8s, scale_invs, torch.bfloat16)
    do = _randn(o.shape, 11, torch.bfloat16)
    _, _, grads = exact_attention(q, k, v, causal, scale, do)
    got = tk.attention_backward(q, k, v, o, lse, do, causal, scale)
    for name, g, want in zip(("dq", "dk", "dv"), got, grads):
        assert g.dtype == torch.bfloat16
        assert_close(g, want, "attention_fp8_backward", _context(f"fp8 forward, bf16 {name}", shape, "bf16", causal),
                     scaled=True)


# --------------------------------------------------------------------- checks


def _bad_calls():
    b = torch.bfloat16
    q, k, v = torch.zeros(1, 4, 8, 64, dtype=b), torch.zeros(1, 2, 8, 64, dtype=b), torch.zeros(1, 2, 8, 64, dtype=b)
    k3 = torch.zeros(1, 3, 8, 64, dtype=b)
    lse = torch.zeros(1, 4, 8)
    one = torch.tensor(1.0)
    q8, k8, v8 = q.to(E4M3), k.to(E4M3), v.to(E4M3)
    fwd, bwd, fp8 = "attention_forward", "attention_backward", "attention_forward_fp8"
    return [
        (fwd, (q, k3, k3, False, 0.125), r"query heads \(4\) must be a multiple of the kv heads \(3\)"),
        (fwd, (q[..., :48], k[..., :48], v[..., :48], False, 0.125),
         r"head dim must be one of \[16, 32, 64, 128\], got 48"),
        (fwd, (torch.zeros(1, 4, 8, 256, dtype=b), torch.zeros(1, 2, 8, 256, dtype=b),
               torch.zeros(1, 2, 8, 256, dtype=b), False, 0.125), "head dim must be one of"),
        (fwd, (q, k.half(), v, False, 0.125), "k must have q's dtype torch.bfloat16, got torch.float16"),
        (fwd, (q[0], k, v, False, 0.125), r"q must be 4-D \(B, H, Tq, D\), got shape \(4, 8, 64\)"),
        (fwd, (q, k, v[:, :, :5], False, 0.125), "k and v must have one shape"),
        (fwd, (q, k[..., :32], v[..., :32], False, 0.125), "k and v must have q's head dim 64, got 32"),
        (fwd, (q, k[:, :, :0], v[:, :, :0], False, 0.125), r"at least one key \(Tk >= 1\)"),
        (fwd, (q.int(), k.int(), v.int(), False, 0.125), "q must be one of"),
        (fwd, (q, k, v, 1, 0.125), "causal must be a bool, got 1"),
        (fwd, (q, k, v, False, -1.0), "softmax_scale must be a finite float > 0, got -1.0"),
        (fwd, (q, k, v, False, float("nan")), "softmax_scale must be a finite float > 0"),
        (bwd, (q, k, v, q, lse.double(), q, False, 0.125), r"lse must be \(B, H, Tq\) = \(1, 4, 8\) torch.float32"),
        (bwd, (q, k, v, q[:, :, :4], lse, q, False, 0.125), "o must match q"),
        (bwd, (q, k, v, q, lse, q.float(), False, 0.125), "do must match q"),
        (fp8, (q, k, v, one, one, one, one, False, 0.125, b), r"q must be one of \['torch.float8_e4m3fn'\]"),
        (fp8, (q8, k8, v8.to(torch.float8_e5m2), one, one, one, one, False, 0.125, b), "v must have q's dtype"),
        (fp8, (q8[..., :16], k8[..., :16], v8[..., :16], one, one, one, one, False, 0.125, b),
         r"head dim must be one of \[32, 64, 128\], got 16"),
        (fp8, (q8, k8, v8, one.double(), one, one, one, False, 0.125, b), "q_scale_inv must be a 0-d float32 tensor"),
        (fp8, (q8, k8, v8, one, one, one, torch.ones(2), False, 0.125, b), "p_scale must be a 0-d float32 tensor"),
        (fp8, (q8, k8, v8, one, one, one, one, False, 0.125, E4M3), "out_dtype must be one of"),
    ]


@pytest.mark.parametrize("kernel,args,match", _bad_calls(), ids=[f"{c[0]}-{i}" for i, c in enumerate(_bad_calls())])
def test_bad_arguments_are_named_by_every_backend(kernel, args, match):
    for fn in (getattr(ref, f"{kernel}_reference"), getattr(tk, kernel)):
        with pytest.raises(ValueError, match=match) as err:
            fn(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
        assert str(err.value).startswith(f"{kernel}: "), err.value


def test_a_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="attention_forward: q must be a torch.Tensor, got list"):
        tk.attention_forward([1.0], torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16), False, 0.25)


def test_empty_batch_gives_empty_outputs():
    q, k, v, do = qkv(0, 4, 2, 8, 8, 32, torch.bfloat16)
    o, lse = tk.attention_forward(q, k, v, True, 0.2)
    assert o.shape == q.shape and lse.shape == (0, 4, 8)
    dq, dk, dv = tk.attention_backward(q, k, v, o, lse, do, True, 0.2)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_forward_in_one_loop_gives_the_same_bits(fp8, causal, monkeypatch):
    """``AttentionPlan.one_loop``: every key tile in one loop with the masks on each
    (the diagonal's and the last tiles in a loop of their own by default): the same
    o and lse, bit for bit, Tq != Tk and GQA."""
    from te_fuser.kernels.triton import attention as attn

    shape, scale = (1, 4, 2, 67, 45, 64), 0.125
    if fp8:
        fp8s, scale_invs = fp8_qkv(*shape, seed=3)
        p_scale = torch.tensor(448.0, device=DEVICE)

        def forward():
            return tk.attention_forward_fp8(*fp8s, *scale_invs, p_scale, causal, scale, torch.bfloat16)
    else:
        q, k, v, _ = qkv(*shape, torch.bfloat16, seed=3)

        def forward():
            return tk.attention_forward(q, k, v, causal, scale)
    kernel = "fwd_fp8" if fp8 else "fwd"
    two = forward()
    plans = dict(attn._INTERPRETED_PLANS) if DEVICE == "cpu" else dict(attn.ATTENTION_PLANS)
    if DEVICE == "cpu":
        plans[kernel] = dataclasses.replace(plans[kernel], one_loop=True)
        monkeypatch.setattr(attn, "_INTERPRETED_PLANS", plans)
    else:
        plans[(kernel, 64)] = dataclasses.replace(plans[(kernel, 64)], one_loop=True)
        monkeypatch.setattr(attn, "ATTENTION_PLANS", plans)
    one = forward()
    assert_bitwise(one[0], two[0], f"{kernel} o, one loop")
    assert_bitwise(one[1], two[1], f"{kernel} lse, one loop")


# ------------------------------------------------------------- GPU, real sizes


GPU_CASES = [(T, D, causal) for T in (1000, 4096) for D in (64, 128) for causal in (False, True)]


@gpu
@pytest.mark.parametrize("T,D,causal", GPU_CASES)
def test_gpu_bf16_at_real_sizes(T, D, causal):
    check_bf16_at_real_size(tk, T, D, causal)


def check_bf16_at_real_size(kernels, T, D, causal, name: str = "gpu"):
    """``kernels``' bf16 forward and backward (B 1, 8:2 heads, T, D) against the
    reference computed in fp32 from the same values."""
    shape = (1, 8, 2, T, T, D)
    q, k, v, do = qkv(*shape, torch.bfloat16, seed=T + D)
    scale = 1 / math.sqrt(D)
    o, lse = kernels.attention_forward(q, k, v, causal, scale)
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    o32, lse32 = ref.attention_forward_reference(q32, k32, v32, causal, scale)
    assert_close(o, o32, "attention_bf16", _context(f"{name} o", shape, "bf16", causal), scaled=True)
    assert_close(lse, lse32, "attention_fp32", _context(f"{name} lse", shape, "bf16", causal))
    got = kernels.attention_backward(q, k, v, o, lse, do, causal, scale)
    want = ref.attention_backward_reference(q32, k32, v32, o32, lse32, do32, causal, scale)
    del o32, lse32
    for grad, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, "attention_bf16", _context(f"{name} {grad}", shape, "bf16", causal), scaled=True)


@gpu
@pytest.mark.parametrize("T,D,causal", GPU_CASES)
def test_gpu_fp8_at_real_sizes(T, D, causal):
    shape = (1, 8, 2, T, T, D)
    fp8s, scale_invs = fp8_qkv(*shape, seed=T + D)
    scale = 1 / math.sqrt(D)
    p_scale = torch.tensor(448.0, device=DEVICE)
    o, lse = tk.attention_forward_fp8(*fp8s, *scale_invs, p_scale, causal, scale, torch.bfloat16)
    q32, k32, v32 = dequantized(fp8s, scale_invs, torch.float32)
    assert_within_fp8_bound(o, q32, k32, v32, causal, scale, 448.0, _context("gpu fp8 o", shape, "bf16", causal))
    _, lse32 = ref.attention_forward_reference(q32, k32, v32, causal, scale)
    assert_close(lse, lse32, "attention_fp8_lse", _context("gpu fp8 lse", shape, "bf16", causal))


def test_backward_writes_the_fused_qkv_gradient_layout():
    """The Triton backward's dq, dk, dv are consecutive head ranges of one
    (B, T, H + 2·Hkv, D) tensor, which DotProductAttention takes as the fused
    gradient without a concatenation; the values are the reference's."""
    from te_fuser.ops.basic.attention import _fused_gradient

    B, H, Hkv, T, D = 1, 4, 2, 45, 32
    q, k, v = (_randn((B, n, T, D), seed, std=0.5).to(DEVICE) for seed, n in ((1, H), (2, Hkv), (3, Hkv)))
    o, lse = tk.attention_forward(q, k, v, True, 1 / math.sqrt(D))
    do = _randn((B, H, T, D), 4).to(DEVICE)
    dq, dk, dv = tk.attention_backward(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
    fused = _fused_gradient(dq, dk, dv)
    assert fused is not None and tuple(fused.shape) == (B, T, H + 2 * Hkv, D)
    want = torch.cat([t.transpose(1, 2) for t in ref.attention_backward_reference(q, k, v, o, lse, do, True,
                                                                                    1 / math.sqrt(D))], dim=2)
    assert_close(fused, want, "attention_fp32", "fused dq|dk|dv", scaled=True)
    assert _fused_gradient(*(t.clone() for t in (dq, dk, dv))) is None  # separate tensors: concatenated


def test_the_dq_kernel_alone_hands_over_the_backwards_buffers():
    """``attention_dq_with_buffers``: the first kernel's dq and delta, with dk and dv
    the views beside dq of the same fused buffer (another dk / dv kernel fills them,
    as the cuda backend's grouped form does); dq and delta are those of the whole
    backward and of ``attention_dq``."""
    from te_fuser.kernels.triton import attention as attn

    B, H, Hkv, T, D = 1, 4, 2, 45, 32
    q, k, v = (_randn((B, n, T, D), seed, std=0.5).to(DEVICE) for seed, n in ((1, H), (2, Hkv), (3, Hkv)))
    o, lse = tk.attention_forward(q, k, v, True, 1 / math.sqrt(D))
    do = _randn((B, H, T, D), 4).to(DEVICE)
    dq, dk, dv, delta = attn.attention_dq_with_buffers(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
    base = dq.untyped_storage().data_ptr()
    assert dk.untyped_storage().data_ptr() == base and dv.untyped_storage().data_ptr() == base
    assert dk.shape == k.shape and dv.shape == v.shape and dk.stride() == dq.stride()
    whole = tk.attention_backward(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
    alone_dq, alone_delta = attn.attention_dq(q, k, v, o, lse, do, True, 1 / math.sqrt(D))
    assert torch.equal(dq, whole[0]) and torch.equal(dq, alone_dq) and torch.equal(delta, alone_delta)
    want = (o.double() * do.double()).sum(-1)
    assert_close(delta, want, "attention_fp32", "delta = rowsum(o * do)", scaled=True)

@pytest.mark.parametrize("B,H,Hkv,T,D,dtype", [(2, 4, 2, 37, 32, torch.bfloat16), (1, 2, 2, 20, 64, torch.float32)])
def test_merge_head_gradients_copies_the_bytes_into_the_fused_layout(B, H, Hkv, T, D, dtype):
    """The cuda backend's backward hands cuDNN's dense dq, dk, dv to one launch that
    writes the fused (B, T, H + 2·Hkv, D) gradient: the bytes of the three, in place."""
    from te_fuser.kernels.triton.attention import merge_head_gradients
    from te_fuser.ops.basic.attention import _fused_gradient

    dq = _randn((B, H, T, D), 1, dtype)
    dk = _randn((B, Hkv, T, D), 2, dtype)
    dv = _randn((B, Hkv, T, D), 3, dtype).transpose(1, 2).contiguous().transpose(1, 2)  # any strides
    got = merge_head_gradients(dq, dk, dv)
    fused = _fused_gradient(*got)
    assert fused is not None and tuple(fused.shape) == (B, T, H + 2 * Hkv, D)
    want = torch.cat([t.transpose(1, 2) for t in (dq, dk, dv)], dim=2)
    assert_bitwise(fused, want, "merged dq | dk | dv")
