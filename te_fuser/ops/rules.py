"""Fusion rules as data, and the one matcher that applies them.

A rule names a pass (``forward`` or ``backward``), a pattern of basic-op types
(in forward order, also for backward rules), a predicate on the matched ops, the
recipe and (when it takes a third argument) the :class:`BuildContext` of the plan
being built, which returns ``None`` to accept or a reason to decline, and the
fused op class to build. A rule written for one kind of recipe names it in
``applies_to``: under other recipes it is not tried, and not listed as declined
(an FP8 hand-off that needs delayed scaling would otherwise crowd every other
plan with the same reason). A predicate reads only the ops' configuration, the
recipe and the context: a fuser keeps what the matcher answered per recipe key
and context (its plan templates) and reuses it. The matcher walks the op list
left to right; at each position it tries the rules of the pass in table order
(longest patterns first) and takes the first that accepts. It records which rule
fired where, and why others that matched the pattern declined;
``Sequential.fusion_plan()`` reports both.

Rules live in :class:`RuleTable` values. The default table is what
:func:`register_fusion_rule` extends; a ``Sequential(..., rules=table)`` (or a
fuser) can be given a table of its own, e.g. ``fusion_rule_table().without(name)``;
:func:`without_fusion_rules` leaves rules out for the plans built in a block, in
this thread only.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .op import BasicOperation, FusedOperation

__all__ = ["FusionRule", "RuleTable", "PlanStep", "MatchResult", "BuildContext", "register_fusion_rule",
           "unregister_fusion_rule", "fusion_rules", "fusion_rule_table", "without_fusion_rules", "match"]

Predicate = Callable[..., "str | None"]  # (ops, recipe) or (ops, recipe, context) -> reason or None


@dataclass(frozen=True)
class BuildContext:
    """How the plan being built will run: what a predicate may need beyond the ops
    and the recipe."""

    needs_backward: bool
    device: object  # torch.device


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
        object.__setattr__(self, "_takes_context", _positional_arity(self.predicate) >= 3)

    def decline_reason(self, ops: Sequence[BasicOperation], recipe, context: "BuildContext") -> "str | None":
        """The predicate's answer for ``ops`` (with the build context when it takes one)."""
        return self.predicate(ops, recipe, context) if self._takes_context else self.predicate(ops, recipe)

    def matches_types(self, ops: Sequence[BasicOperation], start: int) -> bool:
        if start + len(self.pattern) > len(ops):
            return False
        for i, types in enumerate(self.pattern):
            if not isinstance(ops[start + i], types):
                return False
        return True


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


def _positional_arity(fn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


@dataclass(frozen=True)
class RuleTable:
    """An ordered set of rules (longest pattern first, then in the order added)."""

    rules: tuple[FusionRule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starting", {})  # (pass, op type) -> the rules whose first position takes it

    def with_rules(self, *rules: FusionRule) -> "RuleTable":
        out = list(self.rules)
        for rule in rules:
            if not isinstance(rule, FusionRule):
                raise TypeError(f"RuleTable: expected a FusionRule, got {type(rule).__name__}")
            if any(r.name == rule.name for r in out):
                raise ValueError(f"register_fusion_rule: a rule named {rule.name!r} already exists")
            out.append(rule)
        return RuleTable(tuple(sorted(out, key=lambda r: -len(r.pattern))))  # stable: ties keep their order

    def without(self, *names: str) -> "RuleTable":
        missing = [n for n in names if not any(r.name == n for r in self.rules)]
        if missing:
            raise KeyError(f"without_fusion_rules: no rule named {missing[0]!r}")
        return RuleTable(tuple(r for r in self.rules if r.name not in names))

    def for_pass(self, pass_: str | None) -> list[FusionRule]:
        return [r for r in self.rules if pass_ is None or r.pass_ == pass_]

    def starting_with(self, pass_: str, op_type: type) -> tuple[FusionRule, ...]:
        """The rules of ``pass_`` whose pattern's first position accepts an op of
        ``op_type``, in the table's order (worked out once per type: re-fusion tries
        only these at each op, not every rule of the pass)."""
        key = (pass_, op_type)
        found = self._starting.get(key)
        if found is None:
            found = tuple(r for r in self.for_pass(pass_) if issubclass(op_type, r.pattern[0]))
            self._starting[key] = found
        return found


_DEFAULT = [RuleTable()]  # the process's table: what register_fusion_rule extends
_IN_FORCE = threading.local()  # this thread's without_fusion_rules blocks: a stack of tables


def fusion_rule_table() -> RuleTable:
    """The table plans built here use when no table was given them."""
    stack = getattr(_IN_FORCE, "stack", None)
    return stack[-1] if stack else _DEFAULT[0]


def register_fusion_rule(rule: FusionRule) -> None:
    """Add ``rule`` to the default table. Plans built afterwards use it."""
    _DEFAULT[0] = _DEFAULT[0].with_rules(rule)


def unregister_fusion_rule(name: str) -> FusionRule:
    """Remove the rule called ``name`` from the default table and return it."""
    for rule in _DEFAULT[0].rules:
        if rule.name == name:
            _DEFAULT[0] = _DEFAULT[0].without(name)
            return rule
    raise KeyError(f"unregister_fusion_rule: no rule named {name!r}")


@contextlib.contextmanager
def without_fusion_rules(*names: str) -> Iterator[None]:
    """Plans built in this thread inside the block do without the rules ``names`` (to
    measure or test what a rule changes); other threads and tables are untouched."""
    table = fusion_rule_table().without(*names)
    stack = _IN_FORCE.__dict__.setdefault("stack", [])
    stack.append(table)
    try:
        yield
    finally:
        stack.pop()


def fusion_rules(pass_: str | None = None) -> list[FusionRule]:
    """The rules of the table in force (see :func:`fusion_rule_table`)."""
    return fusion_rule_table().for_pass(pass_)


def _straddled(links: Sequence[tuple], start: int, stop: int) -> "str | None":
    """Why ops ``start..stop-1`` cannot be one step: they hold both the writer and a
    reader of a channel (the reader's input exists only once the writer's step ran)."""
    for writer, reader, channel in links:
        if start <= writer and reader < stop:
            return f"the window holds both the writer (op {writer}) and a reader (op {reader}) of channel {channel!r}"
    return None


def match(ops: Sequence[BasicOperation], pass_: str, recipe, enabled: bool = True,
          context: BuildContext | None = None, table: RuleTable | None = None,
          links: Sequence[tuple] = ()) -> MatchResult:
    """Cover ``ops`` with fused and basic steps for one pass (basic steps only when
    not ``enabled``), with the rules of ``table`` (default: the table in force);
    predicates that take a third argument get ``context``. ``links``: the
    ``(writer op, reader op, channel)`` of the group's extra-tensor channels; no
    step holds both ends of one."""
    table = (table or fusion_rule_table()) if enabled else RuleTable()
    steps: list[PlanStep] = []
    declined: list[str] = []
    i = 0
    while i < len(ops):
        for rule in table.starting_with(pass_, type(ops[i])):
            if not rule.matches_types(ops, i) or (rule.applies_to is not None and not rule.applies_to(recipe)):
                continue
            window = ops[i : i + len(rule.pattern)]
            reason = (links and _straddled(links, i, i + len(window))) or rule.decline_reason(window, recipe, context)
            if reason is None:
                steps.append(PlanStep(rule.build(window), tuple(range(i, i + len(window))), rule.name))
                i += len(window)
                break
            declined.append(f"{rule.name} at ops {i}..{i + len(window) - 1}: {reason}")
        else:
            steps.append(PlanStep(ops[i], (i,), None))
            i += 1
    return MatchResult(steps, declined)
