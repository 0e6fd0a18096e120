"""Fusion rules as data, and the one matcher that applies them.

A rule names a pass (``forward`` or ``backward``), a pattern of basic-op types
(in forward order, also for backward rules), a predicate on the matched ops and
the recipe that returns ``None`` to accept or a reason to decline, and the fused
op class to build. A rule written for one kind of recipe names it in
``applies_to``: under other recipes it is not tried, and not listed as declined
(an FP8 hand-off that needs delayed scaling would otherwise crowd every other
plan with the same reason). The matcher walks the op list left to right; at each position
it tries the rules of the pass in table order (longest patterns first) and takes
the first that accepts. It records which rule fired where, and why others that
matched the pattern declined; ``Sequential.fusion_plan()`` shows both.

A predicate that depends on how the plan will run (whether a backward pass
follows, the device) reads :func:`build_context` while the matcher calls it.

Users add rules with :func:`register_fusion_rule`; :func:`without_fusion_rules`
leaves some out for a block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .op import BasicOperation, FusedOperation

__all__ = ["FusionRule", "PlanStep", "MatchResult", "BuildContext", "build_context", "register_fusion_rule",
           "unregister_fusion_rule", "fusion_rules", "match"]

Predicate = Callable[[Sequence[BasicOperation], object], "str | None"]


@dataclass(frozen=True)
class BuildContext:
    """How the plan being built will run: what a predicate may need beyond the ops
    and the recipe."""

    needs_backward: bool
    device: object  # torch.device


_CONTEXT: list[BuildContext] = []


def build_context() -> BuildContext | None:
    """The context of the plan being matched (``None`` outside :func:`match`)."""
    return _CONTEXT[-1] if _CONTEXT else None


@dataclass(frozen=True)
class FusionRule:
    name: str
    pass_: str  # "forward" | "backward"
    pattern: tuple[tuple[type, ...], ...]  # each position: the accepted op types
    build: Callable[[Sequence[BasicOperation]], FusedOperation]
    predicate: Predicate = field(default=lambda ops, recipe: None)
    applies_to: Callable[[object], bool] | None = None  # recipe -> whether the rule is tried at all

    def __post_init__(self) -> None:
        if self.pass_ not in ("forward", "backward"):
            raise ValueError(f"FusionRule.pass_: must be 'forward' or 'backward', got {self.pass_!r}")
        if not self.pattern:
            raise ValueError(f"FusionRule.pattern of {self.name!r}: must name at least one op type")

    def matches_types(self, ops: Sequence[BasicOperation], start: int) -> bool:
        if start + len(self.pattern) > len(ops):
            return False
        return all(isinstance(ops[start + i], types) for i, types in enumerate(self.pattern))


@dataclass(frozen=True)
class PlanStep:
    """One executed unit: a basic op or a fused op over ``indices`` (consecutive)."""

    executor: object  # BasicOperation | FusedOperation
    indices: tuple[int, ...]
    rule: str | None


@dataclass
class MatchResult:
    steps: list[PlanStep]
    declined: list[str]


_RULES: list[FusionRule] = []


def register_fusion_rule(rule: FusionRule) -> None:
    """Add ``rule`` to the table (kept ordered longest pattern first, then by
    registration). Plans built afterwards use it."""
    if not isinstance(rule, FusionRule):
        raise TypeError(f"register_fusion_rule: expected a FusionRule, got {type(rule).__name__}")
    if any(r.name == rule.name for r in _RULES):
        raise ValueError(f"register_fusion_rule: a rule named {rule.name!r} already exists")
    _RULES.append(rule)
    _RULES.sort(key=lambda r: -len(r.pattern))  # stable: ties keep registration order


def unregister_fusion_rule(name: str) -> FusionRule:
    """Remove the rule called ``name`` from the table and return it."""
    for i, rule in enumerate(_RULES):
        if rule.name == name:
            return _RULES.pop(i)
    raise KeyError(f"unregister_fusion_rule: no rule named {name!r}")


@contextlib.contextmanager
def without_fusion_rules(*names: str) -> Iterator[None]:
    """Take the rules called ``names`` out of the table inside the block (plans built
    there do without them: to measure or test what a rule changes), then put the
    table back as it was."""
    missing = [n for n in names if not any(r.name == n for r in _RULES)]
    if missing:
        raise KeyError(f"without_fusion_rules: no rule named {missing[0]!r}")
    saved = list(_RULES)
    _RULES[:] = [r for r in _RULES if r.name not in names]
    try:
        yield
    finally:
        _RULES[:] = saved


def fusion_rules(pass_: str | None = None) -> list[FusionRule]:
    return [r for r in _RULES if pass_ is None or r.pass_ == pass_]


def match(ops: Sequence[BasicOperation], pass_: str, recipe, enabled: bool = True,
          context: BuildContext | None = None) -> MatchResult:
    """Cover ``ops`` with fused and basic steps for one pass (basic steps only when
    not ``enabled``); predicates see ``context`` through :func:`build_context`."""
    if context is None:
        return _match(ops, pass_, recipe, enabled)
    _CONTEXT.append(context)
    try:
        return _match(ops, pass_, recipe, enabled)
    finally:
        _CONTEXT.pop()


def _match(ops: Sequence[BasicOperation], pass_: str, recipe, enabled: bool) -> MatchResult:
    rules = fusion_rules(pass_) if enabled else []
    steps: list[PlanStep] = []
    declined: list[str] = []
    i = 0
    while i < len(ops):
        for rule in rules:
            if not rule.matches_types(ops, i) or (rule.applies_to is not None and not rule.applies_to(recipe)):
                continue
            window = ops[i : i + len(rule.pattern)]
            reason = rule.predicate(window, recipe)
            if reason is None:
                steps.append(PlanStep(rule.build(window), tuple(range(i, i + len(window))), rule.name))
                i += len(window)
                break
            declined.append(f"{rule.name} at ops {i}..{i + len(window) - 1}: {reason}")
        else:
            steps.append(PlanStep(ops[i], (i,), None))
            i += 1
    return MatchResult(steps, declined)
