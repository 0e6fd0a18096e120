"""The Triton grouped GEMMs against their reference on the same quantized operands.

Small shapes under the interpreter (odd and empty groups, tensor and row scales,
plain operands, bias and per-row bias scales, every output dtype; the wgrad's
groups starting off the 16-column grid, spanning one or several tiles, a NaN in a
neighbour's tokens; the TMA paths through the tile override); on a GPU also MoE
sizes (8 experts x 2048 tokens, K = N = 4096), where the FP8 tensor cores'
narrower accumulation gives the "fp8_gemm_tensor_core" bound.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from te_fuser.kernels.triton.gemm import Tiles
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
tk_grouped = importlib.import_module("te_fuser.kernels.triton.grouped_gemm")  # the package exports the function


def _tensorwise(x, fp8_dtype=E4M3) -> ScaledOperand:
    data, _, _, scale_inv, _ = ref.quantize_current_reference(x, fp8_dtype)
    return ScaledOperand(data, scale_inv, "tensor")


def _per_group(w, groups, fp8_dtype=E4M3) -> ScaledOperand:
    """Each group's rows cast with a scale of its own: row scales repeated per group."""
    casts = [_tensorwise(part, fp8_dtype) for part in w.chunk(groups)]
    data = torch.cat([c.data.view(torch.uint8) for c in casts]).view(fp8_dtype)
    rows = w.shape[0] // groups
    return ScaledOperand(data, torch.cat([c.scale_inv.reshape(1, 1).expand(rows, 1) for c in casts]), "row")


SCHEMES = {
    "tensor_x_group": (lambda x, g: _tensorwise(x), lambda w, g: _per_group(w, g)),
    "tensor_x_tensor_e5m2": (lambda x, g: _tensorwise(x, E5M2), lambda w, g: _tensorwise(w)),
    "row_x_row": (lambda x, g: ref.quantize_rowwise_reference(x, E4M3),
                  lambda w, g: ref.quantize_rowwise_reference(w, E4M3)),
    "plain_bf16": (lambda x, g: x.bfloat16(), lambda w, g: w.bfloat16()),
    "plain_fp32": (lambda x, g: x, lambda w, g: w),
}


def _offsets(splits):
    return torch.tensor([0, *torch.tensor(splits).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)


def _data(rows, cols, seed, off_centre=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=gen) * cols**-0.25
    if off_centre:
        t[: rows // 3] += 0.7
    return t.to(DEVICE)


def _fp8_on_gpu(a) -> bool:
    return DEVICE == "cuda" and isinstance(a, ScaledOperand)


def _tolerance(a, out_dtype):
    if out_dtype != torch.float32:  # on the GPU the narrow FP8 accumulator moves near-zero sums: bound by the largest
        return out_dtype, _fp8_on_gpu(a)
    return ("fp8_gemm_tensor_core", True) if _fp8_on_gpu(a) else ("fp8_gemm_fp32_out", False)


SPLITS = [0, 19, 5, 0, 24]  # empty groups first and inside, odd sizes


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_the_reference(scheme, out_dtype):
    groups, n, k = len(SPLITS), 24, 40
    x, w = _data(sum(SPLITS), k, 0), _data(groups * n, k, 1)
    bias = _data(groups, n, 2, off_centre=False)
    qa, qb = SCHEMES[scheme]
    a, b = qa(x, groups), qb(w, groups)
    offsets = _offsets(SPLITS)
    got = tk.grouped_gemm(a, b, offsets, out_dtype, bias=bias)
    want = ref.grouped_gemm_reference(a, b, offsets, out_dtype, bias=bias)
    assert got.dtype == out_dtype and got.shape == want.shape
    key, scaled = _tolerance(a, out_dtype)
    assert_close(got, want, key, f"grouped_gemm {scheme} splits={SPLITS}", scaled=scaled)


@pytest.mark.parametrize("scheme", ["tensor_x_tensor_e5m2", "row_x_row", "plain_bf16"])
def test_grouped_gemm_wgrad_matches_the_reference(scheme):
    """dw_g = dy_gᵀ x_g: the operands are the column-wise copies (N, M) and (K, M)."""
    n, k = 24, 40
    dy_t, x_t = _data(n, sum(SPLITS), 3), _data(k, sum(SPLITS), 4)
    qa, qb = SCHEMES[scheme]
    a, b = qa(dy_t, 1), qb(x_t, 1)
    offsets = _offsets(SPLITS)
    got = tk.grouped_gemm_wgrad(a, b, offsets)
    want = ref.grouped_gemm_wgrad_reference(a, b, offsets)
    assert got.shape == (len(SPLITS) * n, k)
    key, scaled = _tolerance(a, torch.float32)
    assert_close(got, want, key, f"grouped_gemm_wgrad {scheme} splits={SPLITS}", scaled=scaled)
    assert torch.count_nonzero(got[:n]) == 0 and torch.count_nonzero(got[3 * n:4 * n]) == 0  # empty groups


# Groups starting on and off the 16-column grid: a head and a tail in one 32-column
# tile (5 at 19), a group over several tiles with a head, inner tiles and a tail
# (67 at 24), one starting on the grid and ending on a tile boundary (32 at 96), a
# tail alone (3 at 128), empty groups on (at 0) and off (at 19) the grid, a last
# group off the grid ending at the matrix's end (144 tokens: TMA takes the pitch).
WGRAD_SPLITS = [0, 19, 0, 5, 67, 5, 32, 3, 13]


@pytest.fixture(params=[False, True], ids=["pointers", "tma"])
def tma(request, monkeypatch):
    """Both load paths: pointer loads, and (tile override) TMA descriptors, which
    the interpreter runs too (it checks their 16-byte aligned boxes). Yields
    whether TMA is asked for; every launch of the test must have used it then."""
    used = []
    sources = tk_grouped._sources

    def recording(a_mat, b_mat, t):
        out = sources(a_mat, b_mat, t)
        used.append(out[2])
        return out

    monkeypatch.setattr(tk_grouped, "_sources", recording)
    if request.param:
        for which in ("fprop", "wgrad"):
            monkeypatch.setitem(tk_grouped.TILE_OVERRIDES, which, Tiles(16, 16, 32, 1, 4, 1, use_tma=True))
    yield request.param
    assert used and all(u == request.param for u in used), used


@pytest.mark.parametrize("scheme", ["tensor_x_tensor_e5m2", "row_x_row", "plain_bf16", "plain_fp32"])
def test_grouped_gemm_wgrad_groups_off_the_16_column_grid(scheme, tma):
    n, k = 16, 32
    m = sum(WGRAD_SPLITS)
    dy_t, x_t = _data(n, m, 11), _data(k, m, 12)
    qa, qb = SCHEMES[scheme]
    a, b = qa(dy_t, 1), qb(x_t, 1)
    offsets = _offsets(WGRAD_SPLITS)
    got = tk.grouped_gemm_wgrad(a, b, offsets)
    want = ref.grouped_gemm_wgrad_reference(a, b, offsets)
    key, scaled = _tolerance(a, torch.float32)
    assert_close(got, want, key, f"grouped_gemm_wgrad {scheme} splits={WGRAD_SPLITS} tma={tma}", scaled=scaled)
    for g in (0, 2):
        assert torch.count_nonzero(got[g * n:(g + 1) * n]) == 0, f"empty group {g}"


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "e4m3"])
def test_grouped_gemm_wgrad_keeps_a_neighbours_nan_out_of_a_group(fp8, tma):
    """Tiles shared with a neighbour zero the neighbour's columns in both operands,
    so a NaN among its tokens (FP8 0x7F) stays in its own weight gradient."""
    splits, n, k = [21, 3, 40], 16, 32
    dy_t, x_t = _data(n, sum(splits), 13), _data(k, sum(splits), 14)
    a, b = dy_t, x_t
    if fp8:
        a, b = _tensorwise(dy_t), _tensorwise(x_t)
        b.data.view(torch.uint8)[:, 22] = 0x7F  # NaN in group 1's second token
    else:
        b[:, 22] = float("nan")
    offsets = _offsets(splits)
    got = tk.grouped_gemm_wgrad(a, b, offsets)
    want = ref.grouped_gemm_wgrad_reference(a, b, offsets)
    assert torch.isnan(want[n:2 * n]).all()
    if not (fp8 and DEVICE == "cpu"):  # the interpreter decodes FP8 NaN as a number (still a neighbour's)
        assert torch.isnan(got[n:2 * n]).all()
    key, scaled = _tolerance(a, torch.float32)
    for g in (0, 2):
        rows = slice(g * n, (g + 1) * n)
        assert_close(got[rows], want[rows], key, f"group {g} beside a NaN fp8={fp8}", scaled=scaled)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_bias_scaled_per_row(out_dtype, tma):
    """``bias_scale``: each row's bias times its scale (a router's probability), in the
    fp32 epilogue before the one rounding; bf16 scales are read exactly."""
    groups, n, k = len(SPLITS), 32, 64
    x, w = _data(sum(SPLITS), k, 15), _data(groups * n, k, 16)
    bias = _data(groups, n, 17, off_centre=False)
    gen = torch.Generator().manual_seed(18)
    scales = torch.rand(sum(SPLITS), generator=gen).bfloat16().to(DEVICE)
    a, b = _tensorwise(x), _per_group(w, groups)
    offsets = _offsets(SPLITS)
    got = tk.grouped_gemm(a, b, offsets, out_dtype, bias=bias, bias_scale=scales)
    want = ref.grouped_gemm_reference(a, b, offsets, out_dtype, bias=bias, bias_scale=scales)
    key, scaled = _tolerance(a, out_dtype)
    assert_close(got, want, key, f"grouped_gemm bias_scale tma={tma}", scaled=scaled)
    unscaled = ref.grouped_gemm_reference(a, b, offsets, torch.float32)
    expected = unscaled + torch.cat([bias[g].float().expand(m, n) * scales[sum(SPLITS[:g]):sum(SPLITS[:g + 1]), None]
                                     .float() for g, m in enumerate(SPLITS)])
    assert_close(want, expected.to(out_dtype), out_dtype if out_dtype != torch.float32 else "fp8_gemm_fp32_out",
                 "the reference's bias_scale")


def test_grouped_gemm_through_tma_descriptors_matches_the_reference(tma):
    """The fprop's TMA path (tile rows start anywhere, columns on tile boundaries)."""
    groups, n, k = len(SPLITS), 32, 64
    x, w = _data(sum(SPLITS), k, 19), _data(groups * n, k, 20)
    a, b = _tensorwise(x), _per_group(w, groups)
    offsets = _offsets(SPLITS)
    got = tk.grouped_gemm(a, b, offsets, torch.float32)
    want = ref.grouped_gemm_reference(a, b, offsets, torch.float32)
    key, scaled = _tolerance(a, torch.float32)
    assert_close(got, want, key, f"grouped_gemm tma={tma}", scaled=scaled)


def test_grouped_gemm_equals_one_dense_gemm_per_group():
    """Each group's rows get exactly the dense kernel's product with its weight (fp32
    accumulation of exact FP8 products; the order differs only on a GPU)."""
    splits, n, k = [13, 0, 21], 32, 64
    x, w = _data(sum(splits), k, 5), _data(len(splits) * n, k, 6)
    a, b = _tensorwise(x), _per_group(w, len(splits))
    got = tk.grouped_gemm(a, b, _offsets(splits), torch.bfloat16)
    start = 0
    for g, m in enumerate(splits):
        rows = ScaledOperand(a.data[start:start + m], a.scale_inv, "tensor")
        wg = ScaledOperand(b.data[g * n:(g + 1) * n], b.scale_inv[g * n, 0], "tensor")
        if m:
            want = tk.gemm(rows, wg, torch.bfloat16)
            assert_close(got[start:start + m], want, torch.bfloat16, f"group {g}")
        start += m


def test_bad_arguments_are_named():
    x, w = _tensorwise(_data(8, 32, 0)), _tensorwise(_data(3 * 16, 32, 1))
    with pytest.raises(ValueError, match="offsets"):
        tk.grouped_gemm(x, w, torch.tensor([0.0, 8.0], device=DEVICE))
    with pytest.raises(ValueError, match="equal size"):
        tk.grouped_gemm(x, _tensorwise(_data(50, 32, 1)), _offsets([4, 0, 4]))
    with pytest.raises(ValueError, match="bias"):
        tk.grouped_gemm(x, w, _offsets([4, 0, 4]), bias=torch.zeros(3, 8, device=DEVICE))
    bias = torch.zeros(3, 16, device=DEVICE)
    for fn in (tk.grouped_gemm, ref.grouped_gemm_reference):
        with pytest.raises(ValueError, match="there is none"):
            fn(x, w, _offsets([4, 0, 4]), bias_scale=torch.ones(8, device=DEVICE))
        with pytest.raises(ValueError, match=r"bias_scale must be a floating \(8,\) tensor"):
            fn(x, w, _offsets([4, 0, 4]), bias=bias, bias_scale=torch.ones(8, 1, device=DEVICE))
        with pytest.raises(ValueError, match="bias_scale must be a floating"):
            fn(x, w, _offsets([4, 0, 4]), bias=bias, bias_scale=torch.ones(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="rise from 0 to 8"):
        ref.grouped_gemm_reference(x, w, _offsets([4, 4, 4]))
    assert tk.grouped_gemm_unsupported_reason(ref.quantize_mxfp8_reference(_data(8, 32, 0), E4M3), w) is not None


@gpu_only
@pytest.mark.parametrize("splits", [[2048] * 8, [0, 3001, 1, 4095, 2048, 7000, 0, 239]])
def test_grouped_gemm_moe_sizes_on_the_gpu(splits):
    groups, n, k = len(splits), 4096, 4096
    x, w = _data(sum(splits), k, 7, off_centre=False), _data(groups * n, k, 8, off_centre=False)
    a, b = _tensorwise(x), _per_group(w, groups)
    offsets = _offsets(splits)
    bias = _data(groups, n, 9, off_centre=False)
    got = tk.grouped_gemm(a, b, offsets, torch.float32, bias=bias)
    want = ref.grouped_gemm_reference(a, b, offsets, torch.float32, bias=bias)
    assert_close(got, want, "fp8_gemm_tensor_core", f"grouped_gemm MoE splits={splits}", scaled=True)
    dy_t = _data(n, sum(splits), 10, off_centre=False)
    da, db = _tensorwise(dy_t, E5M2), _tensorwise(x.t().contiguous())
    got_w = tk.grouped_gemm_wgrad(da, db, offsets)
    want_w = ref.grouped_gemm_wgrad_reference(da, db, offsets)
    assert_close(got_w, want_w, "fp8_gemm_tensor_core", f"grouped_gemm_wgrad MoE splits={splits}", scaled=True)
