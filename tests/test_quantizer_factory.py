"""quantizer_for: every recipe x every role gives the right quantizer and parameters."""

from __future__ import annotations

import pytest
import torch

from te_fuser.quantization import (
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    QuantizerRole,
    quantizer_for,
)
from te_fuser.quantization.role import BACKWARD_TENSOR_TYPES, TENSOR_TYPES
from te_fuser.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROLES = [QuantizerRole("linear", tensor_type, "fc1") for tensor_type in TENSOR_TYPES]
EPSILON_OF = {"input": 1e-3, "output": 1e-3, "weight": 2e-3, "grad_output": 3e-3, "grad_input": 3e-3,
              "qkv": 1e-3, "s": 1e-3, "o": 1e-3, "do": 3e-3}  # attention's tensors: activations and a gradient


def expected_dtype(fmt: Format, role: QuantizerRole) -> torch.dtype:
    if fmt is Format.E4M3:
        return E4M3
    return E5M2 if role.tensor_type in BACKWARD_TENSOR_TYPES else E4M3  # HYBRID


def double_scale(amax, scale, fmax, recipe):
    return scale * 2


@pytest.mark.parametrize("role", ROLES, ids=str)
def test_no_recipe_gives_identity(role):
    quantizer = quantizer_for(None, role)
    assert type(quantizer) is IdentityQuantizer and quantizer.role == role
    assert quantizer.fp8_dtype is None and quantizer.min_compute_capability is None
    assert quantizer.scaling == "identity"


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=str)
@pytest.mark.parametrize("role", ROLES, ids=str)
def test_delayed_scaling(role, fmt):
    recipe = DelayedScaling(
        margin=2, fp8_format=fmt, amax_history_len=16, amax_compute_algo="most_recent",
        scaling_factor_compute_algo=double_scale,
    )
    quantizer = quantizer_for(recipe, role)
    assert type(quantizer) is DelayedScalingQuantizer and quantizer.role == role
    assert quantizer.fp8_dtype is expected_dtype(fmt, role)
    assert (quantizer.margin, quantizer.amax_history_len, quantizer.amax_compute_algo) == (2, 16, "most_recent")
    assert quantizer.scaling_factor_compute_algo is double_scale and quantizer.recipe is recipe
    assert tuple(quantizer.amax_history.shape) == (16,) and not quantizer.seeded
    assert quantizer.scaling == "tensor" and quantizer.min_compute_capability == (8, 9)


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=str)
@pytest.mark.parametrize("role", ROLES, ids=str)
def test_current_scaling_epsilon_by_role(role, fmt):
    recipe = Float8CurrentScaling(
        fp8_format=fmt, power_2_scales=True, input_amax_epsilon=1e-3, weight_amax_epsilon=2e-3,
        grad_amax_epsilon=3e-3,
    )
    quantizer = quantizer_for(recipe, role)
    assert type(quantizer) is Float8CurrentScalingQuantizer and quantizer.role == role
    assert quantizer.fp8_dtype is expected_dtype(fmt, role)
    assert quantizer.power_2_scales is True and quantizer.amax_epsilon == EPSILON_OF[role.tensor_type]


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=str)
@pytest.mark.parametrize("role", ROLES, ids=str)
def test_mxfp8(role, fmt):
    quantizer = quantizer_for(MXFP8BlockScaling(fp8_format=fmt), role)
    assert type(quantizer) is MXFP8Quantizer and quantizer.role == role
    assert quantizer.fp8_dtype is expected_dtype(fmt, role) and quantizer.scaling == "mx_32"


@pytest.mark.parametrize(
    "dims", [(1, 2, 1), (2, 1, 1), (1, 1, 2), (1, 1, 1)], ids=lambda d: "x{}-w{}-grad{}".format(*d)
)
@pytest.mark.parametrize("role", ROLES, ids=str)
def test_block_scaling_dims_by_role(role, dims):
    x_dim, w_dim, grad_dim = dims
    recipe = Float8BlockScaling(
        fp8_format=Format.HYBRID, x_block_scaling_dim=x_dim, w_block_scaling_dim=w_dim,
        grad_block_scaling_dim=grad_dim, power_2_scales=False, input_amax_epsilon=1e-3,
        weight_amax_epsilon=2e-3, grad_amax_epsilon=3e-3,
    )
    quantizer = quantizer_for(recipe, role)
    assert type(quantizer) is Float8BlockQuantizer and quantizer.role == role
    dim_of = {"input": x_dim, "output": x_dim, "weight": w_dim, "grad_output": grad_dim, "grad_input": grad_dim,
              "qkv": x_dim, "s": x_dim, "o": x_dim, "do": grad_dim}
    assert quantizer.block_dim == dim_of[role.tensor_type]
    assert quantizer.scaling == ("block_1x128" if quantizer.block_dim == 1 else "block_128x128")
    assert quantizer.fp8_dtype is expected_dtype(Format.HYBRID, role)
    assert quantizer.power_2_scales is False and quantizer.amax_epsilon == EPSILON_OF[role.tensor_type]


def test_block_scaling_default_power_2():
    quantizer = quantizer_for(Float8BlockScaling(power_2_scales=True), ROLES[0])
    assert quantizer.power_2_scales is True and quantizer.fp8_dtype is E4M3


def test_each_call_builds_a_fresh_quantizer():
    recipe = DelayedScaling(amax_history_len=4)
    a, b = quantizer_for(recipe, ROLES[0]), quantizer_for(recipe, ROLES[0])
    assert a is not b and a.amax_history is not b.amax_history


BUILT_IN = [DelayedScaling(amax_history_len=8, margin=1), Float8CurrentScaling(input_amax_epsilon=1e-3),
            Float8BlockScaling(), MXFP8BlockScaling(), Float8CurrentScaling(fp8_format=Format.E4M3)]


def _configuration(q) -> dict:
    """A quantizer's attributes, tensors by value."""
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in vars(q).items()
            if k not in ("_fresh", "_kept_casters")}


@pytest.mark.parametrize("recipe", BUILT_IN, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("role", ROLES + [QuantizerRole("dpa", "s", "attn")], ids=str)
def test_a_built_in_recipes_quantizers_are_fresh_copies_as_made(recipe, role):
    """A built-in recipe's fresh quantizers come from one made before for its key and
    role (``Quantizer.fresh_copy``): each as the recipe would make it, with the role
    and recipe asked, its own state, never a used one's."""
    from te_fuser.quantization import factory

    recipe = recipe.replace(fp8_dpa=True)
    first = quantizer_for(recipe, role)
    if isinstance(first, DelayedScalingQuantizer):  # used: its state moves on, the next copy's must not
        first.cast(torch.randn(16, 32))
        first.amax_history  # noqa: B018 (applies the waiting update)
    made = recipe.make_quantizer(role)
    made.role = role
    equal = recipe.replace()  # another object with the same key
    copy = quantizer_for(equal, QuantizerRole(role.module_type, role.tensor_type, "other"))
    assert (type(recipe), recipe.key, role.module_type, role.tensor_type) in factory._PROTOTYPES
    assert copy is not first and type(copy) is type(made) and copy.role.name == "other"
    want = _configuration(made)
    want["role"] = copy.role
    if "recipe" in want:
        want["recipe"] = equal
        assert copy.recipe is equal
    assert _configuration(copy) == want
    for name in copy.STATE_TENSORS:
        assert getattr(copy, name) is not getattr(first, name)


def test_recipes_with_callables_make_each_quantizer():
    """A recipe field holding a callable (a delayed-scaling algorithm) runs as given:
    its quantizers are made by the recipe every time, with the callable asked."""
    def first(history):
        return history.max()

    def second(history):
        return history[0]

    a = quantizer_for(DelayedScaling(amax_compute_algo=first, amax_compute_algo_key="algo"), ROLES[0])
    b = quantizer_for(DelayedScaling(amax_compute_algo=second, amax_compute_algo_key="algo"), ROLES[0])
    assert a.amax_compute_algo is first and b.amax_compute_algo is second


def test_custom_recipe_uses_qfactory_and_sets_role():
    calls = []

    def qfactory(role):
        calls.append(role)
        if role.tensor_type == "weight":
            return Float8CurrentScalingQuantizer(E4M3, power_2_scales=True)
        return IdentityQuantizer()

    recipe = CustomRecipe(qfactory=qfactory)
    quantizers = {role.tensor_type: quantizer_for(recipe, role) for role in ROLES}
    assert calls == ROLES
    assert type(quantizers["weight"]) is Float8CurrentScalingQuantizer
    assert all(type(q) is IdentityQuantizer for t, q in quantizers.items() if t != "weight")
    assert all(q.role == role for q, role in zip(quantizers.values(), ROLES))


@pytest.mark.parametrize("returned", ["e4m3", None, torch.float8_e4m3fn], ids=["str", "None", "dtype"])
def test_custom_recipe_must_return_a_quantizer(returned):
    recipe = CustomRecipe(qfactory=lambda role: returned)
    with pytest.raises(TypeError, match=rf"linear:fc1\.grad_output.*got {type(returned).__name__}"):
        quantizer_for(recipe, QuantizerRole("linear", "grad_output", "fc1"))


def test_custom_recipe_errors_are_wrapped_with_the_role():
    def qfactory(role):
        raise KeyError(f"no rule for {role.tensor_type}")

    with pytest.raises(RuntimeError, match=r"qfactory.*KeyError.*linear:fc1\.weight") as err:
        quantizer_for(CustomRecipe(qfactory=qfactory), QuantizerRole("linear", "weight", "fc1"))
    assert isinstance(err.value.__cause__, KeyError)


def test_bad_arguments():
    with pytest.raises(TypeError, match="role must be a QuantizerRole"):
        quantizer_for(None, "input")
    with pytest.raises(ValueError, match="tensor_type"):
        quantizer_for(None, QuantizerRole("linear", "bias"))
    with pytest.raises(TypeError, match="recipe must be"):
        quantizer_for("delayed", ROLES[0])
