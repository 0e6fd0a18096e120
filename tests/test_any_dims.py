"""A model on (B, T, d) is the model on its (B*T, d) rows, bit for bit.

The ops hand an input of any dims as it comes to the casts, the GEMMs and the
norms that take it (a reshape on either side is a dispatch of its own on the
host), and reshape only for the kernels that read rows; either way the numbers
must be those of the same op on the rows. Each recipe's quantizers, an identity
one (whose cast is x itself, of x's dims) and each backward override are trained
for two steps on both, side by side.
"""

from __future__ import annotations

import pytest
import torch
from op_testing import RECIPES
from tolerances import assert_bitwise

import te_fuser as te
from te_fuser import recipe as R

CASES = {name: RECIPES[name] for name in ("none", "delayed", "current", "mxfp8", "block", "custom_identity")}
CASES["current_high_precision_backward"] = R.Float8CurrentScaling(backward_override="high_precision")
CASES["delayed_dequantized_backward"] = R.DelayedScaling(backward_override="dequantized")

D, F = 64, 128


def _block() -> te.ops.Sequential:
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(D), te.ops.Linear(D, F), te.ops.GELU(), te.ops.Linear(F, D),
                             te.ops.AddExtraInput())


@pytest.mark.parametrize("name", list(CASES))
def test_a_block_on_three_dims_is_the_block_on_rows(name):
    recipe = CASES[name]
    g = torch.Generator().manual_seed(1)
    x3 = torch.randn(2, 16, D, generator=g).bfloat16().requires_grad_()
    x2 = x3.detach().reshape(-1, D).requires_grad_()
    dy = torch.randn(2, 16, D, generator=g).bfloat16()
    models = _block(), _block()
    for step in range(2):
        outs = []
        for model, x in zip(models, (x3, x2)):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x, x)
            y.backward(dy.reshape(y.shape))
            outs.append(y)
        context = f"{name}, step {step}"
        assert outs[0].shape == x3.shape, context
        assert_bitwise(outs[0].reshape(-1, D), outs[1], context)
        assert_bitwise(x3.grad.reshape(-1, D), x2.grad, context)
        for (pname, p3), p2 in zip(models[0].named_parameters(), models[1].parameters()):
            assert_bitwise(p3.grad, p2.grad, f"{context}, {pname}")
        for model in models:
            model.zero_grad(set_to_none=True)
        x3.grad = x2.grad = None


@pytest.mark.parametrize("name", ["delayed", "current", "custom_identity"])
def test_a_linear_with_a_residual_in_three_dims(name):
    """Linear + AddExtraInput (the residual in the GEMM's epilogue where it fuses) on
    (B, T, K) with a (B, T, N) residual: the rows' numbers, the output of x's dims."""
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(2)
    x3 = torch.randn(3, 8, D, generator=g).bfloat16().requires_grad_()
    r3 = torch.randn(3, 8, F, generator=g).bfloat16().requires_grad_()
    x2, r2 = (t.detach().reshape(-1, t.shape[-1]).requires_grad_() for t in (x3, r3))
    outs = []
    for x, r in ((x3, r3), (x2, r2)):
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.Linear(D, F), te.ops.AddExtraInput())
        with te.autocast(recipe=recipe):
            y = model(x, r)
        y.float().square().sum().backward()
        outs.append((y, model.get_parameter("0.weight").grad))
    assert outs[0][0].shape == (3, 8, F)
    assert_bitwise(outs[0][0].reshape(-1, F), outs[1][0], name)
    assert_bitwise(outs[0][1], outs[1][1], name)
    assert_bitwise(x3.grad.reshape(-1, D), x2.grad, name)
    assert_bitwise(r3.grad.reshape(-1, F), r2.grad, name)


@pytest.mark.parametrize("name", ["none", "delayed", "current", "custom_identity"])
def test_a_linear_on_one_vector(name):
    """A 1-D input (K,) gives a 1-D output (N,) and gradients: the numbers of the
    same Linear on the one row (1, K)."""
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(3)
    x1 = torch.randn(D, generator=g).bfloat16().requires_grad_()
    x2 = x1.detach().reshape(1, D).requires_grad_()
    outs = []
    for x in (x1, x2):
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.Linear(D, F))
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().square().sum().backward()
        outs.append((y, model.get_parameter("0.weight").grad))
    assert outs[0][0].shape == (F,)
    assert_bitwise(outs[0][0].reshape(1, F), outs[1][0], name)
    assert_bitwise(outs[0][1], outs[1][1], name)
    assert_bitwise(x1.grad.reshape(1, D), x2.grad, name)
