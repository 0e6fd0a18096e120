"""Ops on the GPU with the fast kernels (backend 'auto': Triton / CUDA) at real
shapes, against float64 on representable inputs, and against the reference
backend on the same data."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import FP8_RECIPES, representable, run
from te_fuser.kernels.reference import activation_reference
from tolerances import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, H, F = 2048, 1024, 4096


def mlp(dtype):
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(H, 2 * F), te.ops.SwiGLU(), te.ops.Linear(F, H)).to("cuda", dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(representable(*p.shape, scale_exp=-4 if p.dim() == 2 else -2).to(p.device, dtype))
    return model


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
def test_linear_matches_float64_on_the_gpu(recipe_name):
    recipe = FP8_RECIPES[recipe_name]
    torch.manual_seed(1)
    lin = te.ops.Linear(H, F).to("cuda", torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(representable(F, H, scale_exp=-3))
        lin.bias.copy_(representable(F, scale_exp=-2))
    x = representable(TOKENS, H).cuda().bfloat16()
    dy = representable(TOKENS, F, scale_exp=-3).cuda().bfloat16()
    (y,), grads = run(lin, x, recipe=recipe, dy=dy)
    x64, w64, b64, dy64 = x.double(), lin.weight.double(), lin.bias.double(), dy.double()
    ctx = f"Linear {TOKENS}x{H}->{F} recipe={recipe_name} cuda"
    assert_close(y, x64 @ w64.t() + b64, torch.bfloat16, ctx + " y")
    assert_close(grads["x"], dy64 @ w64, torch.bfloat16, ctx + " dx")
    assert_close(grads["linear.weight"], dy64.t() @ x64, torch.bfloat16, ctx + " dw")
    assert_close(grads["bias_op.bias"], dy64.sum(0), torch.bfloat16, ctx + " db")


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
def test_mlp_fast_backend_matches_reference_backend(recipe_name):
    recipe = FP8_RECIPES[recipe_name]
    x = representable(TOKENS, H, scale_exp=-2).cuda().bfloat16()
    dy = representable(TOKENS, H, scale_exp=-3).cuda().bfloat16()
    fast, ref = mlp(torch.bfloat16), mlp(torch.bfloat16)
    out_f, g_f = run(fast, x, recipe=recipe, dy=dy)
    with te.autocast(backend="reference"):
        out_r, g_r = run(ref, x, recipe=recipe, dy=dy)
    assert "reference" not in fast.fusion_plan().split("kernel: gemm:")[1].split("\n")[0]
    key = recipe.fp8_format.fwd_dtype
    assert_close(out_f[0], out_r[0], key, f"MLP {recipe_name} output", scaled=True)
    for name in g_r:
        assert_close(g_f[name], g_r[name], recipe.fp8_format.bwd_dtype, f"MLP {recipe_name} grad {name}", scaled=True)


def test_swiglu_on_the_gpu_matches_float64():
    x = torch.randn(TOKENS, 2 * F, device="cuda", dtype=torch.bfloat16)
    (y,), grads = run(te.ops.SwiGLU(), x, dy=torch.ones(TOKENS, F, device="cuda", dtype=torch.bfloat16))
    x64 = x.double().requires_grad_(True)
    ref = activation_reference(x64, "swiglu")
    ref.sum().backward()
    assert_close(y, ref.detach(), torch.bfloat16, "swiglu y")
    assert_close(grads["x"], x64.grad, torch.bfloat16, "swiglu dx")
