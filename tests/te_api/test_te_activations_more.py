"""TransformerEngine's remaining activations, in the shape of TE's own tests:
ClampedSwiGLU (GPT-OSS), SiTUGLU (Kimi K3) and the post-scaled ScaledSwiGLU,
ScaledSiTUGLU, ScaledClampedQGeGLU and ScaledSReLU (``op(x, scales)``, the scales a
differentiable per-row extra input), against TE's torch formulas in float64."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from tolerances import assert_close

F = torch.nn.functional


def _data(shape, seed, dtype=torch.float32, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen).to(dtype)
    return t.double().requires_grad_(requires_grad), t.clone().requires_grad_(requires_grad)


def _deinterleave(x, size):
    if size is None:
        return x
    n = x.shape[-1]
    return x.reshape(*x.shape[:-1], n // (2 * size), 2, size).transpose(-3, -2).reshape(x.shape)


def _clamped(x, limit, alpha, offset):
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(min=None, max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(min=-limit, max=limit) + offset)


def _situ(x, beta1=4.0, beta2=25.0):
    a, b = x.chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


def _check(y, y_ref, leaves, dtype, what):
    assert_close(y, y_ref.detach(), dtype, f"{what} y")
    for name, (ref_leaf, test_leaf) in leaves.items():
        if ref_leaf.requires_grad:
            assert_close(test_leaf.grad, ref_leaf.grad, dtype, f"{what} d{name}",
                         scaled=name == "scales")  # a row sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glu_linear_offset", [1.0, 0.0])
@pytest.mark.parametrize("glu_interleave_size", [None, 8])
def test_clamped_swiglu(dtype, glu_linear_offset, glu_interleave_size):
    limit, alpha = 0.75, 1.702
    x_ref, x = _data((32, 64), 1, dtype)
    dy_ref, dy = _data((32, 32), 2, dtype, requires_grad=False)
    y_ref = _clamped(_deinterleave(x_ref, glu_interleave_size), limit, alpha, glu_linear_offset)
    y_ref.backward(dy_ref)
    op = te.ops.ClampedSwiGLU(limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset,
                              glu_interleave_size=glu_interleave_size)
    y = op(x)
    y.backward(dy)
    _check(y, y_ref, {"x": (x_ref, x)}, dtype, "ClampedSwiGLU")


def test_clamped_swiglu_between_quantize_ops_under_fp8():
    """TE's test wraps it in Quantize ops under a recipe: the activation itself is not cast."""
    x_ref, x = _data((32, 64), 3)
    dy_ref, dy = _data((32, 32), 4, requires_grad=False)
    y_ref = _clamped(x_ref, 7.0, 1.702, 1.0)
    y_ref.backward(dy_ref)
    seq = te.ops.Sequential(te.ops.Quantize(forward=False, backward=True), te.ops.ClampedSwiGLU(),
                            te.ops.Quantize(forward=True, backward=False))
    with te.autocast(enabled=True, recipe=te.recipe.Float8CurrentScaling()):
        y = seq(x)
    y.backward(dy)
    _check(y, y_ref, {"x": (x_ref, x)}, torch.float8_e4m3fn, "ClampedSwiGLU fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("betas", [(4.0, 25.0), (3.0, 12.0)])
@pytest.mark.parametrize("glu_interleave_size", [None, 32])
def test_situglu(dtype, betas, glu_interleave_size):
    x_ref, x = _data((17, 192), 5, dtype)
    dy_ref, dy = _data((17, 96), 6, dtype, requires_grad=False)
    y_ref = _situ(_deinterleave(x_ref, glu_interleave_size), *betas)
    y_ref.backward(dy_ref)
    op = te.ops.SiTUGLU(beta1=betas[0], beta2=betas[1], glu_interleave_size=glu_interleave_size)
    y = op(x)
    y.backward(dy)
    _check(y, y_ref, {"x": (x_ref, x)}, dtype, "SiTUGLU")


@pytest.mark.parametrize("name,value", [("beta1", 0.0), ("beta2", float("inf")), ("beta1", -1.0)])
def test_situglu_invalid_beta(name, value):
    with pytest.raises(ValueError, match=name):
        te.ops.SiTUGLU(**{name: value})
    with pytest.raises(ValueError, match=name):
        te.ops.ScaledSiTUGLU(**{name: value})


def test_defaults_are_transformer_engines():
    c, s, q = te.ops.ClampedSwiGLU(), te.ops.SiTUGLU(), te.ops.ScaledClampedQGeGLU()
    assert (c.limit, c.alpha, c.glu_linear_offset) == (7.0, 1.702, 1.0) == (q.limit, q.alpha, q.glu_linear_offset)
    assert (s.beta1, s.beta2) == (4.0, 25.0)
    assert te.ops.ScaledSwiGLU(16).glu_interleave_size == 16  # TE's first positional argument
    with pytest.raises(ValueError, match="limit"):
        te.ops.ClampedSwiGLU(limit=float("nan"))


_SCALED = {
    "ScaledSwiGLU": (lambda size: te.ops.ScaledSwiGLU(glu_interleave_size=size),
                     lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]),
    "ScaledSiTUGLU": (lambda size: te.ops.ScaledSiTUGLU(glu_interleave_size=size), _situ),
    "ScaledClampedQGeGLU": (lambda size: te.ops.ScaledClampedQGeGLU(glu_interleave_size=size, limit=0.75,
                                                                     glu_linear_offset=0.0),
                            lambda x: _clamped(x, 0.75, 1.702, 0.0)),
    "ScaledSReLU": (lambda size: te.ops.ScaledSReLU(), lambda x: F.relu(x).square()),
}


@pytest.mark.parametrize("name", list(_SCALED))
@pytest.mark.parametrize("in_shape", [(71, 192), (5, 7, 128)])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)], ids=["both", "x", "scales"])
def test_scaled_activation(name, in_shape, grads):
    make, torch_form = _SCALED[name]
    size = None if name == "ScaledSReLU" or in_shape[0] == 5 else 32
    x_ref, x = _data(in_shape, 7, requires_grad=grads[0])
    s_ref, s = _data(in_shape[:-1], 8, requires_grad=grads[1])
    y_ref = s_ref.unsqueeze(-1) * torch_form(_deinterleave(x_ref, size))
    dy_ref, dy = _data(y_ref.shape, 9, requires_grad=False)
    y_ref.backward(dy_ref)
    op = make(size)
    y = op(x, s)
    y.backward(dy)
    assert y.shape == y_ref.shape
    if not grads[0]:
        assert x.grad is None
    if not grads[1]:
        assert s.grad is None
    _check(y, y_ref, {"x": (x_ref, x), "scales": (s_ref, s)}, torch.float32, name)


def test_scaled_activation_in_a_sequential_after_a_linear_and_in_bf16():
    lin = te.ops.Linear(16, 64).to(torch.bfloat16)
    seq = te.ops.Sequential(lin, te.ops.ScaledSiTUGLU(beta2=2.0))
    x_ref, x = _data((4, 16), 10, torch.bfloat16)
    s_ref, s = _data((4,), 11, torch.bfloat16)
    y = seq(x, s)
    w, b = lin.weight.detach().double(), lin.bias.detach().double()
    pre = x_ref @ w.t() + b
    pre = pre + (pre.to(torch.bfloat16).double() - pre).detach()  # the linear's output is bf16
    y_ref = s_ref.unsqueeze(-1) * _situ(pre, 4.0, 2.0)
    dy_ref, dy = _data(y.shape, 12, torch.bfloat16, requires_grad=False)
    y.backward(dy)
    y_ref.backward(dy_ref)
    assert y.dtype == torch.bfloat16 and s.grad.dtype == torch.bfloat16
    assert_close(y, y_ref.detach(), torch.bfloat16, "Linear -> ScaledSiTUGLU y")
    # dx: the bf16 d pre-activation through a bf16 GEMM (sums of 32 products)
    assert_close(x.grad, x_ref.grad, torch.bfloat16, "Linear -> ScaledSiTUGLU dx", scaled=True)
    assert_close(s.grad, s_ref.grad, torch.bfloat16, "Linear -> ScaledSiTUGLU dscales", scaled=True)


@pytest.mark.parametrize("op_cls", [te.ops.ScaledSwiGLU, te.ops.ScaledSiTUGLU, te.ops.ScaledClampedQGeGLU])
def test_scaled_glu_rejects_activation_recompute_in_mlp(op_cls):
    assert op_cls().activation_recompute_in_mlp is False
    with pytest.raises(ValueError, match="does not support activation recomputation"):
        op_cls(activation_recompute_in_mlp=True)


def test_scaled_srelu_takes_activation_recompute_in_mlp_and_refuses_to_run_with_it():
    op = te.ops.ScaledSReLU(activation_recompute_in_mlp=True)
    assert op.activation_recompute_in_mlp
    with pytest.raises(RuntimeError, match="fused grouped MLP"):
        op(torch.randn(3, 8), torch.randn(3))


def test_scales_of_the_wrong_shape_are_named():
    with pytest.raises(ValueError, match=r"scales must have the input's shape without its last dim, \(3,\)"):
        te.ops.ScaledSwiGLU()(torch.randn(3, 8), torch.randn(3, 4))
