"""Initialising a model made on the meta device: each module's parameters drawn
once, in the order its construction drew them.

Every op with parameters draws them in ``reset_parameters()``, which its
construction calls; a composite (``Linear``) resets its basic ops in its own.
A loop over ``model.modules()`` calling each ``reset_parameters`` is right in
distribution but draws a ``Linear``'s weight twice (the composite's reset, then its
``BasicLinear``'s); :func:`reset_parameters` resets each module once, so under a
seed a model made on the meta device and moved to storage with ``to_empty`` holds
what one built directly under that seed holds (torch's own modules alike).
"""

from __future__ import annotations

from torch import nn

__all__ = ["reset_parameters"]


def reset_parameters(module: nn.Module) -> nn.Module:
    """Draw ``module``'s parameters again in its construction's order: a module
    with ``reset_parameters`` resets itself and what it holds, any other resets
    its children in turn. Returns ``module``."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return module
    for child in module.children():
        reset_parameters(child)
    return module
