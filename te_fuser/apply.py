"""``te.apply_recipe``: give a whole model a recipe of its own, at once, or not at all.

    te.apply_recipe(model, te.recipe.Float8CurrentScaling(), example_inputs=(tokens,),
                    overrides={"head": None})          # the LM head pinned to high precision
    loss = loss_fn(model(tokens))                        # no te.autocast needed

For every te_fuser ``Sequential`` and every op or ``Linear`` called on its own in
the module tree, the complete plans (forward and backward) and fresh quantizers
for its recipe are built and validated first; only when all of them succeed are
they published, together. On any failure one error names the module path and
the op's own reason, and no module has changed: plans, quantizers, scaling
state and weight casts are as they were.

Shapes come from ``example_inputs`` (the model runs once on them under
``torch.no_grad()``: plain modules for real, te_fuser groups only recording the
shapes they see and answering zeros), else from each group's last call; a group
that has not run is an error that asks for ``example_inputs``.

Which recipe a call runs (``own``: the model's, from ``apply_recipe``; ``pinned``:
an ``overrides`` entry):

| call | a module without one | with ``own`` recipe R | in a subtree pinned to P |
|---|---|---|---|
| no ``te.autocast`` | high precision | R | P |
| ``te.autocast()`` (no recipe named) | ``DEFAULT_RECIPE`` | R | P |
| ``te.autocast(recipe=A)`` | A | A | P |
| ``te.autocast(enabled=False)`` | high precision | high precision | P |
| ``te.autocast(recipe=A, override_pinned=True)`` | A | A | A |

The applied recipe's key travels in each op's extra state; loading a checkpoint
saved under another applied recipe warns (or, with ``on_mismatched_load="error"``,
raises), and delayed-scaling history carries over as on a switch.
:func:`fusion_plan` and :func:`fusion_stats` report a whole model, by module path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import epoch
from .ops.fuser import FusionStats, OperationFuser, probing
from .ops.find import fuser_owners, owner_fusers
from .ops.op import BasicOperation
from .ops.sequential import Sequential
from .recipe import Recipe

__all__ = ["apply_recipe", "fusion_plan", "fusion_stats", "ModelFusionStats", "MISMATCH_POLICIES"]

MISMATCH_POLICIES = ("warn", "error", "ignore")


# -- the te_fuser modules of a tree ------------------------------------------------------

def _ops_of(owner: nn.Module) -> list[BasicOperation]:
    return [op for fuser in owner_fusers(owner) for op in fuser.ops]


def _label(path: str, owner: nn.Module, fuser: OperationFuser, fusers: list) -> str:
    where = path or "(the model)"
    if len(fusers) > 1:
        where += f", group of {', '.join(op.describe() for op in fuser.ops[:3])}"
    return f"{where} [{type(owner).__name__}]"


# -- applying a recipe ----------------------------------------------------------------

@dataclass
class _Target:
    path: str
    owner: nn.Module
    recipe: Recipe | None
    pinned: bool
    fusers: list = field(default_factory=list)


def _targets(model: nn.Module, recipe: Recipe | None, overrides: dict) -> list[_Target]:
    targets = []
    for path, owner in fuser_owners(model):
        covering = [p for p in overrides if p == "" or path == p or path.startswith(p + ".")]
        if covering:
            best = max(covering, key=len)
            targets.append(_Target(path, owner, overrides[best], True))
        else:
            targets.append(_Target(path, owner, recipe, False))
        targets[-1].fusers = owner_fusers(owner)
    return targets


def _check_arguments(model, recipe, overrides, on_mismatched_load) -> dict:
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_recipe(model): must be a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"apply_recipe(recipe): must be a te_fuser recipe or None, got {type(recipe).__name__}")
    if on_mismatched_load not in MISMATCH_POLICIES:
        raise ValueError(f"apply_recipe(on_mismatched_load=...): must be one of {list(MISMATCH_POLICIES)}, "
                         f"got {on_mismatched_load!r}")
    overrides = dict(overrides or {})
    paths = dict(model.named_modules())
    for path, value in overrides.items():
        if not isinstance(path, str) or path not in paths:
            raise ValueError(f"apply_recipe(overrides=...): {path!r} is not a module path of the model "
                             f"(paths look like {sorted(p for p in paths if p)[:3]})")
        if value is not None and not isinstance(value, Recipe):
            raise TypeError(f"apply_recipe(overrides[{path!r}]): must be a te_fuser recipe or None (high "
                            f"precision), got {type(value).__name__}")
    return overrides


def _probe_candidates(model, targets: list[_Target], example_inputs) -> dict:
    """Run the model on ``example_inputs`` with its fusers recording the plans they
    would need (raising, with the module path, where one cannot be built)."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    labels = {f: _label(t.path, t.owner, f, t.fusers) for t in targets for f in t.fusers}
    recipes = {f: t.recipe for t in targets for f in t.fusers}
    error = None
    with probing(recipes) as (plans, failed), torch.no_grad():
        try:
            model(*inputs)
        except (ValueError, TypeError, RuntimeError) as err:
            error = err
    if error is not None:
        if failed[0] is None:
            raise error
        raise _named(error, labels.get(failed[0], "a te_fuser module")) from error
    return plans


def _require_a_call(target: _Target, fuser: OperationFuser) -> None:
    """The shapes of a plan come from a call: one before, or the example inputs."""
    if fuser.plan is None:
        raise ValueError(f"apply_recipe: {_label(target.path, target.owner, fuser, target.fusers)} has not run "
                         "yet, so its input shape is unknown; pass example_inputs=(...) for the model's forward")


def _last_call_candidate(target: _Target, fuser: OperationFuser):
    plan = fuser.plan
    return fuser.candidate(target.recipe, False, plan.in_shape, plan.dtype, plan.device_type, True, plan.training)


def _named(err: Exception, label: str) -> Exception:
    """``err`` with the module path in front of its message, same type when possible."""
    message = f"apply_recipe: {label}: {err}"
    try:
        return type(err)(message)
    except Exception:
        return RuntimeError(message)


def apply_recipe(model: nn.Module, recipe: Recipe | None, *, example_inputs: Any = None,
                 overrides: dict[str, Recipe | None] | None = None, on_mismatched_load: str = "warn") -> nn.Module:
    """Make ``recipe`` (``None``: high precision) the model's own, every te_fuser
    module of it at once (see the module doc); ``overrides`` pins another recipe, or
    high precision, to subtrees by module path. Returns ``model``."""
    overrides = _check_arguments(model, recipe, overrides, on_mismatched_load)
    targets = _targets(model, recipe, overrides)
    probed = _probe_candidates(model, targets, example_inputs) if example_inputs is not None else {}
    candidates = []
    for t in targets:
        for f in t.fusers:
            plan = probed[f] if f in probed else None
            if plan is None:
                _require_a_call(t, f)
                try:
                    plan = _last_call_candidate(t, f)
                except (ValueError, TypeError, RuntimeError) as err:
                    raise _named(err, _label(t.path, t.owner, f, t.fusers)) from err
            candidates.append((t, f, plan))
    for t in targets:  # all plans stand: publish them all
        setting = (t.recipe, t.pinned)
        if isinstance(t.owner, Sequential):  # the fusers it makes again when its list changes take it
            t.owner.own_recipe = setting
        key = None if t.recipe is None else str(t.recipe)
        for op in _ops_of(t.owner):
            op.mark_applied(key, on_mismatched_load)
    for t, f, plan in candidates:
        f.own_recipe = (t.recipe, t.pinned)
        f.publish(plan)
    epoch.APPLIED[0] += 1
    return model


# -- reports --------------------------------------------------------------------------

def _setting_text(fuser: OperationFuser) -> str:
    own = fuser.own_recipe
    if own is None:
        return "from te.autocast"
    recipe, pinned = own
    return f"{'pinned' if pinned else 'own'}: {'high precision' if recipe is None else type(recipe).__name__}"


def fusion_plan(model: nn.Module) -> str:
    """Every te_fuser module's published plan, by module path, with the recipe each
    one runs by default (its own, pinned, or te.autocast's)."""
    blocks = []
    for path, owner in fuser_owners(model):
        fusers = owner_fusers(owner)
        settings = sorted({_setting_text(f) for f in fusers})
        head = f"{path or '(the model)'} [{type(owner).__name__}] recipe {'; '.join(settings)}"
        body = owner.fusion_plan() if isinstance(owner, Sequential) else _fuser_text(fusers[0])
        blocks.append(head + "\n" + "\n".join("  " + line for line in body.splitlines()))
    return "\n".join(blocks)


def _fuser_text(fuser: OperationFuser) -> str:
    plan = fuser.plan
    if plan is None:
        return "not built yet (call the module once)"
    steps = ", ".join(type(step.executor).__name__ for step in plan.forward)
    return f"recipe: {plan.recipe_key}\nforward: {steps}"


@dataclass
class ModelFusionStats:
    """A model's fusion counters: the sum, and each module path's."""

    total: FusionStats
    by_path: dict[str, FusionStats]


def fusion_stats(model: nn.Module) -> ModelFusionStats:
    total, by_path = FusionStats(), {}
    for path, owner in fuser_owners(model):
        mine = by_path[path] = FusionStats()
        for f in owner_fusers(owner):
            mine.add(f.stats)
        total.add(mine)
    return ModelFusionStats(total, by_path)
