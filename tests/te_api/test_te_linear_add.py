"""``Linear -> AddExtraInput`` in fp16 / bf16 without FP8, as TransformerEngine's
fused ``ForwardLinearBiasAdd`` computes it: the product, the bias and the residual
summed in fp32 and rounded once, within the dtype's tolerance of float64 (also
the backward's ``MakeExtraOutput -> Linear``, whose dgrad adds the branch's
gradient in the same epilogue)."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from tolerances import assert_close


def _tensors(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen).to(dtype)
    w = (torch.randn(48, 64, generator=gen) / 8).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    res = torch.randn(32, 48, generator=gen).to(dtype)
    dy = torch.randn(32, 48, generator=gen).to(dtype)
    return x, w, b, res, dy


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_linear_add_extra_input_rounds_once(dtype, bias):
    x, w, b, res, dy = _tensors(dtype, 7)
    model = te.ops.Sequential(te.ops.Linear(64, 48, bias=bias, dtype=dtype), te.ops.AddExtraInput())
    with torch.no_grad():
        model[0].weight.copy_(w)
        if bias:
            model[0].bias.copy_(b)
    x_t, res_t = x.clone().requires_grad_(), res.clone().requires_grad_()
    y = model(x_t, res_t)
    y.backward(dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    res64 = res.double().requires_grad_()
    y64 = x64 @ w64.t() + res64 + (b.double() if bias else 0.0)
    y64.backward(dy.double())
    context = f"Linear(bias={bias}) -> AddExtraInput dtype={dtype}"
    assert y.dtype == dtype
    assert_close(y, y64.detach(), dtype, f"{context} y")
    assert_close(res_t.grad, res64.grad, dtype, f"{context} d residual")
    assert_close(x_t.grad, x64.grad, dtype, f"{context} dx")
    assert_close(model[0].weight.grad, w64.grad, dtype, f"{context} dw")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_branch_into_linear_backward_adds_the_branch_gradient_before_rounding(dtype):
    """``MakeExtraOutput -> Linear``: dx = dy · w + d branch, rounded once."""
    x, w, _, _, dy = _tensors(dtype, 8)
    gen = torch.Generator().manual_seed(9)
    d_branch = torch.randn(32, 64, generator=gen).to(dtype)
    model = te.ops.Sequential(te.ops.MakeExtraOutput(), te.ops.Linear(64, 48, bias=False, dtype=dtype))
    with torch.no_grad():
        model[1].weight.copy_(w)
    x_t = x.clone().requires_grad_()
    y, branch = model(x_t)
    torch.autograd.backward([y, branch], [dy, d_branch])
    expected = dy.double() @ w.double() + d_branch.double()
    assert_close(x_t.grad, expected, dtype, f"MakeExtraOutput -> Linear dtype={dtype} dx")
