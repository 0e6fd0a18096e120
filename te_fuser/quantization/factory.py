"""``quantizer_for(recipe, role)``: the quantizer a recipe prescribes for one role."""

from __future__ import annotations

from ..recipe import Recipe
from .base import Quantizer
from .identity import IdentityQuantizer
from .role import TENSOR_TYPES, QuantizerRole

__all__ = ["quantizer_for"]


def quantizer_for(recipe: Recipe | None, role: QuantizerRole, *, borrow_state: bool = False) -> Quantizer:
    """A fresh quantizer for ``role`` under ``recipe`` (``None``: high precision):
    the recipe builds it (``Recipe.make_quantizer``; forward roles get the format's
    forward dtype, gradients its backward one) for the roles it casts to FP8
    (``Recipe.quantizes``: attention's only under ``fp8_dpa`` or ``fp8_mha``), an
    ``IdentityQuantizer`` for the others. The returned quantizer has ``.role`` set
    to ``role``. ``borrow_state``: a copy of a kept prototype may hold the
    prototype's fresh state tensors until ``delayed.place_states`` places it
    (which every caller passing True must call on it before any other use).
    """
    if not isinstance(role, QuantizerRole):
        raise TypeError(f"quantizer_for: role must be a QuantizerRole, got {type(role).__name__}")
    if role.tensor_type not in TENSOR_TYPES:
        raise ValueError(f"quantizer_for: role {role} has unknown tensor_type {role.tensor_type!r}")
    if recipe is None:
        quantizer: Quantizer = IdentityQuantizer()
    elif isinstance(recipe, Recipe):
        quantizer = _made(recipe, role, borrow_state) if recipe.quantizes(role) else IdentityQuantizer()
    else:
        raise TypeError(f"quantizer_for: recipe must be a te_fuser Recipe or None, got {type(recipe).__name__}")
    quantizer.role = role
    return quantizer


# (recipe class, recipe key, module type, tensor type) -> a quantizer the recipe
# made, never used: what a built-in recipe without callables makes depends on these
# alone, so a switch's fresh quantizers are copies of it (``Quantizer.fresh_copy``),
# without the constructors' checks. Only such recipes store one, and a recipe's key
# names its callables, so a key found here is a plain built-in recipe's. Bounded:
# recipe keys are any values of their fields.
_PROTOTYPES: dict = {}
_MAX_PROTOTYPES = 256


def _made(recipe: Recipe, role: QuantizerRole, borrow_state: bool = False) -> Quantizer:
    """``recipe.make_quantizer(role)``, or a fresh copy of what it made for this key
    and role before, for the built-in recipes whose fields hold no callable (a
    ``CustomRecipe``'s qfactory, a delayed-scaling algorithm: those run as given)."""
    key = (type(recipe), recipe.key, role.module_type, role.tensor_type)
    prototype = _PROTOTYPES.get(key)
    if prototype is None:
        if type(recipe).__module__ != Recipe.__module__ or any(
                callable(getattr(recipe, name)) for name in recipe._callable_fields):
            return recipe.make_quantizer(role)
        prototype = recipe.make_quantizer(role)
        if len(_PROTOTYPES) >= _MAX_PROTOTYPES:
            _PROTOTYPES.clear()
        _PROTOTYPES[key] = prototype
    quantizer = prototype.fresh_copy(borrow_state)
    if "recipe" in quantizer.__dict__:
        quantizer.recipe = recipe  # one that keeps its recipe keeps the one asked
    return quantizer
