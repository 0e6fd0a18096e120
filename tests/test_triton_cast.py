"""Triton FP8 casts against the reference casts, bit for bit.

On a machine without a GPU these run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1); with a GPU they run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from te_fuser import backend
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.operand import ScaledOperand
from tolerances import assert_bitwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
_GRID = {E4M3: (3, -9), E5M2: (2, -16)}  # mantissa bits, exponent of the subnormal step


def fp8_midpoints(fp8_dtype: torch.dtype) -> torch.Tensor:
    """Every value halfway between two neighbouring positive FP8 values (the ties of
    round-to-nearest-even), with their negatives; exact in bf16."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8_dtype).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    return torch.cat([mids, -mids])


def adversarial(rows: int, cols: int, fp8_dtype=E4M3, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Off-centre data over a wide range, FP8 ties, saturating values, zeros, -0.0
    and tiny values, scattered over a (rows, cols) matrix."""
    gen = torch.Generator().manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=gen).float())
    specials = torch.cat([
        fp8_midpoints(fp8_dtype),
        torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 1e5, -1e5, 57344.0, 61440.0, -7e4, 2.0**-10, -(2.0**-17),
                      1e-30, -1e-30, 2.0**-126]),
    ])
    flat = x.flatten()
    where = torch.randperm(flat.numel(), generator=gen)[: min(flat.numel(), specials.numel())]
    flat[where] = specials[: where.numel()]
    return flat.reshape(rows, cols).to(dtype).to(DEVICE)


def with_specials(x: torch.Tensor, values) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    for i, v in enumerate(values):
        flat[(i * 37) % flat.numel()] = v
    return x


def test_backend_dispatches_every_kernel_to_triton():
    for kernel in backend.KERNELS:
        choice = backend.resolve(kernel, DEVICE, backend="triton")
        per_call = hasattr(tk, f"{kernel}_unsupported_reason")  # wrapped: operands it cannot run fall back
        assert choice.backend == "triton" and (per_call or choice.fn is getattr(tk, kernel)), (kernel, choice)


def test_midpoints_are_ties():
    for fp8_dtype in FP8:
        mids = fp8_midpoints(fp8_dtype)
        assert torch.equal(mids.bfloat16().float(), mids)


# ------------------------------------------------------------------ tensorwise


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape,dtype", [((67, 160), torch.bfloat16), ((13, 96), torch.float32),
                                         ((40, 72), torch.float16), ((9, 40), torch.float64)])
def test_tensorwise_cast_transpose_amax_bitwise(fp8_dtype, shape, dtype):
    x = adversarial(*shape, fp8_dtype, dtype)
    scale = torch.tensor(1.0 if dtype == torch.float16 else 0.75, device=DEVICE)
    got = tk.quantize_tensorwise(x, scale, fp8_dtype, rowwise=True, columnwise=True)
    want = ref.quantize_tensorwise_reference(x, scale, fp8_dtype, rowwise=True, columnwise=True)
    for g, w, name in zip(got, want, ("data", "data_t", "amax")):
        assert_bitwise(g, w, f"quantize_tensorwise {name} {fp8_dtype} {dtype}")


def test_tensorwise_writes_amax_into_history_slot():
    x = adversarial(33, 80)
    history = torch.full((4,), 7.0, device=DEVICE)
    data, data_t, amax = tk.quantize_tensorwise(x, torch.tensor(2.0, device=DEVICE), E4M3, amax_out=history[2])
    assert data_t is None and amax.data_ptr() == history[2].data_ptr()
    assert history[2].item() == x.float().abs().amax().item()
    assert history[[0, 1, 3]].tolist() == [7.0, 7.0, 7.0]
    assert_bitwise(data, ref.quantize_tensorwise_reference(x, torch.tensor(2.0, device=DEVICE), E4M3)[0])


def test_tensorwise_columnwise_only_and_nan_inf():
    x = with_specials(adversarial(24, 64), [float("nan"), float("inf"), float("-inf"), -float("nan")])
    scale = torch.tensor(3.0, device=DEVICE)
    data, data_t, amax = tk.quantize_tensorwise(x, scale, E5M2, rowwise=False, columnwise=True)
    _, want_t, want_amax = ref.quantize_tensorwise_reference(x, scale, E5M2, rowwise=False, columnwise=True)
    assert data is None
    assert_bitwise(data_t, want_t, "data_t with NaN/inf")
    assert torch.isnan(amax) and torch.isnan(want_amax)


def test_tensorwise_saturates_tiny_and_huge_scales():
    x = adversarial(16, 48)
    for s in (1e30, 2.0**-40, 1.0e-45):
        scale = torch.tensor(s, device=DEVICE)
        got = tk.quantize_tensorwise(x, scale, E4M3)[0]
        assert_bitwise(got, ref.quantize_tensorwise_reference(x, scale, E4M3)[0], f"scale {s}")


def test_tensorwise_other_ranks():
    x3 = adversarial(6, 40).reshape(2, 3, 40)
    scale = torch.tensor(1.5, device=DEVICE)
    data, _, amax = tk.quantize_tensorwise(x3, scale, E4M3)
    want, _, want_amax = ref.quantize_tensorwise_reference(x3, scale, E4M3)
    assert data.shape == x3.shape
    assert_bitwise(data, want, "3-D")
    assert_bitwise(amax, want_amax, "3-D amax")


# --------------------------------------------------------------------- current


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("power_2,epsilon", [(False, 0.0), (True, 0.0), (False, 1e3), (True, 1e-12)])
def test_current_scaling_bitwise(fp8_dtype, power_2, epsilon):
    x = adversarial(67, 160, fp8_dtype, seed=3)
    got = tk.quantize_current(x, fp8_dtype, power_2, epsilon, rowwise=True, columnwise=True)
    want = ref.quantize_current_reference(x, fp8_dtype, power_2, epsilon, rowwise=True, columnwise=True)
    for g, w, name in zip(got, want, ("data", "data_t", "scale", "scale_inv", "amax")):
        assert_bitwise(g, w, f"quantize_current {name} power_2={power_2} eps={epsilon}")


@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf"), 1e-42])
def test_current_scaling_degenerate_amax(fill):
    x = torch.zeros(13, 96, device=DEVICE)
    x[5, 7] = fill
    got = tk.quantize_current(x, E4M3)
    want = ref.quantize_current_reference(x, E4M3)
    for g, w, name in zip(got, want, ("data", "data_t", "scale", "scale_inv", "amax")):
        if w is None:
            assert g is None
        elif name == "amax" and fill != fill:
            assert torch.isnan(g)
        else:
            assert_bitwise(g, w, f"quantize_current {name} with {fill}")


def test_current_scaling_many_programs():
    """More tiles than amax partials: the partial reduction must see every tile."""
    x = (-2.3 + 0.5 * torch.randn(150, 520)).bfloat16().to(DEVICE)
    x[149, 519] = 10240.0
    got = tk.quantize_current(x, E4M3)
    want = ref.quantize_current_reference(x, E4M3)
    assert_bitwise(got[0], want[0], "data")
    assert got[4].item() == 10240.0 and got[2].item() == want[2].item()


def test_current_scaling_non_contiguous_input():
    x = adversarial(96, 40).t()  # (40, 96), strided
    got = tk.quantize_current(x, E5M2, columnwise=True)
    want = ref.quantize_current_reference(x, E5M2, columnwise=True)
    assert_bitwise(got[0], want[0], "data")
    assert_bitwise(got[1], want[1], "data_t")


# ------------------------------------------------------------- row / block / mx


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("shape", [(67, 160), (19, 600)])  # rows in registers / swept twice
def test_rowwise_bitwise(fp8_dtype, power_2, shape):
    x = adversarial(*shape, fp8_dtype, seed=7)
    x[3] = 0.0
    x[9, 4] = float("nan")
    got = tk.quantize_rowwise(x, fp8_dtype, power_2, epsilon=1e-6 if power_2 else 0.0)
    want = ref.quantize_rowwise_reference(x, fp8_dtype, power_2, epsilon=1e-6 if power_2 else 0.0)
    assert got.scaling == "row"
    assert_bitwise(got.data, want.data, "rowwise data")
    assert_bitwise(got.scale_inv, want.scale_inv, "rowwise scale_inv")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("tile_rows", [1, 128])
@pytest.mark.parametrize("shape", [(67, 160), (133, 300), (128, 256)])  # the last: whole tiles only
def test_block_bitwise_with_partial_tiles(fp8_dtype, tile_rows, shape):
    x = adversarial(*shape, fp8_dtype, seed=11)
    x[:, 128:256] = 0.0  # an all-zero tile column: amax 0, scale 1
    x[1, 3] = float("nan")
    for power_2 in (True, False):
        got = tk.quantize_block(x, fp8_dtype, tile_rows, power_2)
        want = ref.quantize_block_reference(x, fp8_dtype, tile_rows, power_2)
        assert got.scaling == want.scaling
        assert_bitwise(got.data, want.data, f"block {tile_rows} data power_2={power_2}")
        assert_bitwise(got.scale_inv, want.scale_inv, f"block {tile_rows} scale_inv power_2={power_2}")


@pytest.mark.parametrize("shape", [(67, 160), (4, 512)])
def test_block_1x128_scales_lie_in_the_block_gemms_order(shape):
    """1x128 scales are stored K-block by K-block with the rows inner (what cuBLASLt's
    block-scaled GEMM reads), so the GEMM takes them without a copy; their values
    at each (row, K-block) are the reference's, and 128x128 grids stay row-major."""
    from te_fuser.kernels.cuda.gemm import _block_scales

    x = adversarial(*shape, E4M3, seed=5)
    op = tk.quantize_block(x, E4M3, 1)
    rows, k_blocks = op.scale_inv.shape
    assert (rows, k_blocks) == (shape[0], -(-shape[1] // 128))
    assert op.scale_inv.stride() == (1, rows) and op.scale_inv.t().is_contiguous()
    assert _block_scales(op).data_ptr() == op.scale_inv.data_ptr()  # no copy on the way to the GEMM
    assert_bitwise(_block_scales(op), ref.quantize_block_reference(x, E4M3, 1).scale_inv.t().contiguous(),
                   "1x128 scales in the GEMM's order")
    square = tk.quantize_block(x, E4M3, 128)
    assert square.scale_inv.is_contiguous() and _block_scales(square).data_ptr() == square.scale_inv.data_ptr()


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("tile_rows", [1, 128])
@pytest.mark.parametrize("shape,dtype", [((67, 160), torch.bfloat16), ((133, 300), torch.float32),
                                         ((128, 256), torch.bfloat16)])
def test_block_reads_transposed_and_strided_views_in_place(fp8_dtype, tile_rows, shape, dtype):
    """A transposed view (column-major) and a view strided in both dimensions are
    read as they lie: the same bytes and scales as their row-major copies."""
    rows, cols = shape
    base = adversarial(cols, rows, fp8_dtype, dtype, seed=19)
    base[:, :3] = 0.0  # x's first three rows all zero: a 1x128 tile with amax 0
    views = {"transposed": base.t(),  # (rows, cols), strides (1, rows)
             "strided": adversarial(2 * rows, 3 * cols, fp8_dtype, dtype, seed=23)[::2, ::3]}
    for name, x in views.items():
        assert not x.is_contiguous()
        got = tk.quantize_block(x, fp8_dtype, tile_rows)
        want = ref.quantize_block_reference(x.contiguous(), fp8_dtype, tile_rows)
        assert_bitwise(got.data, want.data, f"block {tile_rows} {name} {tuple(x.stride())} data")
        assert_bitwise(got.scale_inv, want.scale_inv, f"block {tile_rows} {name} scale_inv")


def test_block_launch_passes_the_view_not_a_copy(monkeypatch):
    """The launcher hands the kernel the caller's storage and strides."""
    from te_fuser.kernels.triton import cast

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(x, *args, **kwargs):
                seen.append((x.data_ptr(), x.stride(), args[4:6]))  # stride_xm, stride_xn
                return kernel[grid](x, *args, **kwargs)
            return launch

    kernel = cast._quantize_block_kernel
    monkeypatch.setattr(cast, "_quantize_block_kernel", Spy())
    x = adversarial(96, 40).t()  # (40, 96), strides (1, 40)
    got = tk.quantize_block(x, E4M3, 1)
    assert seen == [(x.data_ptr(), (1, 40), (1, 40))]
    assert_bitwise(got.data, ref.quantize_block_reference(x, E4M3, 1).data, "transposed view")


def test_every_fp8_value_and_nan_encodes_to_its_own_byte():
    """The integer FP8 encoding, exhaustively: each finite value (subnormals, -0.0
    and the largest included) casts with scale 1 to the byte it came from; NaN to
    0x7F (plus its sign bit, which a GPU's ``x * scale`` may drop); inf to 0x7F with
    its sign (an overflow stays visible), the largest finite fp32 to +-fmax."""
    codes = torch.arange(256, dtype=torch.uint8)
    for fp8_dtype in FP8:
        values = codes.view(fp8_dtype).float()
        finite = torch.isfinite(values)
        big = torch.finfo(torch.float32).max
        x = torch.cat([values[finite], torch.tensor([float("nan"), -float("nan"), big, -big, float("inf"),
                                                     -float("inf")])])
        x = x.reshape(-1, 1).expand(-1, 3).contiguous().to(DEVICE)  # odd width: masked tiles
        data, _, _ = tk.quantize_tensorwise(x, torch.tensor(1.0, device=DEVICE), fp8_dtype)
        want = ref.quantize_tensorwise_reference(x, torch.tensor(1.0, device=DEVICE), fp8_dtype)[0]
        assert_bitwise(data, want, f"every {fp8_dtype} value")
        assert torch.equal(data[: int(finite.sum()), 0].view(torch.uint8).cpu(), codes[finite])
        specials = data[-6:, 0].view(torch.uint8).tolist()
        assert [b & 0x7F for b in specials[:2]] == [0x7F, 0x7F]
        fmax = values[finite].max()
        assert specials[2:4] == [int(codes[finite][values[finite] == m]) for m in (fmax, -fmax)]
        assert specials[4:] == [0x7F, 0xFF]


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape,dtype", [((67, 160), torch.bfloat16), ((13, 96), torch.float32),
                                         ((64, 256), torch.bfloat16)])
def test_mxfp8_bitwise(fp8_dtype, shape, dtype):
    x = adversarial(*shape, fp8_dtype, dtype, seed=13)
    x[2, :32] = 0.0  # all-zero block: byte 0
    x[4, 40] = float("nan")  # block 1 of row 4: byte 255, NaN data
    x[6, 70] = float("inf")
    x[8, :32] = 1e-40 if dtype == torch.float32 else 0.0
    got = tk.quantize_mxfp8(x, fp8_dtype)
    want = ref.quantize_mxfp8_reference(x, fp8_dtype)
    assert got.scale_inv.dtype == torch.uint8
    assert_bitwise(got.data, want.data, "mxfp8 data")
    assert_bitwise(got.scale_inv, want.scale_inv, "mxfp8 scales")


# ------------------------------------------------------------------ dequantize


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_every_scaling_bitwise(out_dtype):
    x = adversarial(67, 160, seed=17) / 64
    scale = torch.tensor(3.0, device=DEVICE)
    q, _, _ = ref.quantize_tensorwise_reference(x, scale, E4M3)
    operands = [
        ScaledOperand(q, (1 / scale).float(), "tensor"),
        ref.quantize_rowwise_reference(x, E5M2),
        ref.quantize_block_reference(x, E4M3, 1, power_2=False),
        ref.quantize_block_reference(x, E4M3, 128),
        ref.quantize_mxfp8_reference(x, E5M2),
    ]
    for op in operands:
        assert_bitwise(tk.dequantize(op, out_dtype), ref.dequantize_reference(op, out_dtype), op.scaling)


def test_dequantize_decodes_nan_and_inf():
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).reshape(8, 32)
    for fp8_dtype in FP8:
        op = ref.quantize_mxfp8_reference(torch.ones(8, 32, device=DEVICE), fp8_dtype)
        op = ScaledOperand(codes.view(fp8_dtype), op.scale_inv, "mx_32")
        assert_bitwise(tk.dequantize(op), ref.dequantize_reference(op), f"all {fp8_dtype} codes")
        scales = torch.tensor([0, 1, 127, 200, 254, 255, 126, 128], dtype=torch.uint8, device=DEVICE)[:, None]
        op = ScaledOperand(codes.view(fp8_dtype), scales, "mx_32")
        assert_bitwise(tk.dequantize(op), ref.dequantize_reference(op), "E8M0 extremes")


# ---------------------------------------------------------------------- errors


def test_cast_errors_name_the_field():
    x = torch.randn(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_dtype"):
        tk.quantize_current(x, torch.float16)
    with pytest.raises(TypeError, match="x must be one of"):
        tk.quantize_rowwise(x.to(torch.int32), E4M3)
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        tk.quantize_tensorwise(x, torch.ones(2, device=DEVICE), E4M3)
    with pytest.raises(ValueError, match="tile_rows"):
        tk.quantize_block(x, E4M3, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        tk.quantize_mxfp8(x[:, :48], E4M3)
    with pytest.raises(ValueError, match="column-wise"):
        tk.quantize_current(x.reshape(2, 4, 64), E4M3, columnwise=True)
    with pytest.raises(ValueError, match="epsilon"):
        tk.quantize_current(x, E4M3, epsilon=-1.0)
    with pytest.raises(ValueError, match="amax_out"):
        tk.quantize_tensorwise(x, torch.tensor(1.0, device=DEVICE), E4M3, amax_out=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="out_dtype"):
        tk.dequantize(ref.quantize_rowwise_reference(x, E4M3), torch.int8)


def test_empty_inputs():
    x = torch.empty(0, 64, device=DEVICE)
    got = tk.quantize_current(x, E4M3, columnwise=True)
    want = ref.quantize_current_reference(x, E4M3, columnwise=True)
    assert got[0].shape == (0, 64) and got[1].shape == (64, 0)
    assert [t.item() for t in got[2:]] == [t.item() for t in want[2:]]
    assert tk.quantize_tensorwise(x, torch.tensor(1.0, device=DEVICE), E4M3)[2].item() == 0.0


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("tile_rows", [1, 128])
@pytest.mark.parametrize("shape", [(67, 160), (256, 128), (130, 300)])
def test_block_both_copies_from_one_read(fp8_dtype, tile_rows, shape):
    """``columnwise``: x.T's copy from the same read is the cast of x.T, bit for bit
    (1x128: its own scales per 128 rows of x; 128x128: the tiles transposed), beside
    the row-wise copy; without ``rowwise`` only the column-wise copy."""
    x = adversarial(*shape, fp8_dtype, seed=29)
    x[:3, :] = 0.0  # all-zero columns of x.T's first tiles
    for power_2 in (True, False):
        op, op_t = tk.quantize_block(x, fp8_dtype, tile_rows, power_2, 0.0, True, True)
        want = ref.quantize_block_reference(x, fp8_dtype, tile_rows, power_2)
        want_t = (ref.quantize_block_reference(x.t().contiguous(), fp8_dtype, 1, power_2) if tile_rows == 1 else
                  ScaledOperand(want.data.t().contiguous(), want.scale_inv.t().contiguous(), want.scaling))
        context = f"block {tile_rows} {shape} power_2={power_2}"
        assert_bitwise(op.data, want.data, context + " rowwise data")
        assert_bitwise(op.scale_inv, want.scale_inv, context + " rowwise scales")
        assert op_t.scaling == want_t.scaling and op_t.data.shape == (shape[1], shape[0])
        assert_bitwise(op_t.data, want_t.data, context + " columnwise data")
        assert_bitwise(op_t.scale_inv, want_t.scale_inv, context + " columnwise scales")
        ref_pair = ref.quantize_block_reference(x, fp8_dtype, tile_rows, power_2, 0.0, True, True)
        assert_bitwise(ref_pair[1].data, want_t.data, context + " the reference's pair")
    none, only_t = tk.quantize_block(x, fp8_dtype, tile_rows, False, 0.0, False, True)  # power_2 as the last op_t
    assert none is None and torch.equal(only_t.data.view(torch.uint8), op_t.data.view(torch.uint8))
    with pytest.raises(ValueError, match="quantize_block: rowwise and columnwise are both False"):
        tk.quantize_block(x, fp8_dtype, tile_rows, True, 0.0, False, False)


def test_block_cast_checks_each_new_configuration_and_keeps_its_launch():
    """A configuration's arguments are checked the first time it is seen, an error
    naming the argument, and nothing is kept for it; a checked one keeps its launch
    constants, and a later call with another x of the same kind takes them (the same
    bytes as a first call)."""
    from te_fuser.kernels.triton import cast

    x = adversarial(64, 256, E4M3, seed=31)
    with pytest.raises(ValueError, match="tile_rows: must be 1 \\(1x128\\) or 128 \\(128x128\\), got 64"):
        tk.quantize_block(x, E4M3, 64)
    with pytest.raises(ValueError, match="quantize_block: epsilon must be >= 0, got -1.0"):
        tk.quantize_block(x, E4M3, 1, True, -1.0)
    with pytest.raises(TypeError, match="quantize_block: columnwise must be a bool, got int"):
        tk.quantize_block(x, E4M3, 1, True, 0.0, True, 1)
    with pytest.raises(TypeError, match="quantize_block: x must be one of .*got torch.int32"):
        tk.quantize_block(x.to(torch.int32), E4M3, 1)
    with pytest.raises(ValueError, match="quantize_block: x must be 2-D, got shape \\(2, 32, 256\\)"):
        tk.quantize_block(x.reshape(2, 32, 256), E4M3, 1)
    assert not [key for key in cast._BLOCK_LAUNCHES if key[4] == 64 or key[6] == -1.0 or key[1] == torch.int32]
    first = tk.quantize_block(x, E4M3, 1)
    kept = len(cast._BLOCK_LAUNCHES)
    y = adversarial(96, 384, E4M3, seed=37)
    again = tk.quantize_block(y, E4M3, 1)
    assert len(cast._BLOCK_LAUNCHES) == kept
    assert_bitwise(again.data, ref.quantize_block_reference(y, E4M3, 1).data, "a kept configuration")
    assert_bitwise(first.scale_inv, ref.quantize_block_reference(x, E4M3, 1).scale_inv, "its first call")


def test_block_cast_follows_the_encoding_switched_at_run_time(monkeypatch):
    """The kept launch constants follow the FP8 encoding in force at each call
    (``hw_fp8``, which reads EXACT_FP8: the benchmarks and the defect check switch it
    between calls); here hw_fp8 answers as on a GPU, the launch is stubbed."""
    from te_fuser.kernels.triton import _common, cast

    x = adversarial(32, 128, E4M3, seed=41)
    seen = []
    monkeypatch.setattr(cast, "launch", lambda kernel, grid, *args, **meta: seen.append(meta["HW_FP8"]))
    monkeypatch.setattr(cast, "hw_fp8", lambda t: not _common.EXACT_FP8)
    for exact in (False, True, False):
        monkeypatch.setattr(_common, "EXACT_FP8", exact)
        tk.quantize_block(x, E4M3, 1)
    assert seen == [True, False, True]
