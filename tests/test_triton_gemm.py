"""Triton FP8 GEMMs and their fused epilogues against ``gemm_reference``.

Both sides get the same quantized operands (exactly representable inputs); the
reference dequantizes them and multiplies in fp32. Only the accumulation order
and the output rounding differ: tolerances "fp8_gemm_fp32_out" and bf16.
"""

from __future__ import annotations

import importlib

import pytest
import torch

triton_gemm = importlib.import_module("te_fuser.kernels.triton.gemm")  # the module (the package's `gemm` is the kernel)
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from tolerances import assert_bitwise, assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _tensorwise(x: torch.Tensor, fp8_dtype) -> ScaledOperand:
    data, _, _, scale_inv, _ = ref.quantize_current_reference(x, fp8_dtype)
    return ScaledOperand(data, scale_inv, "tensor")


# scheme -> (quantizer of a, quantizer of b)
SCHEMES = {
    "tensor_x_tensor": (lambda x: _tensorwise(x, E4M3), lambda w: _tensorwise(w, E4M3)),
    "row_x_row": (lambda x: ref.quantize_rowwise_reference(x, E4M3),
                  lambda w: ref.quantize_rowwise_reference(w, E4M3)),
    "tensor_x_row_e5m2": (lambda x: _tensorwise(x, E5M2), lambda w: ref.quantize_rowwise_reference(w, E4M3)),
    "row_x_tensor": (lambda x: ref.quantize_rowwise_reference(x, E4M3), lambda w: _tensorwise(w, E4M3)),
    "block_1x128_x_128x128": (lambda x: ref.quantize_block_reference(x, E4M3, 1),
                              lambda w: ref.quantize_block_reference(w, E4M3, 128)),
    "block_1x128_x_1x128": (lambda x: ref.quantize_block_reference(x, E5M2, 1, power_2=False),
                            lambda w: ref.quantize_block_reference(w, E4M3, 1)),
    "mx_x_mx": (lambda x: ref.quantize_mxfp8_reference(x, E4M3), lambda w: ref.quantize_mxfp8_reference(w, E4M3)),
    "mx_e5m2_x_mx": (lambda x: ref.quantize_mxfp8_reference(x, E5M2),
                     lambda w: ref.quantize_mxfp8_reference(w, E4M3)),
    "plain_fp32": (lambda x: x, lambda w: w),
    "plain_bf16": (lambda x: x.bfloat16(), lambda w: w.bfloat16()),
    "mixed_mx_x_row": (lambda x: ref.quantize_mxfp8_reference(x, E4M3),
                       lambda w: ref.quantize_rowwise_reference(w, E4M3)),
}


def _inputs(m: int, n: int, k: int, seed: int = 0):
    """O(1) products: x, w ~ N(0, 1/sqrt(K)) scaled, with an off-centre block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * k**-0.25
    x[: m // 3] += 0.7  # off-centre rows
    w = torch.randn(n, k, generator=gen) * k**-0.25
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE)


def fp8_tensor_cores(a, b) -> bool:
    """Whether the GPU multiplies these operands on FP8 tensor cores (whose
    accumulator is narrower than fp32); MXFP8 products run as bf16 ones."""
    return DEVICE == "cuda" and all(isinstance(op, ScaledOperand) and op.scaling != "mx_32" for op in (a, b))


def gemm_tolerance(a, b, out_dtype) -> tuple[object, bool]:
    """(tolerance key, scaled) for a Triton GEMM against gemm_reference."""
    if fp8_tensor_cores(a, b):
        return ("fp8_gemm_tensor_core" if out_dtype == torch.float32 else out_dtype), True
    return ("fp8_gemm_fp32_out" if out_dtype == torch.float32 else out_dtype), False


def _check(a, b, out_dtype, context, fast_accum=False, **epilogue):
    got = tk.gemm(a, b, out_dtype, fast_accum=fast_accum, **epilogue)
    want = ref.gemm_reference(a, b, out_dtype, **epilogue)
    assert got.dtype == out_dtype and got.shape == want.shape
    key, scaled = gemm_tolerance(a, b, out_dtype)
    assert_close(got, want, key, context, scaled=scaled)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_every_scheme(scheme, out_dtype):
    x, w, _ = _inputs(67, 96, 160)
    qa, qb = SCHEMES[scheme]
    _check(qa(x), qb(w), out_dtype, f"{scheme} (67x96x160)")


@pytest.mark.parametrize("scheme", ["tensor_x_tensor", "row_x_row", "tensor_x_row_e5m2"])
def test_gemm_fast_accumulation_stays_within_tolerance(scheme):
    """One promotion to fp32 at the end of a long K loop instead of one per 128."""
    x, w, bias = _inputs(40, 48, 1024 if DEVICE == "cuda" else 384, seed=3)
    qa, qb = SCHEMES[scheme]
    _check(qa(x), qb(w), torch.bfloat16, f"{scheme} fast_accum", fast_accum=True, bias=bias)


@pytest.mark.parametrize("scheme", ["tensor_x_tensor", "row_x_row", "block_1x128_x_128x128",
                                    "block_1x128_x_1x128", "mx_x_mx", "plain_bf16"])
@pytest.mark.parametrize("activation", [None, "gelu", "relu", "silu", "swiglu"])
def test_gemm_fused_epilogue(scheme, activation):
    m, n, k = 64, 64, 64
    x, w, bias = _inputs(m, n, k, seed=1)
    n_out = n // 2 if activation == "swiglu" else n
    residual = torch.randn(m, n_out, device=DEVICE)
    qa, qb = SCHEMES[scheme]
    _check(qa(x), qb(w), torch.float32, f"{scheme} {activation}", bias=bias, activation=activation,
           residual=residual)


def test_gemm_bias_only_and_residual_only_bf16():
    x, w, bias = _inputs(45, 160, 128, seed=2)
    a, b = ref.quantize_block_reference(x, E4M3, 1), ref.quantize_block_reference(w, E4M3, 128)
    _check(a, b, torch.bfloat16, "bias", bias=bias.bfloat16())
    _check(a, b, torch.bfloat16, "residual", residual=torch.randn(45, 160, device=DEVICE).bfloat16())


def test_gemm_swiglu_spans_block_scale_rows():
    """SwiGLU's up half starts mid-way through B's 128-row scale tiles."""
    x, w, bias = _inputs(40, 320, 256, seed=3)
    w[200:] *= 30.0  # a different scale for the up rows
    a, b = ref.quantize_block_reference(x, E4M3, 1), ref.quantize_block_reference(w, E4M3, 128)
    _check(a, b, torch.float32, "swiglu 1x128 x 128x128", bias=bias, activation="swiglu")


def test_mxfp8_other_product_path(monkeypatch):
    """The other MXFP8 product path (tl.dot_scaled or tiles scaled in registers) gives the same result."""
    monkeypatch.setattr(triton_gemm, "MXFP8_DOT_SCALED", not triton_gemm.MXFP8_DOT_SCALED)
    x, w, bias = _inputs(33, 64, 96, seed=4)
    qa, qb = SCHEMES["mx_e5m2_x_mx"]
    _check(qa(x), qb(w), torch.float32, "mx in registers", bias=bias, activation="swiglu")


def test_gemm_zero_and_saturated_blocks():
    x, w, _ = _inputs(64, 64, 256, seed=5)
    x[:, :128] = 0.0  # amax-0 blocks in every scheme
    x[5, 130] = 1e4  # a row/block whose scale is set by one large value
    for scheme in ("row_x_row", "block_1x128_x_128x128", "mx_x_mx", "tensor_x_tensor"):
        qa, qb = SCHEMES[scheme]
        _check(qa(x), qb(w), torch.float32, f"{scheme} zero blocks")


def test_gemm_non_contiguous_operands_and_output_order():
    x, w, _ = _inputs(96, 64, 128, seed=6)
    qa = ref.quantize_rowwise_reference(x, E4M3)
    qb = ref.quantize_rowwise_reference(w, E4M3)
    strided = ScaledOperand(qa.data.t().contiguous().t(), qa.scale_inv, "row")  # column-major data
    _check(strided, qb, torch.float32, "column-major a")


def test_gemm_errors_name_the_constraint():
    x, w, bias = _inputs(16, 32, 64)
    a, b = _tensorwise(x, E4M3), _tensorwise(w, E4M3)
    with pytest.raises(ValueError, match="reduction dims"):
        tk.gemm(a, _tensorwise(w[:, :32], E4M3))
    with pytest.raises(ValueError, match="bias must be a"):
        tk.gemm(a, b, bias=bias[:5])
    with pytest.raises(ValueError, match="residual must be a"):
        tk.gemm(a, b, residual=torch.zeros(16, 31, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        tk.gemm(a, b, activation="tanh")
    with pytest.raises(ValueError, match="swiglu needs an even"):
        tk.gemm(a, _tensorwise(w[:31], E4M3), activation="swiglu")
    with pytest.raises(ValueError, match="out_dtype"):
        tk.gemm(a, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="ScaledOperand or a torch.Tensor"):
        tk.gemm(a, [1, 2])


def test_gemm_empty_reduction_gives_epilogue_of_zeros():
    a = torch.zeros(4, 0, device=DEVICE)
    b = torch.zeros(6, 0, device=DEVICE)
    bias = torch.arange(6.0, device=DEVICE)
    got = tk.gemm(a, b, torch.float32, bias=bias, activation="relu")
    assert torch.equal(got, bias.expand(4, 6))


@pytest.mark.parametrize("scheme", ["tensor_x_row_e5m2", "block_1x128_x_128x128", "mx_x_mx", "plain_bf16"])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_gemm_tma_descriptor_path(monkeypatch, scheme, activation):
    """The TMA-descriptor loads (the GPU default) on ragged shapes: zero fill past the edges."""
    for family, block_k in (("tensor", 64), ("block", 128), ("mx", 128), ("plain", 32)):
        monkeypatch.setitem(triton_gemm.TILE_OVERRIDES, family,
                            triton_gemm.Tiles(32, 32, block_k, 4, 4, 1, use_tma=True))
    x, w, bias = _inputs(67, 96, 160, seed=7)
    qa, qb = SCHEMES[scheme]
    _check(qa(x), qb(w), torch.float32, f"{scheme} {activation} TMA", bias=bias, activation=activation)


def test_gemm_256_deep_tiles(monkeypatch):
    """A 256-deep tile (the GEMM sweep's) covers K in fewer, deeper steps; ragged K
    is zero-filled and the result matches the reference."""
    monkeypatch.setitem(triton_gemm.TILE_OVERRIDES, "tensor", triton_gemm.Tiles(32, 32, 256, 4, 4, 1, use_tma=False))
    x, w, bias = _inputs(37, 40, 640, seed=9)
    qa, qb = SCHEMES["tensor_x_row_e5m2"]
    _check(qa(x), qb(w), torch.float32, "tensor 256-deep tiles", bias=bias, activation="gelu")


@pytest.mark.parametrize("scheme", ["tensor_x_tensor", "block_1x128_x_128x128", "mx_x_mx", "plain_bf16"])
@pytest.mark.parametrize("fp8_dtype,activation", [(E4M3, "gelu"), (E5M2, "swiglu"), (E4M3, None)])
def test_gemm_fp8_out_is_the_cast_of_the_fp32_gemm(scheme, fp8_dtype, activation):
    """The FP8-output epilogue equals quantize_tensorwise of the same kernel's fp32
    result, bit for bit: data, saturation and the amax."""
    x, w, bias = _inputs(67, 96, 160, seed=8)
    n_out = 48 if activation == "swiglu" else 96
    residual = torch.randn(67, n_out, device=DEVICE)
    qa, qb = SCHEMES[scheme]
    a, b = qa(x), qb(w)
    out_scale = torch.tensor(96.0 if fp8_dtype == E4M3 else 12288.0, device=DEVICE)  # saturates some outputs
    epilogue = dict(bias=bias, activation=activation, residual=residual)
    got, amax = tk.gemm_fp8_out(a, b, out_scale, fp8_dtype, **epilogue)
    y = tk.gemm(a, b, torch.float32, **epilogue)
    want, _, want_amax = ref.quantize_tensorwise_reference(y, out_scale, fp8_dtype)
    assert_bitwise(got, want, f"{scheme} {activation} FP8 output")
    assert_bitwise(amax, want_amax, f"{scheme} {activation} amax")
    assert (got.view(torch.uint8) & 0x7F).eq(0x7E if fp8_dtype == E4M3 else 0x7B).any(), "no output saturated"


def test_gemm_fp8_out_amax_slot_and_errors():
    x, w, _ = _inputs(16, 32, 64, seed=9)
    a, b = _tensorwise(x, E4M3), _tensorwise(w, E4M3)
    history = torch.full((3,), -1.0, device=DEVICE)
    out, amax = tk.gemm_fp8_out(a, b, torch.tensor(1.0, device=DEVICE), E4M3, amax_out=history[1])
    assert amax.data_ptr() == history[1].data_ptr() and out.dtype == E4M3
    assert history[1].item() == tk.gemm(a, b, torch.float32).abs().max().item()
    with pytest.raises(ValueError, match="out_scale must be"):
        tk.gemm_fp8_out(a, b, torch.ones(2, device=DEVICE), E4M3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        tk.gemm_fp8_out(a, b, torch.tensor(1.0, device=DEVICE), torch.bfloat16)


@pytest.mark.parametrize("round_to", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,activation", [("tensor_x_tensor", "gelu"), ("mx_x_mx", "swiglu")])
def test_gemm_fp8_out_rounds_to_the_compute_dtype_first(scheme, activation, round_to):
    """``round_to``: the cast and amax of ``gemm(..., round_to)``, bit for bit, and
    the reference kernel agrees."""
    x, w, bias = _inputs(67, 96, 160, seed=10)
    qa, qb = SCHEMES[scheme]
    a, b = qa(x), qb(w)
    out_scale = torch.tensor(3.0, device=DEVICE)
    got, amax = tk.gemm_fp8_out(a, b, out_scale, E4M3, bias=bias, activation=activation, round_to=round_to)
    y = tk.gemm(a, b, round_to, bias=bias, activation=activation)
    want, _, want_amax = ref.quantize_tensorwise_reference(y, out_scale, E4M3)
    assert_bitwise(got, want, f"{scheme} {activation} FP8 output rounded to {round_to}")
    assert_bitwise(amax, want_amax, f"{scheme} {activation} amax rounded to {round_to}")
    slot = torch.zeros(1, device=DEVICE)
    ref_got, ref_amax = ref.gemm_fp8_out_reference(a, b, out_scale, E4M3, bias=bias, activation=activation,
                                                   round_to=round_to, amax_out=slot)
    y_ref = ref.gemm_reference(a, b, round_to, bias=bias, activation=activation)
    want_ref, _, want_ref_amax = ref.quantize_tensorwise_reference(y_ref, out_scale, E4M3)
    assert_bitwise(ref_got, want_ref, "reference FP8 output")
    assert ref_amax.data_ptr() == slot.data_ptr() and torch.equal(slot.reshape(()), want_ref_amax)


@pytest.mark.parametrize("kind", ["geglu", "srelu", "qgelu"])
def test_the_epilogue_refuses_activations_it_does_not_apply(kind):
    """Activations outside the GEMM epilogue's set are refused by name (the epilogue
    rules decline them, so the activation runs as its own op)."""
    a = ScaledOperand(torch.zeros(16, 32).to(torch.float8_e4m3fn), torch.tensor(1.0), "tensor")
    for gemm in (tk.gemm, ref.gemm_reference):  # one check, next to the reference, that every backend runs
        with pytest.raises(ValueError, match=f"the epilogue applies gelu, relu, silu, swiglu, not '{kind}'"):
            gemm(a, a, torch.float32, activation=kind)
