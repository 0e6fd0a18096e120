"""Shared helpers for op and model tests: recipes to sweep and representable data."""

from __future__ import annotations

import torch

import te_fuser as te
from te_fuser import recipe as R
from te_fuser.quantization import IdentityQuantizer


def identity_factory(role):
    return IdentityQuantizer()


RECIPES = {
    "none": None,
    "delayed": R.DelayedScaling(),
    "current": R.Float8CurrentScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "block": R.Float8BlockScaling(power_2_scales=True),
    "rowwise": R.Float8RowwiseScaling(),
    "custom_identity": R.CustomRecipe(identity_factory, qfactory_key="identity"),
    # attention in FP8 (and, under fp8_mha, its FP8 hand-offs with the projections)
    "delayed_mha": R.DelayedScaling(fp8_mha=True),
    "current_mha": R.Float8CurrentScaling(fp8_mha=True),
}
FP8_RECIPES = {k: v for k, v in RECIPES.items() if k not in ("none", "custom_identity")}

# Values exactly representable in E4M3, E5M2 and bf16 whose largest magnitude, 7,
# makes every per-tensor scale a power of two (448 / 7 = 2**6, 57344 / 7 = 2**13);
# block and MX scales are powers of two anyway. Such tensors, and their transposes,
# survive every quantizer unchanged, so a float64 reference sees exactly the
# operands the FP8 GEMMs see.
_VALUES = torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])


def representable(*shape, generator=None, scale_exp: int = 0, dtype=torch.float32) -> torch.Tensor:
    idx = torch.randint(len(_VALUES), shape, generator=generator)
    sign = torch.randint(2, shape, generator=generator) * 2 - 1
    t = _VALUES[idx] * sign
    t.view(-1)[0] = 7.0  # pin the amax
    return (t * 2.0**scale_exp).to(dtype)


def run(model, x, *extras, recipe=None, dy=None, dextras=()):
    """Forward under ``recipe`` (None: high precision), backward with ``dy``; returns
    (outputs tuple, grads dict name->tensor)."""
    x = x.detach().clone().requires_grad_(True)
    extras = [e.detach().clone().requires_grad_(True) for e in extras]
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x, *extras)
    outs = out if isinstance(out, tuple) else (out,)
    grads_out = [dy if dy is not None else torch.ones_like(outs[0])] + list(dextras)
    torch.autograd.backward(list(outs[: len(grads_out)]), grads_out)
    grads = {"x": x.grad}
    for i, e in enumerate(extras):
        grads[f"extra{i}"] = e.grad
    for name, p in model.named_parameters():
        grads[name] = p.grad
    return tuple(o.detach() for o in outs), grads


def record_matches(monkeypatch) -> list:
    """The passes ("forward", "backward") the fusers match rules for from now on,
    in order: a plan built from a kept template adds none."""
    from te_fuser.ops import fuser as fuser_module

    matched, real_match = [], fuser_module.match
    monkeypatch.setattr(fuser_module, "match", lambda *args, **kw: matched.append(args[1]) or real_match(*args, **kw))
    return matched
