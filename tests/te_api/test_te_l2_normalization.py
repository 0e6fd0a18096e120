"""TransformerEngine's L2Normalization: ``x / sqrt(sum(x**2) + eps)`` over the last
dim, no parameters, eps 1e-6 by default; TE's warm-up sizes accepted."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_norm_rows_and_their_gradient(dtype):
    op = te.ops.L2Normalization(seq_length=16, micro_batch_size=2)
    assert op.eps == 1e-6 and not list(op.parameters())
    g = torch.Generator().manual_seed(0)
    x = (-2.3 + 0.5 * torch.randn(2, 16, 64, generator=g)).to(dtype).requires_grad_(True)
    x[0, 0].data.zero_()  # an all-zero row: eps keeps it finite (zero out, zero gradient of scale 1/sqrt(eps))
    dy = torch.randn(2, 16, 64, generator=g).to(dtype)
    y = op(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
    y64.backward(dy.double())
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close(y, y64, dtype, "L2Normalization forward")
    assert_close(x.grad, x64.grad, dtype, "L2Normalization dx", scaled=True)
    norms = y[0, 1:].double().norm(dim=-1)
    assert_close(norms, torch.ones_like(norms), dtype, "unit rows")


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("inf"), True, "1e-6"])
def test_bad_eps_is_named(eps):
    with pytest.raises(ValueError, match="L2Normalization.eps: must be a finite float > 0"):
        te.ops.L2Normalization(eps=eps)


def test_fuses_into_a_sequential_under_fp8():
    """Query-key normalization between a projection and the rest, under current scaling."""
    torch.manual_seed(0)
    seq = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.L2Normalization(), te.ops.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = seq(x)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and seq.fusion_stats().builds == 1
