"""``fusion_plan()``'s report: the published plans as data, whose text is the readable account.

A :class:`PlanReport` is a ``str`` (what ``print(model.fusion_plan())`` shows) that
also carries the plans as data: ``report.groups`` (one :class:`GroupReport` per
group: its ops, recipe, conditions, forward and backward steps with the rule each
came from, the rules that declined and why, the kernel backends), and
``report.rules()`` for the rules that fired. Code reads these, not the text.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlanReport", "GroupReport", "StepReport", "plan_report"]


@dataclass(frozen=True)
class StepReport:
    executor: str  # the basic or fused op's class name
    ops: tuple[int, ...]  # the indices of the basic ops it covers
    rule: str | None  # the fusion rule that built it (None: a basic op)


@dataclass(frozen=True)
class GroupReport:
    index: int
    ops: tuple[str, ...]  # each basic op's description (empty for a plain module)
    plain_module: str | None = None  # a plain module's class name (it runs as is)
    recipe_key: str | None = None  # None: not built yet
    conditions: tuple[tuple[str, str], ...] = ()
    forward: tuple[StepReport, ...] = ()
    backward: tuple[StepReport, ...] = ()
    declined: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        if self.plain_module is not None:
            return [f"group {self.index}: plain module {self.plain_module} (runs as is)"]
        out = [f"group {self.index}: {len(self.ops)} ops: " + ", ".join(f"{i}:{d}" for i, d in enumerate(self.ops))]
        if self.recipe_key is None:
            return out + ["  not built yet (call the model once)"]
        out.append(f"  recipe: {self.recipe_key}")
        out.append("  built for: " + " ".join(f"{k}={v}" for k, v in self.conditions))
        for name, steps in (("forward", self.forward), ("backward", self.backward)):
            if name == "backward" and not steps:
                continue
            out.append(f"  {name}:")
            for step in steps:
                covers = ", ".join(f"{i}:{self.ops[i]}" for i in step.ops)
                out.append(f"    {step.executor}({covers})" + (f"  [rule {step.rule}]" if step.rule else ""))
        out += [f"  declined: {reason}" for reason in self.declined]
        return out + [f"  kernel: {note}" for note in self.kernels]


class PlanReport(str):
    """The text of a model's plans, with the plans as data (see the module doc)."""

    groups: tuple[GroupReport, ...]

    def __new__(cls, groups) -> "PlanReport":
        groups = tuple(groups)
        report = super().__new__(cls, "\n".join(line for g in groups for line in g.lines()))
        report.groups = groups
        return report

    def rules(self, pass_: str | None = None) -> set[str]:
        """The rules that fired (in ``pass_``: 'forward' or 'backward', or both)."""
        passes = ("forward", "backward") if pass_ is None else (pass_,)
        return {s.rule for g in self.groups for p in passes for s in getattr(g, p) if s.rule}


def _steps(steps) -> tuple[StepReport, ...]:
    return tuple(StepReport(type(s.executor).__name__, s.indices, s.rule) for s in steps)


def group_report(index: int, fuser) -> GroupReport:
    """The report of one fuser's published plan."""
    ops = tuple(op.describe() for op in fuser.ops)
    plan = fuser.plan
    if plan is None:
        return GroupReport(index, ops)
    key = plan.key
    conditions = (("backward", str(key.needs_backward)), ("dtype", str(key.dtype).replace("torch.", "")),
                  ("training", str(key.training)), ("calibrating", str(key.calibrating)),
                  ("device", key.device_type), ("backend", key.backend))
    if plan.private:  # an evaluation under another recipe: the ops keep the installed quantizers (training's)
        conditions += (("quantizers", "private"),)
    return GroupReport(index, ops, None, plan.recipe_key, conditions, _steps(plan.forward),
                       _steps(plan.backward) if key.needs_backward else (), tuple(plan.declined), tuple(plan.notes))


def plan_report(groups) -> PlanReport:
    """The report of a list of groups (fusers, and plain modules between them)."""
    from .fuser import OperationFuser

    return PlanReport(group_report(i, g) if isinstance(g, OperationFuser) else
                      GroupReport(i, (), plain_module=type(g).__name__) for i, g in enumerate(groups))
