"""The Triton kernels at real sizes on a GPU (skipped without one).

Casts of 4096x4096 bit for bit (block casts also of transposed views, read in
place), GEMMs of 2048^3 for every scheme and epilogue against the reference on
the same quantized operands, and activations of 4M elements.
"""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from test_triton_gemm import gemm_tolerance
from tolerances import assert_bitwise, assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _big(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(rows, cols, device="cuda", generator=gen)
    x = x * torch.exp2(torch.randint(-14, 14, (rows, cols), device="cuda", generator=gen).float())
    x[:, 128:256] = 0.0
    x[7, 9] = float("nan")
    return x.bfloat16()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_casts_4096_bitwise(fp8_dtype):
    x = _big(4096, 4096)
    x_finite = torch.nan_to_num(x)
    scale = torch.tensor(0.37, device="cuda")
    for g, w in zip(tk.quantize_tensorwise(x_finite, scale, fp8_dtype, True, True),
                    ref.quantize_tensorwise_reference(x_finite, scale, fp8_dtype, True, True)):
        assert_bitwise(g, w, "tensorwise 4096")
    for g, w in zip(tk.quantize_current(x_finite, fp8_dtype, columnwise=True),
                    ref.quantize_current_reference(x_finite, fp8_dtype, columnwise=True)):
        assert_bitwise(g, w, "current 4096")
    pairs = [
        (tk.quantize_rowwise(x, fp8_dtype), ref.quantize_rowwise_reference(x, fp8_dtype)),
        (tk.quantize_block(x, fp8_dtype, 1), ref.quantize_block_reference(x, fp8_dtype, 1)),
        (tk.quantize_block(x[:4000, :4000], fp8_dtype, 128), ref.quantize_block_reference(x[:4000, :4000],
                                                                                          fp8_dtype, 128)),
        (tk.quantize_mxfp8(x, fp8_dtype), ref.quantize_mxfp8_reference(x, fp8_dtype)),
    ]
    for got, want in pairs:
        assert_bitwise(got.data, want.data, f"{want.scaling} data 4096")
        assert_bitwise(got.scale_inv, want.scale_inv, f"{want.scaling} scales 4096")
        assert_bitwise(tk.dequantize(got, torch.bfloat16), ref.dequantize_reference(want, torch.bfloat16),
                       f"{want.scaling} dequantize")


def _operands(scheme: str, x: torch.Tensor, w: torch.Tensor):
    if scheme == "tensor":
        qa, qb = ref.quantize_current_reference(x, E4M3), ref.quantize_current_reference(w, E4M3)
        return ScaledOperand(qa[0], qa[3], "tensor"), ScaledOperand(qb[0], qb[3], "tensor")
    if scheme == "row":
        return ref.quantize_rowwise_reference(x, E4M3), ref.quantize_rowwise_reference(w, E4M3)
    if scheme == "block_128x128":
        return ref.quantize_block_reference(x, E4M3, 1), ref.quantize_block_reference(w, E4M3, 128)
    if scheme == "block_1x128":
        return ref.quantize_block_reference(x, E4M3, 1), ref.quantize_block_reference(w, E4M3, 1)
    return ref.quantize_mxfp8_reference(x, E4M3), ref.quantize_mxfp8_reference(w, E4M3)


@pytest.mark.parametrize("scheme", ["tensor", "row", "block_128x128", "block_1x128", "mx"])
def test_gemm_2048_every_scheme(scheme):
    n = 2048
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, n, device="cuda", generator=gen) * n**-0.25
    w = torch.randn(n, n, device="cuda", generator=gen) * n**-0.25
    bias = torch.randn(n, device="cuda", generator=gen)
    a, b = _operands(scheme, x, w)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = tk.gemm(a, b, out_dtype)
        want = ref.gemm_reference(a, b, out_dtype)
        key, scaled = gemm_tolerance(a, b, out_dtype)
        err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        print(f"{scheme} {out_dtype}: max |error| / max |out| = {err:.2e}")
        assert_close(got, want, key, scheme, scaled=scaled)
    residual = torch.randn(n, n // 2, device="cuda", generator=gen)
    got = tk.gemm(a, b, torch.float32, bias=bias, activation="swiglu", residual=residual)
    want = ref.gemm_reference(a, b, torch.float32, bias=bias, activation="swiglu", residual=residual)
    key, scaled = gemm_tolerance(a, b, torch.float32)
    assert_close(got, want, key, f"{scheme} swiglu epilogue", scaled=scaled)
    got = tk.gemm(a, b, torch.bfloat16, bias=bias, activation="gelu")
    want = ref.gemm_reference(a, b, torch.bfloat16, bias=bias, activation="gelu")
    key, scaled = gemm_tolerance(a, b, torch.bfloat16)
    assert_close(got, want, key, f"{scheme} gelu epilogue", scaled=scaled)


@pytest.mark.parametrize("scheme", ["tensor", "mx"])
@pytest.mark.parametrize("m,n,k", [(1000, 1100, 1024), (3000, 2304, 992)])
def test_gemm_odd_shapes_at_the_large_tiles(scheme, m, n, k):
    """Output tiles cut by the matrix edge under the large-problem tiles (tensor
    256x128, MXFP8 128x256)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=gen) * k**-0.25
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.25
    a, b = _operands(scheme, x, w)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = tk.gemm(a, b, out_dtype)
        want = ref.gemm_reference(a, b, out_dtype)
        key, scaled = gemm_tolerance(a, b, out_dtype)
        assert_close(got, want, key, f"{scheme} {m}x{n}x{k}", scaled=scaled)


@pytest.mark.parametrize("kind", ["gelu", "relu", "silu", "swiglu"])
def test_activations_4m(kind):
    x = torch.randn(2048, 2048, device="cuda") * 3
    dy = torch.randn(2048, 1024 if kind == "swiglu" else 2048, device="cuda")
    assert_close(tk.activation(x, kind), ref.activation_reference(x, kind), torch.float32, kind)
    dx, dbias = tk.dact_dbias(dy, x, kind)
    dx_ref = ref.activation_grad_reference(dy.double(), x.double(), kind)
    assert_close(dx, dx_ref, torch.float32, f"{kind} dx")
    assert_close(dbias, dx_ref.sum(0), torch.float32, f"{kind} dbias", scaled=True)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("tile_rows", [1, 128])
@pytest.mark.parametrize("shape,dtype", [((4096, 4096), torch.bfloat16), ((8192, 1001), torch.bfloat16),
                                         ((1001, 8192), torch.float32)])
def test_block_cast_of_transposed_views_bitwise(fp8_dtype, tile_rows, shape, dtype):
    """Transposed views read in place: bytes and scales equal to the cast of the
    row-major copy (these gave wrong bytes on the H200 with the packed FP8 conversion)."""
    rows, cols = shape
    x = _big(cols, rows, seed=3).to(dtype).t()  # (rows, cols), strides (1, rows)
    got = tk.quantize_block(x, fp8_dtype, tile_rows)
    want = ref.quantize_block_reference(x, fp8_dtype, tile_rows)
    assert_bitwise(got.data, want.data, f"block {tile_rows} transposed {shape} {dtype} data")
    assert_bitwise(got.scale_inv, want.scale_inv, f"block {tile_rows} transposed {shape} {dtype} scales")


def test_amax_column_sums_at_the_linear_gradient_size():
    """16384 x 7168 bf16 (the big Linear's output gradient): the amax bit for bit,
    the sums against float64; the cast with that amax is the cast, on cuda too."""
    from te_fuser.kernels import cuda as ck

    x = _big(16384, 7168, seed=5)
    x_finite = torch.nan_to_num(x)
    amax, sums = tk.amax_column_sums(x_finite)
    amax_ref, _ = ref.amax_column_sums_reference(x_finite)
    assert_bitwise(amax, amax_ref, "amax")
    assert_close(sums, x_finite.double().sum(dim=0), "column_sums_fp32", "sums", scaled=True)
    amax_nan, _ = tk.amax_column_sums(x)
    assert torch.isnan(amax_nan)
    for cast in (tk.quantize_current, ck.quantize_current):
        given = cast(x_finite, E5M2, False, 0.0, True, True, amax)
        computed = cast(x_finite, E5M2, False, 0.0, True, True)
        for i, (g, c) in enumerate(zip(given, computed)):
            assert_bitwise(g, c, f"{cast.__module__} output {i}")


def test_quantize_tensorwise_column_sums_at_the_linear_gradient_size():
    """16384 x 7168 bf16 (the big Linear's output gradient) under delayed scaling:
    the Triton and the CUDA kernel's copies and amax bit for bit both plain casts,
    their sums against float64."""
    from te_fuser.kernels import cuda as ck

    x = torch.nan_to_num(_big(16384, 7168, seed=6))
    scale = torch.tensor(0.37, device="cuda")
    exact = x.double().sum(dim=0)
    for fused in (tk.quantize_tensorwise_column_sums, ck.quantize_tensorwise_column_sums):
        q, qt, amax, sums = fused(x, scale, E5M2, True, True)
        for cast in (tk.quantize_tensorwise, ck.quantize_tensorwise):
            for name, got, want in zip(("data", "data_t", "amax"), (q, qt, amax), cast(x, scale, E5M2, True, True)):
                assert_bitwise(got, want, f"{fused.__module__} vs {cast.__module__} {name}")
        assert_close(sums, exact, "column_sums_fp32", f"{fused.__module__} sums", scaled=True)


@pytest.mark.parametrize("maxnreg", [None, 64, 32])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_transposing_casts_under_a_register_cap_bitwise(fp8_dtype, maxnreg):
    """The transposing tensorwise and current casts under the transpose plan with a
    register cap (``CastPlan.maxnreg``, a launch option): the same bits as the
    reference, infinities included (NaN bytes) and a NaN row."""
    from te_fuser.kernels.triton import cast

    x = _big(4096, 4096)
    x[11, 13], x[17, 19] = float("inf"), float("-inf")
    x_finite = torch.nan_to_num(x, posinf=float("inf"), neginf=float("-inf"))
    scale = torch.tensor(0.37, device="cuda")
    saved = cast.CAST_PLANS["transpose"]
    cast.CAST_PLANS["transpose"] = cast.CastPlan(saved.block_m, saved.block_n, saved.num_warps, saved.programs_per_sm,
                                                 maxnreg)
    try:
        for g, w in zip(tk.quantize_tensorwise(x_finite, scale, fp8_dtype, True, True),
                        ref.quantize_tensorwise_reference(x_finite, scale, fp8_dtype, True, True)):
            assert_bitwise(g, w, f"tensorwise 4096, maxnreg {maxnreg}")
        y = torch.nan_to_num(x, posinf=0.0, neginf=0.0)  # current scaling: a finite amax
        for g, w in zip(tk.quantize_current(y, fp8_dtype, columnwise=True),
                        ref.quantize_current_reference(y, fp8_dtype, columnwise=True)):
            assert_bitwise(g, w, f"current 4096, maxnreg {maxnreg}")
    finally:
        cast.CAST_PLANS["transpose"] = saved
