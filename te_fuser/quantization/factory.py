"""``quantizer_for(recipe, role)``: the quantizer a recipe prescribes for one role."""

from __future__ import annotations

from ..recipe import Recipe
from .base import Quantizer
from .identity import IdentityQuantizer
from .role import TENSOR_TYPES, QuantizerRole

__all__ = ["quantizer_for"]


def quantizer_for(recipe: Recipe | None, role: QuantizerRole) -> Quantizer:
    """A fresh quantizer for ``role`` under ``recipe`` (``None``: high precision):
    the recipe builds it (``Recipe.make_quantizer``; forward roles get the format's
    forward dtype, gradients its backward one) for the roles it casts to FP8
    (``Recipe.quantizes``: attention's only under ``fp8_dpa`` or ``fp8_mha``), an
    ``IdentityQuantizer`` for the others. The returned quantizer has ``.role`` set
    to ``role``.
    """
    if not isinstance(role, QuantizerRole):
        raise TypeError(f"quantizer_for: role must be a QuantizerRole, got {type(role).__name__}")
    if role.tensor_type not in TENSOR_TYPES:
        raise ValueError(f"quantizer_for: role {role} has unknown tensor_type {role.tensor_type!r}")
    if recipe is None:
        quantizer: Quantizer = IdentityQuantizer()
    elif isinstance(recipe, Recipe):
        quantizer = recipe.make_quantizer(role) if recipe.quantizes(role) else IdentityQuantizer()
    else:
        raise TypeError(f"quantizer_for: recipe must be a te_fuser Recipe or None, got {type(recipe).__name__}")
    quantizer.role = role
    return quantizer
