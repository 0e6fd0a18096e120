"""``MakeExtraOutput -> RMSNorm``'s backward as TransformerEngine's fused
``BackwardAddRMSNorm`` computes it: the norm's input gradient and the branch's
gradient summed in fp32 and rounded once, so that where the two terms cancel the
result still meets the dtype's absolute tolerance against float64."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from tolerances import assert_close


@pytest.mark.parametrize("with_branch_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_branch_and_norm_gradients_round_once(dtype, with_branch_grad):
    gen = torch.Generator().manual_seed(3)
    shape, eps = (32, 48), 0.3
    x, w, dy1, dy2 = (torch.rand(*s, generator=gen).to(dtype) for s in (shape, shape[-1:], shape, shape))
    model = te.ops.Sequential(te.ops.MakeExtraOutput(), te.ops.RMSNorm(shape[-1], eps=eps, dtype=dtype))
    with torch.no_grad():
        model[1].weight.copy_(w)
    x_t = x.clone().requires_grad_()
    y1, y2 = model(x_t)
    loss = (y1 * dy1).sum() + ((y2 * dy2).sum() if with_branch_grad else 0.0)
    loss.backward()

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y1_64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w64
    loss64 = (y1_64 * dy1.double()).sum() + ((x64 * dy2.double()).sum() if with_branch_grad else 0.0)
    loss64.backward()
    context = f"MakeExtraOutput -> RMSNorm dtype={dtype} branch grad={with_branch_grad}"
    assert_close(y1, y1_64.detach(), dtype, f"{context} y")
    assert_close(x_t.grad, x64.grad, dtype, f"{context} dx")
    assert_close(model[1].weight.grad, w64.grad, dtype, f"{context} dw", scaled=True)
    assert "backward_add_rmsnorm" in model.fusion_plan()
