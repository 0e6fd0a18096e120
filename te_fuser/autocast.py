"""``te.autocast``: the one ambient context of te_fuser, read in one place.

    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = model(x)

Nestable: the inner context wins and the outer state comes back on exit, also on
an exception. ``enabled=False`` runs high precision. With ``recipe=None`` the
recipe is the model's own (see ``te.apply_recipe``), else :data:`DEFAULT_RECIPE`
(delayed scaling, HYBRID format, the TransformerEngine default). A region that
names a recipe, or ``enabled=False``, overrides a model's own recipe but not a
subtree pinned by ``apply_recipe(overrides=...)``, unless ``override_pinned=True``.
``calibrating=True`` records amaxes for delayed scaling while computing in high
precision. ``backend=`` overrides the kernel
backend inside the region. It composes with ``torch.autocast`` in either nesting
order: ops compute in the torch-autocast dtype when one is active.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from . import backend as _backend
from .quantization.amax_reduction import PENDING as _PENDING
from .quantization.amax_reduction import flush_amax_reductions as _flush_amax_reductions
from .recipe import DelayedScaling, Recipe

__all__ = ["autocast", "AutocastState", "current_state", "DEFAULT_RECIPE", "STATE_STACK"]

DEFAULT_RECIPE = DelayedScaling()
_is_compiling = torch.compiler.is_compiling


class AutocastState(NamedTuple):
    """One te.autocast region's settings (immutable; a tuple, cheap to build)."""

    enabled: bool = False
    recipe: Recipe | None = None
    calibrating: bool = False
    amax_reduction_group: Any = None
    named: bool = False  # the region chose: a recipe given, or enabled=False (a model's own recipe yields)
    override_pinned: bool = False  # the choice also holds for subtrees pinned by apply_recipe(overrides=...)

    @property
    def active_recipe(self) -> Recipe | None:
        """The recipe that quantizes, or None for high precision."""
        return self.recipe if self.enabled else None


_OFF = AutocastState()
# The states in force, innermost last (read by the fusers' hot path as STATE_STACK[-1]).
STATE_STACK: list[AutocastState] = [_OFF]


def current_state() -> AutocastState:
    """The autocast state in force now (the only reader of the ambient context)."""
    return STATE_STACK[-1]


def _refuse_tracing() -> None:
    if _is_compiling():
        raise RuntimeError(
            "te.autocast inside a function that torch.compile traces: the compiled graph would not see it; "
            "enter te.autocast around the compiled call instead (a recipe change then needs no recompile)")


class autocast(contextlib.ContextDecorator):  # noqa: N801 (used like a function, as torch.autocast)
    """Enter a te_fuser autocast region (see the module doc); yields its :class:`AutocastState`.

    A class rather than a generator: entering and leaving costs about a
    microsecond, which matters when it wraps every step of a small model. A new
    recipe object equal to the last one (same string) reuses the last state, so
    its ``recipe`` is that earlier, equal object. An instance may be entered
    again, also while it is active."""

    __slots__ = ("state", "backend", "_depths")

    _last: AutocastState = _OFF  # the last state built: reused for equal arguments (same recipe object)

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe | None = None,
        calibrating: bool = False,
        amax_reduction_group: Any = None,
        backend: str | None = None,
        override_pinned: bool = False,
    ) -> None:
        _refuse_tracing()
        if enabled is not True and enabled is not False:
            raise TypeError(f"autocast(enabled=...): must be True or False, got {enabled!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"autocast(recipe=...): must be a te_fuser.recipe recipe or None, got {type(recipe).__name__}")
        if calibrating is not True and calibrating is not False:
            raise TypeError(f"autocast(calibrating=...): must be True or False, got {calibrating!r}")
        if backend is not None:
            _backend.check_name(backend)
        if override_pinned is not True and override_pinned is not False:
            raise TypeError(f"autocast(override_pinned=...): must be True or False, got {override_pinned!r}")
        named = recipe is not None or not enabled
        if enabled or calibrating:
            recipe = recipe if recipe is not None else DEFAULT_RECIPE
        else:
            recipe = None
        last = autocast._last
        if (
            last.enabled is enabled and last.calibrating is calibrating and last.named is named
            and last.override_pinned is override_pinned and last.amax_reduction_group is amax_reduction_group
            and (last.recipe is recipe or (recipe is not None and last.recipe is not None
                                           and type(last.recipe) is type(recipe) and last.recipe.key == recipe.key))
        ):
            self.state = last  # an equal recipe is the same configuration: its string is the key
        else:
            self.state = autocast._last = AutocastState(enabled, recipe, calibrating, amax_reduction_group, named,
                                                        override_pinned)
        self.backend = backend
        self._depths: list[int] = []

    def __enter__(self) -> AutocastState:
        _refuse_tracing()
        self._depths.append(len(STATE_STACK))
        STATE_STACK.append(self.state)
        if self.backend is not None:
            _backend.push_override(self.backend)
        return self.state

    def __exit__(self, *exc) -> None:
        if _PENDING.entries:  # the region's delayed-scaling amaxes, reduced together
            _flush_amax_reductions()
        depth = self._depths.pop()
        if self.backend is not None:
            _backend.pop_override()
        del STATE_STACK[depth:]
