"""Triton RMSNorm forward and backward against the reference (fp32 math on both
sides; they differ only in the order of the row sums and in one rounding)."""

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
