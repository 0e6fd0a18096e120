"""Triton RMSNorm and LayerNorm (and the CUDA LayerNorm, on a GPU) forward and
backward against the reference and float64 (fp32 math everywhere; they differ only
in the order of the row sums and in one rounding)."""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels.reference import norm as ref
from te_fuser.kernels.triton import norm as tk
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(rows, n, generator=gen)  # off-centre rows
    x[0] = 0.0  # an all-zero row: rstd = 1/sqrt(eps)
    x[1, : n // 2] = 1e4  # a large one
    w = 1.0 + 0.1 * torch.randn(n, generator=gen)
    dy = torch.randn(rows, n, generator=gen)
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE), dy.to(dtype).to(DEVICE)


@pytest.mark.parametrize("rows,n", [(13, 96), (7, 200), (33, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_forward_and_backward_match_the_reference(rows, n, dtype):
    x, w, dy = _inputs(rows, n, dtype)
    eps = 1e-5
    y, rstd = tk.rms_norm(x, w, eps)
    y_ref, rstd_ref = ref.rms_norm_reference(x, w, eps)
    assert y.dtype == dtype and y.shape == (rows, n)
    context = f"rms_norm {rows}x{n} {dtype}"
    assert_close(rstd, rstd_ref, torch.float32, context + " rstd")
    assert_close(y, y_ref, dtype, context + " y", scaled=True)
    dx, dw = tk.rms_norm_grad(dy, x, w, rstd, eps)
    dx_ref, dw_ref = ref.rms_norm_grad_reference(dy, x, w, rstd_ref, eps)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    key = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close(dx, dx_ref, "norm_grad_fp32" if key == torch.float32 else key, context + " dx", scaled=True)
    assert_close(dw, dw_ref, "norm_grad_fp32", context + " dweight", scaled=True)


def test_rms_norm_output_dtype_and_strided_input():
    x, w, _ = _inputs(9, 64, torch.float32)
    xt = x.t().contiguous().t()  # column-major storage of the same values
    y, _ = tk.rms_norm(xt, w, 1e-6, out_dtype=torch.bfloat16)
    y_ref, _ = ref.rms_norm_reference(x, w, 1e-6, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_close(y, y_ref, torch.bfloat16, "rms_norm strided, bf16 out", scaled=True)


def test_rms_norm_errors_name_the_constraint():
    x, w, dy = _inputs(4, 32, torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        tk.rms_norm(x, w[:16], 1e-5)
    with pytest.raises(ValueError, match=f"up to {tk.MAX_N} wide"):
        tk.rms_norm(torch.zeros(1, tk.MAX_N + 1, device=DEVICE), torch.ones(tk.MAX_N + 1, device=DEVICE), 1e-5)
    assert tk.rms_norm_unsupported_reason(torch.zeros(1, tk.MAX_N + 1), None) is not None
    assert tk.rms_norm_unsupported_reason(x, w) is None
    _, rstd = tk.rms_norm(x, w, 1e-5)
    with pytest.raises(ValueError, match="rstd must be float32"):
        tk.rms_norm_grad(dy, x, w, rstd.double(), 1e-5)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        tk.rms_norm_grad(dy[:2], x, w, rstd, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_op_on_the_triton_backend_matches_the_reference_backend(dtype):
    import te_fuser as te

    torch.manual_seed(0)
    norm = te.ops.RMSNorm(48, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(48))
    x = (-1.0 + torch.randn(3, 5, 48)).to(DEVICE, dtype)
    dy = torch.randn(3, 5, 48).to(DEVICE, dtype)
    results = {}
    for name in ("reference", "triton"):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=False, backend=name):
            y = norm(xi)
        y.backward(dy)
        results[name] = (y.detach(), xi.grad, norm.weight.grad.clone())
        norm.weight.grad = None
    for what, got, want in zip(("y", "dx", "dweight"), results["triton"], results["reference"]):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        key = dtype if dtype == torch.bfloat16 else "norm_grad_fp32"
        assert_close(got, want, key, f"RMSNorm op {what} {dtype}", scaled=True)


def _layer_norm_float64(x, w, b, dy, eps):
    """y, dx, dweight, dbias of LayerNorm in float64 (autograd through torch's op)."""
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    y = torch.nn.functional.layer_norm(x64, (x.shape[1],), w64, b64, eps)
    y.backward(dy.double())
    mean = x64.detach().mean(1)
    rstd = torch.rsqrt(x64.detach().var(1, unbiased=False) + eps)
    return y.detach(), mean, rstd, x64.grad, w64.grad, b64.grad


def _layer_norm_kernels() -> dict:
    """Every backend's LayerNorm (forward, backward) that runs here."""
    kernels = {"triton": (tk.layer_norm, tk.layer_norm_grad),
               "reference": (ref.layer_norm_reference, ref.layer_norm_grad_reference)}
    if DEVICE == "cuda":
        from te_fuser.kernels import cuda

        kernels["cuda"] = (cuda.layer_norm, cuda.layer_norm_grad)
    return kernels


@pytest.mark.parametrize("rows,n", [(13, 96), (7, 200), (33, 17)])
@pytest.mark.parametrize("x_dtype,dy_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16)], ids=str)
def test_layer_norm_forward_and_backward_match_float64(rows, n, x_dtype, dy_dtype):
    """The Triton LayerNorm and the reference, each against float64 on the same
    (representable) inputs: the fp32 residual stream with a bf16 gradient is the
    GPT's case, read in its own dtypes."""
    x, w, dy = _inputs(rows, n, x_dtype)
    gen = torch.Generator().manual_seed(1)
    b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    w, dy = w.float(), dy.to(dy_dtype)
    eps = 1e-5
    y64, mean64, rstd64, dx64, dw64, db64 = _layer_norm_float64(x, w, b, dy, eps)
    for name, (forward, backward) in _layer_norm_kernels().items():
        context = f"layer_norm {name} {rows}x{n} x {x_dtype} dy {dy_dtype}"
        y, mean, rstd = forward(x, w, b, eps, torch.bfloat16 if dy_dtype == torch.bfloat16 else None)
        out_dtype = torch.bfloat16 if dy_dtype == torch.bfloat16 else x_dtype
        assert y.dtype == out_dtype and mean.dtype == rstd.dtype == torch.float32, context
        assert_close(mean, mean64, torch.float32, context + " mean", scaled=True)
        assert_close(rstd, rstd64, torch.float32, context + " rstd")
        assert_close(y, y64, out_dtype, context + " y", scaled=True)
        dx, dw, db = backward(dy, x, w, mean, rstd)
        assert dx.dtype == x_dtype and dw.dtype == db.dtype == torch.float32, context
        assert_close(dx, dx64, "norm_grad_fp32" if x_dtype == torch.float32 else x_dtype, context + " dx", scaled=True)
        assert_close(dw, dw64, "norm_grad_fp32", context + " dweight", scaled=True)
        assert_close(db, db64, "norm_grad_fp32", context + " dbias", scaled=True)


@pytest.mark.parametrize("x_dtype,add_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)], ids=str)
def test_layer_norm_grad_adds_another_uses_gradient_before_its_one_rounding(x_dtype, add_dtype):
    """With ``grad_add`` (the gradient of a residual branch that also read x), dx is
    the norm's gradient plus it against float64; an fp32 x gets the same bits as
    the norm's dx and an fp32 add after it (nothing rounds in between), and every
    backend's parameter gradients are those without it."""
    rows, n = 37, 160
    x, w, dy = _inputs(rows, n, x_dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    add = (torch.randn(rows, n, generator=gen) * 3.0).to(add_dtype).to(DEVICE)
    add[0, : n // 2] = -1e3  # a large term that the norm's gradient does not cancel
    w, eps = w.float(), 1e-5
    _, _, _, dx64, _, _ = _layer_norm_float64(x, w, b, dy, eps)
    for name, (forward, backward) in _layer_norm_kernels().items():
        context = f"layer_norm_grad {name} x {x_dtype} grad_add {add_dtype}"
        _, mean, rstd = forward(x, w, b, eps)
        dx, dw, db = backward(dy, x, w, mean, rstd, grad_add=add)
        plain, dw0, db0 = backward(dy, x, w, mean, rstd)
        assert dx.dtype == x_dtype, context
        assert torch.equal(dw, dw0) and torch.equal(db, db0), context
        want = dx64 + add.double()
        assert_close(dx, want, "norm_grad_fp32" if x_dtype == torch.float32 else x_dtype, context, scaled=True)
        if x_dtype == torch.float32:
            assert torch.equal(dx, plain + add.float()), context
    with pytest.raises(ValueError, match="grad_add must be a float tensor of x's shape"):
        tk.layer_norm_grad(dy, x, w, mean, rstd, grad_add=add[1:])


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPT's sizes: on the GPU")
@pytest.mark.parametrize("rows,n", [(16384, 1024), (1000, 4096)])
def test_layer_norm_at_the_gpt_sizes_matches_float64(rows, n):
    """The compiled kernel at real sizes, in the GPT's dtypes: x fp32, y and dy bf16."""
    x, w, dy = _inputs(rows, n, torch.float32)
    b = (0.1 * torch.randn(n, generator=torch.Generator().manual_seed(2))).to(DEVICE)
    dy = dy.to(torch.bfloat16)
    y64, mean64, rstd64, dx64, dw64, db64 = _layer_norm_float64(x, w, b, dy, 1e-5)
    for name, (forward, backward) in _layer_norm_kernels().items():
        y, mean, rstd = forward(x, w, b, 1e-5, torch.bfloat16)
        context = f"layer_norm {name} {rows}x{n}"
        assert_close(y, y64, torch.bfloat16, context + " y", scaled=True)
        assert_close(rstd, rstd64, torch.float32, context + " rstd")
        dx, dw, db = backward(dy, x, w, mean, rstd)
        assert_close(dx, dx64, "norm_grad_fp32", context + " dx", scaled=True)
        assert_close(dw, dw64, "norm_grad_fp32", context + " dweight", scaled=True)
        assert_close(db, db64, "norm_grad_fp32", context + " dbias", scaled=True)
        again = backward(dy, x, w, mean, rstd)
        assert all(torch.equal(a, b) for a, b in zip((dx, dw, db), again)), context + ": not reproducible"


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA kernels: on the GPU")
@pytest.mark.parametrize("rows,n", [(5, 8), (130, 256), (67, 264), (4097, 768), (300, 2048), (40, 2056)])
@pytest.mark.parametrize("x_dtype,dy_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
                         ids=str)
def test_the_cuda_layer_norm_at_every_row_width_matches_float64(rows, n, x_dtype, dy_dtype):
    """Every way the CUDA LayerNorm takes a row: 1, 2, 4 and 8 vectors a lane (the
    last with its parameter sums in shared memory), a lane's vector past the row's
    end (264, 768), the general kernels past 2048 columns and for a weight off a
    16-byte boundary; row counts that leave a chunk short. With grad_add, and the
    same bits on a second call."""
    from te_fuser.kernels import cuda

    x, w, dy = _inputs(rows, n, x_dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    add = torch.randn(rows, n, generator=gen).to(x_dtype).to(DEVICE)
    w, dy = w.float(), dy.to(dy_dtype)
    y64, mean64, rstd64, dx64, dw64, db64 = _layer_norm_float64(x, w, b, dy, 1e-5)
    shifted = torch.empty(n + 1, device=DEVICE)[1:]  # 4 bytes past a 16-byte boundary
    for name, weight in (("aligned", w), ("weight off 16 bytes", shifted.copy_(w))):
        context = f"cuda layer_norm {rows}x{n} x {x_dtype} dy {dy_dtype}, {name}"
        y, mean, rstd = cuda.layer_norm(x, weight, b, 1e-5, dy_dtype)
        assert_close(mean, mean64, torch.float32, context + " mean", scaled=True)
        assert_close(rstd, rstd64, torch.float32, context + " rstd")
        assert_close(y, y64, dy_dtype, context + " y", scaled=True)
        dx, dw, db = cuda.layer_norm_grad(dy, x, weight, mean, rstd, grad_add=add)
        grad_dtype = "norm_grad_fp32" if x_dtype == torch.float32 else x_dtype
        assert_close(dx, dx64 + add.double(), grad_dtype, context + " dx", scaled=True)
        assert_close(dw, dw64, "norm_grad_fp32", context + " dweight", scaled=True)
        assert_close(db, db64, "norm_grad_fp32", context + " dbias", scaled=True)
        again = cuda.layer_norm_grad(dy, x, weight, mean, rstd, grad_add=add)
        assert all(torch.equal(p, q) for p, q in zip((dx, dw, db), again)), context + ": not reproducible"


def test_layer_norm_errors_name_the_constraint():
    x, w, dy = _inputs(4, 32, torch.float32)
    b = torch.zeros(32, device=DEVICE)
    with pytest.raises(ValueError, match="bias must have shape"):
        tk.layer_norm(x, w, b[:16], 1e-5)
    with pytest.raises(ValueError, match="bias must have shape"):
        ref.layer_norm_reference(x, w, b[:16], 1e-5)
    with pytest.raises(ValueError, match=f"up to {tk.MAX_N} wide"):
        wide = torch.ones(tk.MAX_N + 1, device=DEVICE)
        tk.layer_norm(torch.zeros(1, tk.MAX_N + 1, device=DEVICE), wide, wide, 1e-5)
    assert tk.layer_norm_unsupported_reason(torch.zeros(1, tk.MAX_N + 1), None) is not None
    _, mean, rstd = tk.layer_norm(x, w, b, 1e-5)
    with pytest.raises(ValueError, match="mean must be float32"):
        tk.layer_norm_grad(dy, x, w, mean[:2], rstd)
    with pytest.raises(ValueError, match="rstd must be float32"):
        ref.layer_norm_grad_reference(dy, x, w, mean, rstd.double())
    with pytest.raises(ValueError, match="dy must have x's shape"):
        tk.layer_norm_grad(dy[:2], x, w, mean, rstd)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_op_on_every_backend_matches_the_reference_backend(dtype, zero_centered):
    """The op over two trailing dims (normalized as one row), zero-centred or not,
    under both backends: output, input gradient and both parameter gradients."""
    import te_fuser as te

    torch.manual_seed(0)
    norm = te.ops.LayerNorm((4, 12), eps=1e-6, zero_centered_gamma=zero_centered).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(4, 12) + (0.0 if zero_centered else 1.0))
        norm.bias.copy_(0.1 * torch.randn(4, 12))
    x = (-1.0 + torch.randn(3, 5, 4, 12)).to(DEVICE, dtype)
    dy = torch.randn(3, 5, 4, 12).to(DEVICE, dtype)
    results = {}
    for name in _layer_norm_kernels():
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=False, backend=name):
            y = norm(xi)
        y.backward(dy)
        results[name] = (y.detach(), xi.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
        norm.weight.grad = norm.bias.grad = None
    for name in set(results) - {"reference"}:
        for what, got, want in zip(("y", "dx", "dweight", "dbias"), results[name], results["reference"]):
            assert got.dtype == want.dtype and got.shape == want.shape, what
            key = dtype if dtype == torch.bfloat16 else "norm_grad_fp32"
            assert_close(got, want, key, f"LayerNorm op on {name}: {what} {dtype}", scaled=True)
