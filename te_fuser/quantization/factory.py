"""``quantizer_for(recipe, role)``: the quantizer a recipe prescribes for one role."""

from __future__ import annotations

from ..recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
)
from .base import Quantizer
from .block import Float8BlockQuantizer
from .current import Float8CurrentScalingQuantizer
from .delayed import DelayedScalingQuantizer
from .identity import IdentityQuantizer
from .mxfp8 import MXFP8Quantizer
from .role import QuantizerRole

__all__ = ["quantizer_for"]

# tensor role -> the prefix of the recipe fields that configure it
_EPSILON_FIELD = {
    "input": "input_amax_epsilon",
    "output": "input_amax_epsilon",
    "weight": "weight_amax_epsilon",
    "grad_output": "grad_amax_epsilon",
    "grad_input": "grad_amax_epsilon",
}
_BLOCK_DIM_FIELD = {
    "input": "x_block_scaling_dim",
    "output": "x_block_scaling_dim",
    "weight": "w_block_scaling_dim",
    "grad_output": "grad_block_scaling_dim",
    "grad_input": "grad_block_scaling_dim",
}


def quantizer_for(recipe: Recipe | None, role: QuantizerRole) -> Quantizer:
    """A fresh quantizer for ``role`` under ``recipe`` (``None``: high precision).

    Forward roles (input, weight, output) use the format's forward dtype, backward
    roles (grad_output, grad_input) its backward dtype. The returned quantizer has
    ``.role`` set to ``role``.
    """
    if not isinstance(role, QuantizerRole):
        raise TypeError(f"quantizer_for: role must be a QuantizerRole, got {type(role).__name__}")
    if role.tensor_type not in _EPSILON_FIELD:
        raise ValueError(f"quantizer_for: role {role} has unknown tensor_type {role.tensor_type!r}")
    if recipe is None:
        quantizer: Quantizer = IdentityQuantizer()
    elif isinstance(recipe, CustomRecipe):
        quantizer = _from_qfactory(recipe, role)
    elif isinstance(recipe, Recipe) and hasattr(recipe, "fp8_format"):
        quantizer = _from_fp8_recipe(recipe, role)
    else:
        raise TypeError(f"quantizer_for: recipe must be a te_fuser Recipe or None, got {type(recipe).__name__}")
    quantizer.role = role
    return quantizer


def _from_fp8_recipe(recipe: Recipe, role: QuantizerRole) -> Quantizer:
    fmt = recipe.fp8_format
    fp8_dtype = fmt.bwd_dtype if role.is_backward else fmt.fwd_dtype
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingQuantizer(
            fp8_dtype,
            margin=recipe.margin,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
            scaling_factor_compute_algo=recipe.scaling_factor_compute_algo,
            recipe=recipe,
        )
    if isinstance(recipe, Float8CurrentScaling):
        epsilon = getattr(recipe, _EPSILON_FIELD[role.tensor_type])
        return Float8CurrentScalingQuantizer(fp8_dtype, recipe.power_2_scales, epsilon)
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(fp8_dtype)
    if isinstance(recipe, Float8BlockScaling):
        block_dim = getattr(recipe, _BLOCK_DIM_FIELD[role.tensor_type])
        epsilon = getattr(recipe, _EPSILON_FIELD[role.tensor_type])
        return Float8BlockQuantizer(fp8_dtype, block_dim, recipe.power_2_scales, epsilon)
    raise TypeError(f"quantizer_for: no quantizer for recipe type {type(recipe).__name__} (role {role})")


def _from_qfactory(recipe: CustomRecipe, role: QuantizerRole) -> Quantizer:
    try:
        quantizer = recipe.qfactory(role)
    except Exception as err:
        raise RuntimeError(
            f"CustomRecipe.qfactory raised {type(err).__name__} for role {role}: {err}"
        ) from err
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"CustomRecipe.qfactory must return a te_fuser Quantizer for role {role}, "
            f"got {type(quantizer).__name__}: {quantizer!r:.80}"
        )
    return quantizer
