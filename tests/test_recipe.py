"""The recipe string contract: exhaustive, canonical, deterministic, immutable."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
import textwrap

import expecttest
import pytest

from te_fuser import recipe as R
from te_fuser.quantization.role import QuantizerRole


def amax_p99(history):  # module-level: keyed by module:qualname
    return history.max()


def scale_halved(amax, scale, fmax, recipe):
    return scale / 2


def identity_factory(role):
    from te_fuser.quantization import IdentityQuantizer

    return IdentityQuantizer()


# For every recipe: each field and a valid value different from the default.
ALTERNATIVES = {
    R.DelayedScaling: {
        "margin": 2,
        "fprop_fast_accum": False,
        "dgrad_fast_accum": True,
        "wgrad_fast_accum": True,
        "fp8_format": R.Format.E4M3,
        "amax_history_len": 16,
        "amax_compute_algo": "most_recent",
        "scaling_factor_compute_algo": scale_halved,
        "reduce_amax": False,
        "backward_override": "high_precision",
        "fp8_dpa": True,
        "fp8_mha": True,
    },
    R.Float8CurrentScaling: {
        "fp8_format": R.Format.E4M3,
        "fprop_fast_accum": False,
        "dgrad_fast_accum": True,
        "wgrad_fast_accum": True,
        "power_2_scales": True,
        "input_amax_epsilon": 1e-12,
        "weight_amax_epsilon": 1e-12,
        "grad_amax_epsilon": 1e-12,
        "backward_override": "dequantized",
        "fp8_dpa": True,
        "fp8_mha": True,
    },
    R.Float8RowwiseScaling: {
        "fp8_format": R.Format.E4M3,
        "fprop_fast_accum": False,
        "dgrad_fast_accum": True,
        "wgrad_fast_accum": True,
        "power_2_scales": False,
        "input_amax_epsilon": 1e-12,
        "weight_amax_epsilon": 1e-12,
        "grad_amax_epsilon": 1e-12,
        "backward_override": "dequantized",
        "fp8_dpa": True,
        "fp8_mha": True,
    },
    R.MXFP8BlockScaling: {"fp8_format": R.Format.HYBRID, "backward_override": "high_precision", "fp8_dpa": True,
                          "fp8_mha": True},
    R.Float8BlockScaling: {
        "fp8_format": R.Format.HYBRID,
        "x_block_scaling_dim": 2,
        "w_block_scaling_dim": 1,
        "grad_block_scaling_dim": 2,
        "power_2_scales": False,
        "input_amax_epsilon": 1e-9,
        "weight_amax_epsilon": 1e-9,
        "grad_amax_epsilon": 1e-9,
        "backward_override": "dequantized",
        "fp8_dpa": True,
        "fp8_mha": True,
    },
    R.CustomRecipe: {"qfactory": amax_p99, "backward_override": "high_precision", "fp8_dpa": True, "fp8_mha": True},
}
# *_key fields only apply to callables: tested from a recipe holding one.
KEY_FIELDS = {
    R.DelayedScaling: {
        "amax_compute_algo_key": dict(amax_compute_algo=amax_p99),
        "scaling_factor_compute_algo_key": dict(scaling_factor_compute_algo=scale_halved),
    },
    R.CustomRecipe: {"qfactory_key": dict()},
}


def base(cls, **kw):
    if cls is R.CustomRecipe:
        kw.setdefault("qfactory", identity_factory)
    if cls is R.Float8BlockScaling and kw.get("x_block_scaling_dim") == 2:
        kw.setdefault("w_block_scaling_dim", 1)
    if cls is R.Float8BlockScaling and kw.get("grad_block_scaling_dim") == 2:
        kw.setdefault("w_block_scaling_dim", 1)
    return cls(**kw)


@pytest.mark.parametrize("cls", list(ALTERNATIVES), ids=lambda c: c.__name__)
def test_every_field_changes_the_string(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    covered = set(ALTERNATIVES[cls]) | set(KEY_FIELDS.get(cls, {}))
    assert covered == names, f"{cls.__name__}: fields without a string test: {sorted(names - covered)}"
    default = base(cls)
    for name, value in ALTERNATIVES[cls].items():
        changed = base(cls, **{name: value})
        assert str(changed) != str(default), f"{cls.__name__}.{name}={value!r} did not change the string"
    for name, extra in KEY_FIELDS.get(cls, {}).items():
        unkeyed = base(cls, **extra)
        keyed = base(cls, **extra, **{name: "my-key"})
        assert str(unkeyed) != str(keyed), f"{cls.__name__}.{name} did not change the string"
        assert "key:my-key" in str(keyed)


@pytest.mark.parametrize("cls", list(ALTERNATIVES), ids=lambda c: c.__name__)
def test_derived_values_appear_and_follow_the_fields(cls):
    r = base(cls)
    for name in r.derived():
        assert f", {name}=" in str(r), f"{cls.__name__}: derived {name} missing from {r}"
    if "fp8_format" in ALTERNATIVES[cls]:
        other = base(cls, fp8_format=ALTERNATIVES[cls]["fp8_format"])
        assert r.derived() != other.derived()


@pytest.mark.parametrize("cls", list(ALTERNATIVES), ids=lambda c: c.__name__)
def test_equal_configurations_give_identical_strings(cls):
    a, b = base(cls), base(cls)
    assert a is not b and str(a) == str(b) and a == b and hash(a) == hash(b)
    assert str(copy.deepcopy(a)) == str(a) and copy.copy(a) == a
    assert str(pickle.loads(pickle.dumps(a))) == str(a)
    assert a.replace() == a


def test_strings_are_identical_in_another_process():
    code = textwrap.dedent(
        """
        import pickle, sys
        from te_fuser import recipe as R
        rs = [R.DelayedScaling(margin=1, amax_history_len=7), R.Float8CurrentScaling(input_amax_epsilon=1e-6),
              R.MXFP8BlockScaling(), R.Float8BlockScaling(power_2_scales=False), R.DelayedScaling()]
        sys.stdout.write(repr([str(r) for r in rs]))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    here = [
        R.DelayedScaling(margin=1, amax_history_len=7),
        R.Float8CurrentScaling(input_amax_epsilon=1e-6),
        R.MXFP8BlockScaling(),
        R.Float8BlockScaling(power_2_scales=False),
        R.DelayedScaling(),
    ]
    assert out == repr([str(r) for r in here])


def test_floats_are_canonical():
    zero = R.Float8CurrentScaling(input_amax_epsilon=0.0)
    assert str(R.Float8CurrentScaling(input_amax_epsilon=-0.0)) == str(zero)
    assert str(R.Float8CurrentScaling(input_amax_epsilon=0)) == str(zero)
    assert str(R.Float8CurrentScaling(input_amax_epsilon=1e-6)) == str(R.Float8CurrentScaling(input_amax_epsilon=1.0e-6))
    assert str(R.DelayedScaling(fp8_format="hybrid")) == str(R.DelayedScaling(fp8_format=R.Format.HYBRID))


def test_environment_default_is_resolved_at_construction(monkeypatch):
    monkeypatch.setenv("TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    fp32 = R.Float8BlockScaling()
    monkeypatch.setenv("TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    pow2 = R.Float8BlockScaling()
    assert fp32.power_2_scales is False and pow2.power_2_scales is True
    assert "power_2_scales=False" in str(fp32) and str(fp32) != str(pow2)
    assert fp32.replace().power_2_scales is False  # the resolved value travels with the recipe
    monkeypatch.setenv("TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES", "maybe")
    with pytest.raises(ValueError, match="TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES"):
        R.Float8BlockScaling()


class TestDefaultStrings(expecttest.TestCase):
    def test_default_recipe_strings(self):
        self.assertExpectedInline(
            "\n".join(str(cls()) for cls in (R.DelayedScaling, R.Float8CurrentScaling, R.MXFP8BlockScaling)),
            """\
te_fuser.recipe.DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=1024, amax_compute_algo='max', scaling_factor_compute_algo=None, reduce_amax=True, fprop_fast_accum=True, dgrad_fast_accum=False, wgrad_fast_accum=False, backward_override=None, fp8_dpa=False, fp8_mha=False, fwd_dtype=e4m3, bwd_dtype=e5m2, fwd_max=448.0, bwd_max=57344.0, scaling='tensor')
te_fuser.recipe.Float8CurrentScaling(fp8_format=HYBRID, power_2_scales=False, input_amax_epsilon=0.0, weight_amax_epsilon=0.0, grad_amax_epsilon=0.0, fprop_fast_accum=True, dgrad_fast_accum=False, wgrad_fast_accum=False, backward_override=None, fp8_dpa=False, fp8_mha=False, fwd_dtype=e4m3, bwd_dtype=e5m2, fwd_max=448.0, bwd_max=57344.0, scaling='tensor')
te_fuser.recipe.MXFP8BlockScaling(fp8_format=E4M3, backward_override=None, fp8_dpa=False, fp8_mha=False, fwd_dtype=e4m3, bwd_dtype=e4m3, fwd_max=448.0, bwd_max=448.0, scaling='mx', block=32, scale_dtype='e8m0')""",
        )
        self.assertExpectedInline(str(R.Float8BlockScaling(power_2_scales=True)), """te_fuser.recipe.Float8BlockScaling(fp8_format=E4M3, x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1, power_2_scales=True, input_amax_epsilon=0.0, weight_amax_epsilon=0.0, grad_amax_epsilon=0.0, backward_override=None, fp8_dpa=False, fp8_mha=False, fwd_dtype=e4m3, bwd_dtype=e4m3, fwd_max=448.0, bwd_max=448.0, scaling='block', tile=128)""")
        self.assertExpectedInline(str(R.CustomRecipe(identity_factory)), """te_fuser.recipe.CustomRecipe(qfactory=test_recipe:identity_factory, backward_override=None, fp8_dpa=False, fp8_mha=False)""")


@pytest.mark.parametrize("cls", list(ALTERNATIVES), ids=lambda c: c.__name__)
def test_recipes_are_immutable(cls):
    r = base(cls)
    before = str(r)
    with pytest.raises(TypeError, match=r"replace\(backward_override=\.\.\.\)"):
        r.backward_override = "high_precision"
    with pytest.raises(TypeError, match="replace"):
        del r.backward_override
    with pytest.raises(TypeError, match="unknown field"):
        r.replace(no_such_field=1)
    assert str(r) == before and r.backward_override is None
    assert r.replace(backward_override="high_precision").backward_override == "high_precision"


BAD_VALUES = [
    (R.DelayedScaling, "margin", -1),
    (R.DelayedScaling, "margin", 1.5),
    (R.DelayedScaling, "margin", True),
    (R.DelayedScaling, "fp8_format", "E3M4"),
    (R.DelayedScaling, "fp8_format", R.Format.E5M2),
    (R.DelayedScaling, "fp8_format", 3),
    (R.DelayedScaling, "amax_history_len", 0),
    (R.DelayedScaling, "amax_compute_algo", "mean"),
    (R.DelayedScaling, "amax_compute_algo_key", "k"),  # key without a callable
    (R.DelayedScaling, "scaling_factor_compute_algo", "fast"),
    (R.DelayedScaling, "reduce_amax", 1),
    (R.DelayedScaling, "backward_override", "fp32"),
    (R.Float8CurrentScaling, "power_2_scales", "yes"),
    (R.Float8CurrentScaling, "input_amax_epsilon", -1e-3),
    (R.Float8CurrentScaling, "weight_amax_epsilon", float("nan")),
    (R.Float8CurrentScaling, "grad_amax_epsilon", float("inf")),
    (R.Float8CurrentScaling, "fprop_fast_accum", 1),
    (R.DelayedScaling, "wgrad_fast_accum", None),
    (R.Float8RowwiseScaling, "power_2_scales", "no"),
    (R.Float8RowwiseScaling, "grad_amax_epsilon", -1.0),
    (R.Float8RowwiseScaling, "dgrad_fast_accum", "fast"),
    (R.MXFP8BlockScaling, "fp8_format", R.Format.E5M2),
    (R.MXFP8BlockScaling, "backward_override", "bf16"),
    (R.Float8BlockScaling, "x_block_scaling_dim", 3),
    (R.Float8BlockScaling, "w_block_scaling_dim", 0),
    (R.Float8BlockScaling, "grad_block_scaling_dim", True),
    (R.Float8BlockScaling, "power_2_scales", 0),
    (R.Float8BlockScaling, "input_amax_epsilon", "0"),
    (R.CustomRecipe, "qfactory", None),
    (R.CustomRecipe, "qfactory_key", ""),
    (R.DelayedScaling, "fp8_dpa", 1),
    (R.Float8CurrentScaling, "fp8_mha", "yes"),
    (R.MXFP8BlockScaling, "fp8_dpa", None),
    (R.CustomRecipe, "fp8_mha", 0),
]


@pytest.mark.parametrize("cls,name,value", BAD_VALUES, ids=lambda v: repr(v)[:24])
def test_bad_values_name_their_field(cls, name, value):
    kw = {name: value}
    if cls is R.CustomRecipe and name != "qfactory":
        kw["qfactory"] = identity_factory
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name}:"):
        cls(**kw)


@pytest.mark.parametrize(
    "dims,field",
    [((2, 2, 1), "w_block_scaling_dim"), ((2, 1, 2), "grad_block_scaling_dim"), ((1, 2, 2), "grad_block_scaling_dim")],
)
def test_2d_by_2d_block_gemms_are_rejected(dims, field):
    x, w, g = dims
    with pytest.raises(ValueError, match=rf"Float8BlockScaling\.{field}:.*2D by 2D"):
        R.Float8BlockScaling(x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=g)


def test_format_dtypes():
    import torch

    assert R.Format.HYBRID.fwd_dtype == torch.float8_e4m3fn and R.Format.HYBRID.bwd_dtype == torch.float8_e5m2
    assert R.Format.E4M3.bwd_dtype == torch.float8_e4m3fn


def test_role_validation():
    assert str(QuantizerRole.make("linear", "weight", "fc1")) == "linear:fc1.weight"
    with pytest.raises(ValueError, match="tensor_type"):
        QuantizerRole.make("linear", "bias")


def test_fast_accumulation_defaults_per_gemm():
    for recipe in (R.DelayedScaling(), R.Float8CurrentScaling()):
        assert [recipe.fast_accum(g) for g in R.FAST_ACCUM_GEMMS] == [True, False, False]
    # recipes without the fields never accumulate fast
    for recipe in (R.MXFP8BlockScaling(), R.Float8BlockScaling(), R.CustomRecipe(qfactory=identity_factory)):
        assert not any(recipe.fast_accum(g) for g in R.FAST_ACCUM_GEMMS)
    assert R.Float8CurrentScaling(wgrad_fast_accum=True).fast_accum("wgrad")
