"""Fused operations and the default table of fusion rules."""

from __future__ import annotations

from ..basic.activation import Activation
from ..basic.bias import Bias
from ..basic.extra import AddExtraInput, MakeExtraOutput
from ..basic.linear import BasicLinear
from ..rules import FusionRule, register_fusion_rule
from .backward_activation_bias import BackwardActivationBias
from .backward_linear_add import BackwardLinearAdd
from .backward_linear_bias_activation import BackwardLinearBiasActivation
from .forward_linear_bias_activation import ForwardLinearBiasActivation
from .forward_linear_bias_add import ForwardLinearBiasAdd

__all__ = [
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "BackwardActivationBias",
    "BackwardLinearBiasActivation",
    "BackwardLinearAdd",
    "DEFAULT_RULES",
]


def _needs_grad_output_quantizer(ops, recipe):
    if recipe is None:
        return "no FP8 recipe: there is no grad_output quantizer to cast the gradient for"
    if recipe.backward_override is not None:
        return f"backward_override={recipe.backward_override!r}: the backward GEMMs run in high precision"
    return None


DEFAULT_RULES = (
    FusionRule("forward_linear_bias_activation", "forward", ((BasicLinear,), (Bias,), (Activation,)),
               ForwardLinearBiasActivation),
    FusionRule("forward_linear_bias_add", "forward", ((BasicLinear,), (Bias,), (AddExtraInput,)), ForwardLinearBiasAdd),
    FusionRule("forward_linear_bias", "forward", ((BasicLinear,), (Bias,)), ForwardLinearBiasActivation),
    FusionRule("backward_linear_bias_activation", "backward", ((BasicLinear,), (Bias,), (Activation,)),
               BackwardLinearBiasActivation, _needs_grad_output_quantizer),
    FusionRule("backward_activation_bias", "backward", ((Bias,), (Activation,)), BackwardActivationBias),
    FusionRule("backward_linear_add", "backward", ((MakeExtraOutput,), (BasicLinear,)), BackwardLinearAdd),
)

for _rule in DEFAULT_RULES:
    register_fusion_rule(_rule)
