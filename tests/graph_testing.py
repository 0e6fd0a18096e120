"""What the CUDA-graph tests share: the recipes they train under, the model, and
the quantizers' scaling state to compare."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")

RECIPES = {
    "bf16": None,
    "current": te.recipe.Float8CurrentScaling(),
    "delayed": te.recipe.DelayedScaling(amax_history_len=4),
    "block": te.recipe.Float8BlockScaling(),
}


def mlp(device: str) -> te.ops.Sequential:
    torch.manual_seed(0)
    return te.ops.Sequential(
        te.ops.RMSNorm(256), te.ops.Linear(256, 512), te.ops.GELU(), te.ops.Linear(512, 256)
    ).to(device, torch.bfloat16)


def quantizer_state(model) -> dict:
    """Every quantizer's state dict entry, cloned, keyed by module, role and name."""
    out = {}
    for name, op in model.named_modules():
        for role, q in getattr(op, "_quantizers", {}).items():
            for k, v in q.state_dict().items():
                out[f"{name}.{role}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out
