"""LayerNorm and RMSNorm with TransformerEngine's ``zero_centered_gamma`` (the norm
scales by ``weight + 1``) and a tuple ``normalized_shape`` (the trailing dims),
against float64; also RMSNorm's fused backward with a branch gradient."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import run
from tolerances import assert_close


def _reference(kind, x, weight, bias, dims, eps, centered):
    x64 = x.double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    b64 = None if bias is None else bias.detach().double().requires_grad_(True)
    gamma = w64 + 1 if centered else w64
    axes = tuple(range(-dims, 0))
    if kind == "LayerNorm":
        mean = x64.mean(axes, keepdim=True)
        var = (x64 - mean).pow(2).mean(axes, keepdim=True)
        y = (x64 - mean) * torch.rsqrt(var + eps) * gamma + b64
    else:
        y = x64 * torch.rsqrt(x64.pow(2).mean(axes, keepdim=True) + eps) * gamma
    return x64, w64, b64, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(48,), (7, 6)], ids=["int", "tuple"])
@pytest.mark.parametrize("centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_matches_float64(kind, centered, shape, dtype):
    gen = torch.Generator().manual_seed(hash((kind, centered, shape)) % 2**31)
    normalized = shape[0] if len(shape) == 1 else shape
    op = getattr(te.ops, kind)(normalized, eps=0.25, zero_centered_gamma=centered, dtype=dtype)
    if centered:
        assert torch.all(op.weight == 0), f"{kind}: a zero-centered gamma starts at zero"
    with torch.no_grad():
        op.weight.copy_(0.3 * torch.randn(shape, generator=gen))
        if op.bias is not None:
            op.bias.copy_(torch.randn(shape, generator=gen))
    x = (-1.5 + torch.randn(5, 3, *shape, generator=gen)).to(dtype)
    dy = torch.randn(5, 3, *shape, generator=gen).to(dtype)
    outs, grads = run(op, x, dy=dy)
    x64, w64, b64, y = _reference(kind, x, op.weight, op.bias, len(shape), 0.25, centered)
    y.backward(dy.double())
    context = f"{kind} shape={shape} zero_centered_gamma={centered} dtype={dtype}"
    assert_close(outs[0], y.detach(), dtype, f"{context}: output")
    assert_close(grads["x"], x64.grad, dtype, f"{context}: dx")
    assert_close(op.weight.grad, w64.grad, dtype, f"{context}: dweight")
    if b64 is not None:
        assert_close(op.bias.grad, b64.grad, dtype, f"{context}: dbias")


def test_zero_centered_rmsnorm_in_the_fused_add_backward():
    torch.manual_seed(5)
    norm = te.ops.RMSNorm(64, zero_centered_gamma=True)
    with torch.no_grad():
        norm.weight.normal_(0, 0.2)
    model = te.ops.Sequential(te.ops.MakeExtraOutput(), norm)
    x, dy, d_branch = torch.randn(8, 64), torch.randn(8, 64), torch.randn(8, 64)
    outs, grads = run(model, x, dy=dy, dextras=[d_branch])
    assert "backward_add_rmsnorm" in str(model.fusion_plan())
    x64, w64, _, y = _reference("RMSNorm", x, norm.weight, None, 1, norm.eps, True)
    torch.autograd.backward([y, x64], [dy.double(), d_branch.double()])
    assert_close(outs[0], y.detach(), torch.float32, "MakeExtraOutput -> RMSNorm(zero_centered_gamma): output")
    assert_close(grads["x"], x64.grad, torch.float32, "MakeExtraOutput -> RMSNorm(zero_centered_gamma): dx")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="normalized_shape"):
        te.ops.LayerNorm((4, 0))
    with pytest.raises(ValueError, match="trailing dims"):
        te.ops.RMSNorm((4, 8))(torch.randn(3, 8, 4))
    with pytest.raises(TypeError, match="zero_centered_gamma"):
        te.ops.RMSNorm(8, zero_centered_gamma=1)
