"""CUDA FP8 casts against the reference casts, bit for bit (needs a Hopper GPU).

Both sides run on the same GPU tensors; one test also compares with the
reference on CPU. Inputs are adversarial: off-centre data spanning many
binades, values that saturate, FP8 subnormals, exact ties, all-zero tiles, inf
and NaN, odd shapes (67x1408, 13x8704, 33x67), views and misaligned starts.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise, assert_close

from te_fuser.kernels import cuda
from te_fuser.kernels import reference as ref

REASON = cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cuda backend unavailable: {REASON}")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
HP = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(4096, 4096), (67, 1408), (13, 8704), (33, 67), (128, 72), (1, 1)]
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def _data(shape, dtype, seed=0):
    """Off-centre data over many binades, with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    if x.numel() > 8:
        x.view(-1)[:: max(1, x.numel() // 5)] = 0.0
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).cuda()


def _ctx(name, x, fp8):
    return f"{name} x={tuple(x.shape)} {x.dtype} -> {fp8}"


def _same_amax(actual, expected, context):
    if torch.isnan(expected).any():
        assert torch.isnan(actual).all(), context
    else:
        assert_bitwise(actual, expected, context)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_quantize_tensorwise_cast_transpose(shape, hp, fp8):
    x = _data(shape, hp, seed=shape[0])
    # Half the values saturate; the small ones land on FP8 subnormals.
    scale = torch.tensor(2.0 * FMAX[fp8] / x.float().abs().max().clamp(min=1e-30).item(), device="cuda")
    got = cuda.quantize_tensorwise(x, scale, fp8, rowwise=True, columnwise=True)
    want = ref.quantize_tensorwise_reference(x, scale, fp8, rowwise=True, columnwise=True)
    ctx = _ctx("quantize_tensorwise", x, fp8)
    assert_bitwise(got[0], want[0], ctx + " data")
    assert_bitwise(got[1], want[1], ctx + " data_t")
    assert_bitwise(got[2], want[2], ctx + " amax")


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (False, False)])
def test_quantize_tensorwise_layouts_and_amax_slot(rowwise, columnwise):
    x = _data((67, 1408), torch.bfloat16, seed=3)
    scale = torch.tensor(3.0, device="cuda")
    history = torch.full((4,), 7.0, device="cuda")
    slot = history[2]
    data, data_t, amax = cuda.quantize_tensorwise(x, scale, E4M3, rowwise, columnwise, amax_out=slot)
    want = ref.quantize_tensorwise_reference(x, scale, E4M3, rowwise, columnwise)
    assert amax is slot
    assert history[[0, 1, 3]].eq(7.0).all(), "only the given history slot is written"
    assert_bitwise(history[2], want[2], "amax slot")
    assert (data is None) == (not rowwise) and (data_t is None) == (not columnwise)
    if rowwise:
        assert_bitwise(data, want[0], "data")
    if columnwise:
        assert_bitwise(data_t, want[1], "data_t")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("columnwise", [True, False])
def test_quantize_tensorwise_column_sums(shape, hp, columnwise):
    """Bit for bit the plain cast (the copies and the amax); the column sums, from
    the tiles of the transposing kernel, against float64."""
    x = _data(shape, hp, seed=shape[1])
    scale = torch.tensor(0.37, device="cuda")
    *got, sums = cuda.quantize_tensorwise_column_sums(x, scale, E5M2, True, columnwise)
    plain = cuda.quantize_tensorwise(x, scale, E5M2, True, columnwise)
    ctx = _ctx("quantize_tensorwise_column_sums", x, E5M2)
    for name, g, p in zip(("data", "data_t", "amax"), got, plain):
        assert (g is None) == (p is None), f"{ctx} {name}"
        if p is not None:
            assert_bitwise(g, p, f"{ctx} {name}")
    assert sums.shape == (shape[1],) and sums.dtype == torch.float32, ctx
    assert_close(sums, x.double().sum(dim=0), "column_sums_fp32", f"{ctx} sums", scaled=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("columnwise", [True, False])
def test_quantize_current_column_sums(shape, hp, columnwise):
    """Bit for bit the plain current-scaling cast (copies, scales, amax); the column
    sums, from the tiles of the transposing cast, against float64."""
    x = _data(shape, hp, seed=shape[0] + 1)
    *got, sums = cuda.quantize_current_column_sums(x, E5M2, False, 0.0, True, columnwise)
    plain = cuda.quantize_current(x, E5M2, False, 0.0, True, columnwise)
    want = ref.quantize_current_column_sums_reference(x, E5M2, False, 0.0, True, columnwise)
    ctx = _ctx("quantize_current_column_sums", x, E5M2)
    for name, g, p, w in zip(("data", "data_t", "scale", "scale_inv", "amax"), got, plain, want):
        assert (g is None) == (p is None) == (w is None), f"{ctx} {name}"
        if p is not None:
            assert_bitwise(g, p, f"{ctx} {name}")
            assert_bitwise(g, w, f"{ctx} {name} (reference)")
    assert sums.shape == (shape[1],) and sums.dtype == torch.float32, ctx
    assert_close(sums, x.double().sum(dim=0), "column_sums_fp32", f"{ctx} sums", scaled=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_quantize_current(shape, hp, fp8):
    x = _data(shape, hp, seed=shape[1])
    got = cuda.quantize_current(x, fp8, rowwise=True, columnwise=True)
    want = ref.quantize_current_reference(x, fp8, rowwise=True, columnwise=True)
    ctx = _ctx("quantize_current", x, fp8)
    for name, g, w in zip(("data", "data_t", "scale", "scale_inv", "amax"), got, want):
        assert_bitwise(g, w, f"{ctx} {name}")


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("case", ["zeros", "tiny", "inf", "nan", "huge"])
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_quantize_current_edge_cases(case, epsilon, power_2, fp8):
    x = _data((67, 1408), torch.float32, seed=7)
    if case == "zeros":
        x.zero_()
    elif case == "tiny":
        x = x * 1e-42  # fp32 subnormals: the scale overflows to FLT_MAX
    elif case == "inf":
        x[5, 9] = float("-inf")
    elif case == "nan":
        x[60, 1400] = float("nan")
    elif case == "huge":
        x[0, 0] = 3e38
    got = cuda.quantize_current(x, fp8, power_2=power_2, epsilon=epsilon, rowwise=True, columnwise=True)
    want = ref.quantize_current_reference(x, fp8, power_2=power_2, epsilon=epsilon, rowwise=True, columnwise=True)
    ctx = f"quantize_current {case} eps={epsilon} power_2={power_2} {fp8}"
    for name, g, w in zip(("data", "data_t", "scale", "scale_inv"), got[:4], want[:4]):
        assert_bitwise(g, w, f"{ctx} {name}")
    _same_amax(got[4], want[4], ctx + " amax")


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("hp", HP, ids=str)
def test_ties_round_to_even(fp8, hp):
    """Midpoints between neighbouring FP8 values round to the even one."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    wanted = torch.cat([grid, mids])
    x = wanted.to(hp)
    x = x[x.float() == wanted].reshape(1, -1).cuda()  # keep the values hp holds exactly
    one = torch.tensor(1.0, device="cuda")
    got = cuda.quantize_tensorwise(x, one, fp8, rowwise=True, columnwise=True)
    want = ref.quantize_tensorwise_reference(x, one, fp8, rowwise=True, columnwise=True)
    assert_bitwise(got[0], want[0], f"ties {hp}->{fp8}")
    assert_bitwise(got[1], want[1], f"ties {hp}->{fp8} transposed")
    if fp8 == E4M3:
        halfway = torch.tensor([[1.0625, 1.1875]], dtype=hp, device="cuda")  # 1 | 1.125 | 1.25
        q = cuda.quantize_tensorwise(halfway, one, fp8)[0].float().cpu()
        assert q.tolist() == [[1.0, 1.25]]


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_nan_and_inf_inputs_tensorwise(fp8):
    x = _data((33, 67), torch.bfloat16, seed=11)
    x[0, 0], x[1, 1], x[2, 2], x[3, 3] = float("nan"), -float("nan"), float("inf"), -float("inf")
    scale = torch.tensor(0.5, device="cuda")
    got = cuda.quantize_tensorwise(x, scale, fp8, rowwise=True, columnwise=True)
    want = ref.quantize_tensorwise_reference(x, scale, fp8, rowwise=True, columnwise=True)
    assert_bitwise(got[0], want[0], f"nan/inf {fp8} data")
    assert_bitwise(got[1], want[1], f"nan/inf {fp8} data_t")
    assert torch.isnan(got[2]).item()


@pytest.mark.parametrize("shape", [(4096, 4096), (67, 1408), (13, 8704), (3, 32)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_quantize_mxfp8(shape, hp, fp8):
    x = _data(shape, hp, seed=shape[0] + 1)
    if x.numel() >= 32 * 8:
        flat = x.view(-1)
        flat[:32] = 0.0  # an all-zero block
        flat[32:64] *= 1e-30 if hp == torch.float32 else 1e-3  # tiny block
        flat[64] = float("inf")
        flat[100] = float("nan")
        flat[128:160] = 1792.0  # amax = 1.75 * 2**10: the exponent needs no rounding up
        flat[160:192] = 1800.0  # just above 1.75 * 2**10: one more
    got = cuda.quantize_mxfp8(x, fp8)
    want = ref.quantize_mxfp8_reference(x, fp8)
    ctx = _ctx("quantize_mxfp8", x, fp8)
    assert got.scaling == "mx_32"
    assert_bitwise(got.scale_inv, want.scale_inv, ctx + " e8m0")
    assert_bitwise(got.data, want.data, ctx + " data")


@pytest.mark.parametrize("shape", [(4096, 4096), (67, 1408), (13, 8704), (33, 67)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("power_2", [False, True])
def test_quantize_rowwise(shape, hp, fp8, power_2):
    x = _data(shape, hp, seed=shape[1] + 2)
    x[0].zero_()  # amax 0 row
    got = cuda.quantize_rowwise(x, fp8, power_2=power_2, epsilon=0.0)
    want = ref.quantize_rowwise_reference(x, fp8, power_2=power_2, epsilon=0.0)
    ctx = _ctx("quantize_rowwise", x, fp8)
    assert_bitwise(got.data, want.data, ctx + " data")
    assert_bitwise(got.scale_inv, want.scale_inv, ctx + " scale_inv")


def test_views_misaligned_and_empty_inputs():
    base = _data((130, 1409), torch.bfloat16, seed=5)
    cases = {
        "transposed view": base[:, :1408].t(),
        "misaligned start": base.view(-1)[1 : 1 + 67 * 1408].view(67, 1408),
        "empty": base[:0, :64],
        "1-D": base[0],
    }
    scale = torch.tensor(0.75, device="cuda")
    for name, x in cases.items():
        columnwise = x.dim() == 2
        got = cuda.quantize_tensorwise(x, scale, E4M3, rowwise=True, columnwise=columnwise)
        want = ref.quantize_tensorwise_reference(x, scale, E4M3, rowwise=True, columnwise=columnwise)
        for g, w in zip(got, want):
            if w is not None:
                assert_bitwise(g, w, name)
        got = cuda.quantize_current(x, E5M2, rowwise=True, columnwise=columnwise)
        want = ref.quantize_current_reference(x, E5M2, rowwise=True, columnwise=columnwise)
        for g, w in zip(got, want):
            if w is not None:
                assert_bitwise(g, w, name + " current")


def test_matches_reference_on_cpu():
    """The kernels agree with the reference run on CPU too (NaN-free data)."""
    x = _data((67, 1408), torch.bfloat16, seed=9)
    got = cuda.quantize_current(x, E4M3, rowwise=True, columnwise=True)
    want = ref.quantize_current_reference(x.cpu(), E4M3, rowwise=True, columnwise=True)
    for g, w in zip(got, want):
        assert_bitwise(g.cpu(), w, "cpu reference")
    got = cuda.quantize_mxfp8(x, E4M3)
    want = ref.quantize_mxfp8_reference(x.cpu(), E4M3)
    assert_bitwise(got.data.cpu(), want.data, "mxfp8 cpu reference")
    assert_bitwise(got.scale_inv.cpu(), want.scale_inv, "mxfp8 cpu reference e8m0")


def test_input_errors_name_the_problem():
    x = _data((64, 64), torch.bfloat16)
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        cuda.quantize_current(x.double(), E4M3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        cuda.quantize_current(x, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda.quantize_mxfp8(x[:, :48], E4M3)
    with pytest.raises(ValueError, match="2-D"):
        cuda.quantize_tensorwise(x.reshape(4, 16, 64), torch.tensor(1.0, device="cuda"), E4M3, columnwise=True)
    with pytest.raises(ValueError, match="epsilon"):
        cuda.quantize_current(x, E4M3, epsilon=-1.0)
    with pytest.raises(RuntimeError, match="CUDA device"):
        cuda.quantize_mxfp8(x.cpu(), E4M3)


@pytest.mark.parametrize("shape", [(16384, 4096), (67, 1408), (4096, 4096), (1, 16), (300, 40)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hp", HP, ids=str)
@pytest.mark.parametrize("kind", ["current", "current_sums", "delayed", "delayed_sums", "current_given_amax"])
def test_the_one_launch_cast_is_the_separate_launches(shape, hp, kind):
    """The transposing cast as one cooperative launch (the default) against the
    separate launches (amax pass, cast, sum of the tiles' column sums; delayed
    scaling's zeroed amax), bit for bit: copies, scales, amax and sums. (16384, 4096)
    has more tiles than the GPU holds blocks at once, so blocks cast several."""
    x = _data(shape, hp, seed=3)
    if hp is torch.float32 and kind.endswith("sums"):
        x = x * 1.0001  # values off the bf16 grid, for the reads through bf16 below
    scale = torch.tensor(0.5, device="cuda")

    def cast():
        if kind == "current":
            return cuda.quantize_current(x, E4M3, False, 0.0, True, True)
        if kind == "current_given_amax":
            return cuda.quantize_current(x, E5M2, True, 0.0, False, True, x.float().abs().amax())
        if kind == "current_sums":
            return cuda.quantize_current_column_sums(x, E4M3, False, 0.0, True, True, hp is torch.float32)
        if kind == "delayed":
            return cuda.quantize_tensorwise(x, scale, E4M3, True, True)
        return cuda.quantize_tensorwise_column_sums(x, scale, E5M2, True, True, None, hp is torch.float32)

    one = cast()
    previous = cuda.set_one_launch_casts(False)
    try:
        separate = cast()
    finally:
        cuda.set_one_launch_casts(previous)
    assert previous is True
    for i, (a, b) in enumerate(zip(one, separate)):
        assert (a is None) == (b is None), f"{kind} output {i}"
        if b is not None:
            assert_bitwise(a, b, f"{kind} {shape} {hp} output {i}")


@pytest.mark.parametrize("kind", ["current", "current_sums", "delayed", "delayed_sums"])
@pytest.mark.parametrize("in_capture", [True, False], ids=["one launch captured", "separate launches captured"])
def test_a_cast_captured_in_a_graph_replays_the_eager_bits(kind, in_capture):
    """A transposing cast captured into a CUDA graph, as a cooperative kernel node
    (the default) or as its separate launches, replays the eager cast's bits on new
    input written into the captured tensor: copies, scales, amax and sums. The
    setting is the capture's: replays do not read it."""
    x = _data((4096, 1024), torch.bfloat16, seed=5)
    fresh = _data((4096, 1024), torch.bfloat16, seed=6) * 3.0
    scale = torch.tensor(0.25, device="cuda")

    def cast():
        if kind == "current":
            return cuda.quantize_current(x, E4M3, False, 0.0, True, True)
        if kind == "current_sums":
            return cuda.quantize_current_column_sums(x, E4M3, False, 0.0, True, True)
        if kind == "delayed":
            return cuda.quantize_tensorwise(x, scale, E4M3, True, True)
        return cuda.quantize_tensorwise_column_sums(x, scale, E5M2, True, True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    previous = cuda.set_one_launch_casts_in_capture(in_capture)
    try:
        with torch.cuda.stream(side):
            cast()  # warm-up on the capture's stream, as torch asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = cast()
    finally:
        cuda.set_one_launch_casts_in_capture(previous)
    assert previous is True
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager = cast()
    for i, (a, b) in enumerate(zip(captured, eager)):
        assert (a is None) == (b is None), f"{kind} output {i}"
        if b is not None:
            assert_bitwise(a, b, f"{kind} captured ({in_capture}) output {i}")
