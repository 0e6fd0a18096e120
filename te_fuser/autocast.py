"""``te.autocast``: the one ambient context of te_fuser, read in one place.

    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = model(x)

Nestable: the inner context wins and the outer state comes back on exit, also on
an exception. ``enabled=False`` runs high precision. With ``recipe=None`` the
default recipe is :data:`DEFAULT_RECIPE` (delayed scaling, HYBRID format, the
TransformerEngine default). ``calibrating=True`` records amaxes for delayed
scaling while computing in high precision. ``backend=`` overrides the kernel
backend inside the region. It composes with ``torch.autocast`` in either nesting
order: ops compute in the torch-autocast dtype when one is active.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from . import backend as _backend
from .recipe import DelayedScaling, Recipe

__all__ = ["autocast", "AutocastState", "current_state", "DEFAULT_RECIPE"]

DEFAULT_RECIPE = DelayedScaling()


@dataclass(frozen=True)
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None
    calibrating: bool = False
    amax_reduction_group: Any = None

    @property
    def active_recipe(self) -> Recipe | None:
        """The recipe that quantizes, or None for high precision."""
        return self.recipe if self.enabled else None


_OFF = AutocastState()
_stack: list[AutocastState] = [_OFF]


def current_state() -> AutocastState:
    """The autocast state in force now (the only reader of the ambient context)."""
    return _stack[-1]


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    calibrating: bool = False,
    amax_reduction_group: Any = None,
    backend: str | None = None,
) -> Iterator[AutocastState]:
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...): must be True or False, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast(recipe=...): must be a te_fuser.recipe recipe or None, got {type(recipe).__name__}")
    if not isinstance(calibrating, bool):
        raise TypeError(f"autocast(calibrating=...): must be True or False, got {calibrating!r}")
    if enabled or calibrating:
        recipe = recipe if recipe is not None else DEFAULT_RECIPE
    state = AutocastState(enabled, recipe if (enabled or calibrating) else None, calibrating, amax_reduction_group)
    depth = len(_stack)
    _stack.append(state)
    try:
        with _backend.use_backend(backend):
            yield state
    finally:
        del _stack[depth:]
