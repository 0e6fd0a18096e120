"""The cuda backend's lean entries against the checked launchers, bit for bit
(needs a Hopper GPU): the prepared current-scaling casts (``prepare``) and the
per-tensor GEMM (``tensorwise``), which hand every case they do not take as it is
back to the checked path."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser import backend
from te_fuser.kernels import cuda
from te_fuser.kernels.operand import ScaledOperand
from te_fuser.ops.gemm import gemm as ops_gemm

REASON = cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cuda backend unavailable: {REASON}")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (0.7 + 3 * torch.randn(shape, generator=g)).to(dtype).cuda()


@pytest.mark.parametrize("shape", [(256, 512), (67, 1000), (1, 16)])
@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("fp8,power_2,eps", [(E4M3, False, 0.0), (E5M2, True, 1e-3)])
def test_prepared_current_cast_equals_quantize_current(shape, hp, rowwise, columnwise, fp8, power_2, eps):
    x = _x(shape, hp)
    data, data_t, _, scale_inv, _ = cuda.quantize_current(x, fp8, power_2, eps, rowwise, columnwise)
    got = cuda.quantize_current.prepare(fp8, power_2, eps)(x, rowwise, columnwise)
    for a, b in ((got[0], data), (got[1], data_t)):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise(a, b)
    assert_bitwise(got[2], scale_inv)
    assert got[2].data_ptr() % 16 == 0  # cuBLASLt reads it


@pytest.mark.parametrize("shape", [(256, 512), (300, 130), (128, 16)])
@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("columnwise", [True, False])
def test_prepared_current_column_sums_equals_the_launcher(shape, rowwise, columnwise):
    if not (rowwise or columnwise):
        pytest.skip("no copy asked for")
    x = _x(shape, torch.bfloat16, seed=1)
    want = cuda.quantize_current_column_sums(x, E5M2, False, 0.0, rowwise, columnwise)
    got = cuda.quantize_current_column_sums.prepare(E5M2, False, 0.0)(x, rowwise, columnwise)
    for a, b in ((got[0], want[0]), (got[1], want[1]), (got[2], want[3]), (got[3], want[5])):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise(a, b)


def test_prepared_cast_copies_views_and_hands_odd_inputs_back():
    cast = cuda.quantize_current.prepare(E4M3)
    base = _x((64, 129), torch.bfloat16)
    view = base[:, 1:]  # not contiguous
    want = cuda.quantize_current(view.contiguous(), E4M3, rowwise=True, columnwise=True)
    got = cast(view, True, True)
    assert_bitwise(got[0], want[0])
    assert_bitwise(got[1], want[1])
    with pytest.raises(RuntimeError, match="CUDA device"):
        cast(view.cpu(), True, False)  # the checked launcher names it
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        cast(view.to(torch.float64), True, False)


def _operand(rows, k, fp8, seed):
    x = _x((rows, k), torch.bfloat16, seed)
    data, _, _, scale_inv, _ = cuda.quantize_current(x, fp8)
    return ScaledOperand(data, scale_inv, "tensor")


@pytest.mark.parametrize("m,n,k", [(256, 512, 128), (67, 48, 1024), (16, 16, 16)])
@pytest.mark.parametrize("fp8_pair", [(E4M3, E4M3), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias,fast_accum", [(False, False), (True, True)])
def test_tensorwise_gemm_equals_the_checked_gemm(m, n, k, fp8_pair, out_dtype, with_bias, fast_accum):
    a, b = _operand(m, k, fp8_pair[0], 2), _operand(n, k, fp8_pair[1], 3)
    bias = _x((n,), out_dtype, 4) if with_bias else None
    want = cuda.gemm(a, b, out_dtype, bias=bias, fast_accum=fast_accum)
    got = cuda.gemm.tensorwise(a, b, out_dtype, bias, fast_accum)
    assert_bitwise(got, want)  # an fp32 output adds its bias in the epilogue kernel, as the checked path


@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_tensorwise_gemm_epilogues_equal_the_checked_gemm(activation, residual_dtype, bias_dtype):
    m, n, k = 96, 64, 128
    a, b = _operand(m, k, E4M3, 12), _operand(n, k, E4M3, 13)
    bias = None if bias_dtype is None else _x((n,), bias_dtype, 14)
    residual = None if residual_dtype is None else _x((m, n), residual_dtype, 15)
    want = cuda.gemm(a, b, torch.bfloat16, bias=bias, activation=activation, residual=residual, fast_accum=True)
    got = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, True, activation, residual)
    assert_bitwise(got, want)


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, torch.bfloat16])
def test_an_fp32_bias_rounded_as_read_is_the_rounded_bias(activation, residual_dtype):
    """``bias_round=bfloat16`` with an fp32 bias off the bf16 grid: the epilogue kernel
    rounds it as it reads it (an activation or a residual), or the bias is converted
    first (cuBLASLt's own epilogue): the bits of passing ``bias.to(bfloat16)``,
    through the lean entry and through the ops' gemm."""
    m, n, k = 96, 64, 128
    a, b = _operand(m, k, E4M3, 16), _operand(n, k, E4M3, 17)
    bias = _x((n,), torch.float32, 18) * 1.0001  # fp32 values between bf16 ones
    bias[:3] = torch.tensor([float("inf"), -3.0e38, 1.0e-40], device="cuda")  # bf16's edges: inf, near max, subnormal
    residual = None if residual_dtype is None else _x((m, n), residual_dtype, 19)
    want = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias.to(torch.bfloat16), True, activation, residual)
    got = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, True, activation, residual, torch.bfloat16)
    assert_bitwise(got, want)
    got = ops_gemm(a, b, torch.bfloat16, bias=bias, activation=activation, residual=residual, fast_accum=True,
                   bias_round=torch.bfloat16)
    assert_bitwise(got, want)


def test_tensorwise_gemm_declines_what_it_does_not_take():
    a, b = _operand(64, 64, E4M3, 5), _operand(48, 64, E4M3, 6)
    lean = cuda.gemm.tensorwise
    assert lean(_operand(64, 64, E5M2, 7), _operand(48, 64, E5M2, 8), torch.bfloat16) is None  # two E5M2
    assert lean(a, _operand(40, 64, E4M3, 9), torch.bfloat16) is None  # N not a multiple of 16
    assert lean(a, b, torch.bfloat16, _x((40,), torch.bfloat16, 1)) is None  # a bias of another shape
    assert lean(a, b, torch.bfloat16, None, False, "swiglu") is None  # halves the columns
    assert lean(a, b, torch.bfloat16, None, False, None, _x((64, 40), torch.bfloat16, 2)) is None
    rows = ScaledOperand(a.data, torch.ones(64, 1, device="cuda"), "row")
    assert lean(rows, b, torch.bfloat16) is None  # row scales
    # the ops' gemm takes the lean entry when it applies and the checked path otherwise, alike
    fn = backend.resolve("gemm", a.data.device).fn
    assert getattr(fn, "tensorwise", None) is lean
    bias = _x((48,), torch.float32, 1)
    assert_bitwise(ops_gemm(a, b, torch.bfloat16, bias=bias), cuda.gemm(a, b, torch.bfloat16, bias=bias))
    assert_bitwise(ops_gemm(a, b, torch.bfloat16), cuda.gemm(a, b, torch.bfloat16))


def test_quantizer_takes_the_prepared_cast_on_the_gpu():
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(E4M3, device="cuda")
    x = _x((4, 16, 256), torch.bfloat16, 9)
    got = q.cast(x, rowwise=True, columnwise=True)
    data, data_t, _, scale_inv, _ = cuda.quantize_current(x.reshape(-1, 256), E4M3, rowwise=True, columnwise=True)
    assert_bitwise(got.rowwise.data, data)
    assert_bitwise(got.columnwise.data, data_t)
    assert_bitwise(got.rowwise.scale_inv, scale_inv)
    assert got.shape == x.shape
    fn = backend.resolve("quantize_current", x.device).fn
    assert q._kept_casters["quantize_current"][0] is fn


@pytest.mark.parametrize("shape", [(256, 512), (67, 1000)])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("sums", [False, True])
def test_prepared_tensorwise_cast_equals_the_launcher(shape, rowwise, columnwise, sums):
    x = _x(shape, torch.bfloat16, 11)
    scale = torch.full((), 0.37, device="cuda")
    amax_want = torch.empty(1, device="cuda")
    checked = cuda.quantize_tensorwise_column_sums if sums else cuda.quantize_tensorwise
    want = checked(x, scale, E4M3, rowwise, columnwise, amax_want)
    got = checked.prepare(E4M3)(x, scale, rowwise, columnwise)
    assert got[3].shape == (1,) and got[3].dtype == torch.float32
    assert_bitwise(got[3], amax_want)
    for a, b in ((got[0], want[0]), (got[1], want[1]), (got[2], want[3] if sums else None)):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise(a, b)


@pytest.mark.parametrize("shape", [(256, 1024), (67, 200)])
@pytest.mark.parametrize("hp,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("with_add", [False, True])
def test_lean_layer_norm_equals_the_checked_launchers(shape, hp, out_dtype, with_add):
    x = _x(shape, hp, 21)
    w, b = _x(shape[1:], torch.float32, 22), _x(shape[1:], torch.float32, 23)
    want = cuda.layer_norm(x, w, b, 1e-5, out_dtype)
    got = cuda.layer_norm.lean(x, w, b, 1e-5, out_dtype)
    for a, c in zip(got, want):
        assert_bitwise(a, c)
    dy = _x(shape, hp, 24)
    add = _x(shape, torch.float32, 25) if with_add else None
    want = cuda.layer_norm_grad(dy, x, w, want[1], want[2], add)
    got = cuda.layer_norm_grad.lean(dy, x, w, got[1], got[2], add)
    for a, c in zip(got, want):
        assert_bitwise(a, c)
    assert cuda.layer_norm.lean(x[:, 1:], w[1:], b[1:], 1e-5) is None  # a view: the checked path copies it
    assert cuda.layer_norm.lean(x, w.bfloat16(), b, 1e-5) is None
    assert cuda.layer_norm.lean(x, w, b[:-1], 1e-5) is None
    assert cuda.layer_norm.lean(x.cpu(), w, b, 1e-5) is None
    mean, rstd = got_stats = cuda.layer_norm(x, w, b, 1e-5)[1:]
    assert cuda.layer_norm_grad.lean(dy, x, w, mean.double(), rstd) is None
    assert cuda.layer_norm_grad.lean(dy, x, w, mean, rstd[:-1]) is None
    assert cuda.layer_norm_grad.lean(dy[:-1], x, w, mean, rstd) is None
    assert cuda.layer_norm_grad.lean(dy, x, w, mean, rstd, dy[:, :1]) is None
    assert all(t is not None for t in cuda.layer_norm_grad.lean(dy, x, w, *got_stats))
    fn = backend.resolve("layer_norm", x.device).fn
    assert getattr(fn, "lean", None) is not None  # kept on the auto table's size split


def test_the_extension_gemm_entry_hands_back_what_the_python_path_must_see():
    """``fp8_gemm_lean`` checks in C++ what ``_tensorwise`` checked in Python: an
    operand that is not contiguous or not 16-byte aligned, a scale that is not, a
    bias or residual of another shape, swiglu, go back (None) before anything runs,
    and ``gemm.tensorwise`` still gives the checked GEMM's bits for them."""
    from te_fuser.kernels.cuda._build import extension, stream_of_index

    lean = extension().fp8_gemm_lean
    a, b = _operand(64, 128, E4M3, 20), _operand(48, 128, E4M3, 21)
    index = torch.cuda.current_device()

    def call(x, w, sa, sb, bias=None, residual=None, activation=0, device=index):
        return lean(x, w, sa, sb, bias, residual, torch.bfloat16, False, activation, False, device,
                    stream_of_index(index), None)

    assert_bitwise(call(a.data, b.data, a.scale_inv, b.scale_inv), cuda.gemm(a, b, torch.bfloat16))
    wide = _operand(64, 144, E4M3, 22).data[:, 16:]  # (64, 128), rows 144 apart: not contiguous
    assert call(wide, b.data, a.scale_inv, b.scale_inv) is None
    offset = torch.empty(64 * 128 + 1, dtype=E4M3, device="cuda")[1:].view(64, 128)  # contiguous, 1 byte off
    offset.copy_(a.data)
    assert call(offset, b.data, a.scale_inv, b.scale_inv) is None
    loose_scale = torch.empty(2, device="cuda")[1:].reshape(())  # 4 bytes off a 16-byte boundary
    loose_scale.copy_(a.scale_inv)
    assert call(a.data, b.data, loose_scale, b.scale_inv) is None
    assert call(a.data, b.data, a.scale_inv, b.scale_inv, bias=_x((40,), torch.bfloat16, 1)) is None
    assert call(a.data, b.data, a.scale_inv, b.scale_inv, residual=_x((64, 40), torch.bfloat16, 2)) is None
    assert call(a.data, b.data, a.scale_inv, b.scale_inv, activation=4) is None  # swiglu
    assert call(a.data, b.data, a.scale_inv, b.scale_inv, device=index + 1) is None  # not torch's current device
    for x, sa in ((wide, a.scale_inv), (offset, a.scale_inv), (a.data, loose_scale)):
        op = ScaledOperand(x, sa, "tensor")
        assert_bitwise(cuda.gemm.tensorwise(op, b, torch.bfloat16), cuda.gemm(op, b, torch.bfloat16))


def test_the_lean_entries_run_on_the_current_stream():
    """Under ``torch.cuda.stream(s)`` the extension's lean GEMM and casts launch on s
    (the callers pass torch's current device and ``stream_of_index`` of it): the same
    bits as on the default stream once s is synchronized."""
    from te_fuser.kernels.cuda._build import stream_of_index
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    a, b = _operand(256, 512, E4M3, 23), _operand(512, 512, E4M3, 24)
    x = _x((4, 64, 512), torch.bfloat16, 25)
    bias = _x((512,), torch.float32, 26)
    q = Float8CurrentScalingQuantizer(E4M3, device="cuda")
    want_y = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, True, "gelu")
    want_q = q.cast(x, rowwise=True, columnwise=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert stream_of_index(torch.cuda.current_device()) == side.cuda_stream
        got_y = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, True, "gelu")
        got_q = q.cast(x, rowwise=True, columnwise=True)
    side.synchronize()
    assert_bitwise(got_y, want_y)
    assert_bitwise(got_q.rowwise.data, want_q.rowwise.data)
    assert_bitwise(got_q.columnwise.data, want_q.columnwise.data)


@pytest.mark.parametrize("shape", [(4, 16, 256), (3, 5, 7, 64), (96, 128)])
@pytest.mark.parametrize("sums", [False, True])
def test_the_any_shape_current_cast_is_the_cast_of_the_flattening(shape, sums):
    """``cast.any_shape``: x of two or more dims cast as its 2-D flattening in the
    extension, with no reshape first: the prepared cast's bits on ``x.reshape(-1, K)``;
    None for a view that is not contiguous or a 1-D x (the caller flattens and casts it)."""
    prepared = (cuda.quantize_current_column_sums if sums else cuda.quantize_current).prepare(E4M3)
    x = _x(shape, torch.bfloat16, 27)
    got = prepared.any_shape(x, True, True)
    want = prepared(x.reshape(-1, shape[-1]), True, True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert_bitwise(g, w)
    assert got[0].shape == (x.numel() // shape[-1], shape[-1])
    assert prepared.any_shape(x.transpose(0, -1), True, True) is None  # not contiguous
    assert prepared.any_shape(x.reshape(-1), True, True) is None  # 1-D: the caller's flattening, (1, K)



@pytest.mark.parametrize("shape", [(4, 16, 256), (96, 128)])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (True, True), (False, True)])
def test_the_given_amax_cast_is_the_cast_of_the_flattening_with_that_amax(shape, rowwise, columnwise):
    """``cast.given_amax``: x of two or more dims cast with its producer's amax (here
    three times x's own, so a cast that took its own would differ), the bits of
    ``quantize_current`` given that amax on ``x.reshape(-1, K)``; None for a view
    that is not contiguous, a 1-D x, an amax of another dtype or on the CPU; the
    column-sums cast offers none."""
    prepared = cuda.quantize_current.prepare(E4M3)
    x = _x(shape, torch.bfloat16, 29)
    amax = x.float().abs().amax().reshape(1) * 3
    got = prepared.given_amax(x, amax, rowwise, columnwise)
    data, data_t, _, scale_inv, _ = cuda.quantize_current(x.reshape(-1, shape[-1]), E4M3, False, 0.0, rowwise,
                                                          columnwise, amax.reshape(()))
    for g, w in ((got[0], data), (got[1], data_t), (got[2], scale_inv)):
        assert (g is None) == (w is None)
        if g is not None:
            assert_bitwise(g, w)
    own = cuda.quantize_current(x.reshape(-1, shape[-1]), E4M3, False, 0.0, True, False)[3]
    assert not torch.equal(got[2], own)  # the given amax's scale, not x's own
    assert prepared.given_amax(x.transpose(0, -1), amax, True, True) is None
    assert prepared.given_amax(x.reshape(-1), amax, True, False) is None
    assert prepared.given_amax(x, amax.double(), True, True) is None
    assert prepared.given_amax(x, amax.cpu(), True, True) is None
    assert not hasattr(cuda.quantize_current_column_sums.prepare(E4M3), "given_amax")


def test_the_quantizer_casts_with_a_given_amax_through_the_prepared_cast():
    """``cast_given_amax`` of a plain (B, T, K) x takes the prepared cast's
    ``given_amax``: the copies and scale of the checked path on x's rows."""
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(E4M3, device="cuda")
    x = _x((4, 16, 256), torch.bfloat16, 30)
    amax = x.float().abs().amax().reshape(1) * 3
    got = q.cast_given_amax(x, amax, rowwise=True, columnwise=True)
    row, col = q._quantize(x.reshape(-1, 256), True, True, amax.reshape(()))
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_bitwise(got.rowwise.data, row.data)
    assert_bitwise(got.columnwise.data, col.data)
    assert_bitwise(got.rowwise.scale_inv, row.scale_inv)
    assert "given_amax" in dir(q._kept_casters["quantize_current"][2])


def test_the_delayed_update_entry_hands_back_a_state_it_cannot_read():
    """``with_update`` checks x and the state in the extension: a state on the CPU, an
    x that is not contiguous, a history of another dtype go back (None), nothing
    launched, the state untouched; a 3-D x is cast as its flattening."""
    prepared = cuda.quantize_tensorwise.prepare(E4M3)
    x = _x((4, 16, 256), torch.bfloat16, 28)
    scale = torch.full((), 2.0, device="cuda")
    history = torch.zeros(16, device="cuda")
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    out = prepared.with_update(x, scale, history, count, 0, True, True, True)
    want = prepared.with_update(x.reshape(-1, 256), scale, history, count, 0, True, True, True)
    for g, w in zip(out, want):
        if g is not None:
            assert_bitwise(g, w)
    assert out[0].shape == (64, 256)
    assert prepared.with_update(x, scale.cpu(), history, count, 0, True, True, True) is None
    assert prepared.with_update(x.transpose(1, 2), scale, history, count, 0, True, True, True) is None
    assert prepared.with_update(x, scale, history.double(), count, 0, True, True, True) is None
    assert prepared.with_update(x, scale, history, count.int(), 0, True, True, True) is None
    assert history.abs().sum().item() == 0 and count.item() == 0


@pytest.mark.parametrize("lead", [(64,), (4, 16), (2, 4, 8)])
@pytest.mark.parametrize("activation,with_residual", [(None, False), (None, True), ("gelu", False)])
def test_the_gemm_entry_gives_the_result_in_the_input_dims(lead, activation, with_residual):
    """``a_shape`` (..., K): the lean GEMM's result comes as (..., N), a residual may
    come as (..., N) too, with the bits of the 2-D call; a shape that does not hold
    a's rows goes back (None) before anything runs."""
    from te_fuser.kernels.cuda._build import extension, stream_of_index

    m, n, k = 64, 48, 128
    a, b = _operand(m, k, E4M3, 30), _operand(n, k, E4M3, 31)
    bias = _x((n,), torch.bfloat16, 32)
    residual = _x((*lead, n), torch.bfloat16, 33) if with_residual else None
    want = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, False, activation,
                                None if residual is None else residual.reshape(m, n))
    got = cuda.gemm.tensorwise(a, b, torch.bfloat16, bias, False, activation, residual, None,
                               torch.Size((*lead, k)))
    assert got.shape == (*lead, n) and got.is_contiguous()
    assert_bitwise(got.reshape(m, n), want)
    got = ops_gemm(a, b, torch.bfloat16, bias=bias, activation=activation, residual=residual,
                   a_shape=torch.Size((*lead, k)))
    assert got.shape == (*lead, n)
    assert_bitwise(got.reshape(m, n), want)
    index = torch.cuda.current_device()
    lean = extension().fp8_gemm_lean
    for shape in ((*lead[:-1], lead[-1] + 1, k), (*lead, k + 16), ()):
        assert lean(a.data, b.data, a.scale_inv, b.scale_inv, bias, residual, torch.bfloat16, False, 0, False, index,
                    stream_of_index(index), shape) is None
    if len(lead) > 1:  # a residual in other dims than the output's asks for them
        assert lean(a.data, b.data, a.scale_inv, b.scale_inv, bias, _x((*lead, n), torch.bfloat16, 34),
                    torch.bfloat16, False, 0, False, index, stream_of_index(index), None) is None


@pytest.mark.parametrize("lead", [(4, 64), (2, 3, 40)])
@pytest.mark.parametrize("with_add", [False, True])
def test_lean_layer_norm_takes_more_dims_as_rows(lead, with_add):
    """The lean LayerNorm of x (..., N) is that of its 2-D flattening, y and dx of
    x's shape, bit for bit."""
    n = 256
    x = _x((*lead, n), torch.bfloat16, 40)
    w, b = _x((n,), torch.float32, 41), _x((n,), torch.float32, 42)
    want = cuda.layer_norm(x.reshape(-1, n), w, b, 1e-5, torch.bfloat16)
    got = cuda.layer_norm.lean(x, w, b, 1e-5, torch.bfloat16)
    assert got[0].shape == x.shape
    for a, c in zip((got[0].reshape(-1, n), *got[1:]), want):
        assert_bitwise(a, c)
    dy = _x(x.shape, torch.bfloat16, 43)
    add = _x(x.shape, torch.float32, 44) if with_add else None
    want = cuda.layer_norm_grad(dy.reshape(-1, n), x.reshape(-1, n), w, want[1], want[2],
                                None if add is None else add.reshape(-1, n))
    got = cuda.layer_norm_grad.lean(dy, x, w, got[1], got[2], add)
    assert got[0].shape == x.shape
    for a, c in zip((got[0].reshape(-1, n), *got[1:]), want):
        assert_bitwise(a, c)
    assert cuda.layer_norm_grad.lean(dy.reshape(-1, n), x, w, want[1], want[2]) is None  # dy in other dims


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_a_linear_block_on_three_dims_is_the_one_on_rows(recipe_name):
    """A LayerNorm -> Linear -> GELU -> Linear -> residual block trained on (B, T, d)
    under an FP8 recipe: its outputs and gradients are those of the same block on
    the (B*T, d) rows (the ops hand x of any dims to the casts, GEMMs and norms
    that take it), bit for bit, over two steps."""
    import te_fuser as te

    recipes = {"current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling()}

    def block():
        torch.manual_seed(0)
        return te.ops.Sequential(te.ops.LayerNorm(256, device="cuda"), te.ops.Linear(256, 512, device="cuda"),
                                 te.ops.GELU(), te.ops.Linear(512, 256, device="cuda"), te.ops.AddExtraInput())

    x3 = _x((4, 32, 256), torch.bfloat16, 50).requires_grad_()
    x2 = x3.detach().reshape(-1, 256).requires_grad_()
    dy = _x((4, 32, 256), torch.bfloat16, 51)
    models = block(), block()
    for _ in range(2):
        outs = []
        for model, x in zip(models, (x3, x2)):
            with te.autocast(recipe=recipes[recipe_name]):
                y = model(x, x)
            y.backward(dy.reshape(y.shape))
            outs.append(y)
        assert outs[0].shape == x3.shape
        assert_bitwise(outs[0].reshape(-1, 256), outs[1])
        assert_bitwise(x3.grad.reshape(-1, 256), x2.grad)
        for p3, p2 in zip(models[0].parameters(), models[1].parameters()):
            assert_bitwise(p3.grad, p2.grad)
        for m in models:
            m.zero_grad(set_to_none=True)
        x3.grad = x2.grad = None
