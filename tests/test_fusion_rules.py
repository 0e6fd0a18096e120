"""Every fusion rule: fused equals unfused on the same inputs, outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser.ops import FusionRule, fusion_rules
from te_fuser.ops.fused import DEFAULT_RULES, ForwardLinearBiasLinear
from tolerances import assert_close

H, F = 64, 128  # multiples of 32 (also F / 2) so that MXFP8 applies too
# Rules that hand FP8 from one GEMM to the next: tried under delayed scaling only.
HAND_OFF = {r.name for r in DEFAULT_RULES if r.build is ForwardLinearBiasLinear}


def _hand_off_models(rule_name):
    """``forward_linear_bias[_activation]_linear[_bias[_activation|_add]]``: models of that shape."""
    head_act = rule_name.startswith("forward_linear_bias_activation_linear")
    tail = rule_name[len("forward_linear_bias_activation_linear" if head_act else "forward_linear_bias_linear"):]
    models = []
    for act in ([te.ops.GELU, te.ops.ReLU, te.ops.SiLU, te.ops.SwiGLU] if head_act else [None]):
        width = F // 2 if act is te.ops.SwiGLU else F
        mods = [te.ops.Linear(H, F)] + ([act()] if act else [])
        if tail == "":
            mods.append(te.ops.BasicLinear(width, F))
        else:
            mods.append(te.ops.Linear(width, F))
        if tail == "_bias_activation":
            mods.append(te.ops.SwiGLU() if act is te.ops.GELU else te.ops.GELU())
        if tail == "_bias_add":
            mods.append(te.ops.AddExtraInput())
        models.append((mods, 1 if tail == "_bias_add" else 0))
    return models


def _models(rule_name):
    """Models in which ``rule_name`` fires, with their number of extra inputs."""
    acts = [te.ops.GELU, te.ops.ReLU, te.ops.SiLU, te.ops.SwiGLU]

    def width(act, n):
        return n // 2 if act is te.ops.SwiGLU else n

    if rule_name in ("forward_linear_bias_activation", "backward_linear_bias_activation"):
        return [([te.ops.Linear(H, F), act(), te.ops.Linear(width(act, F), H)], 0) for act in acts]
    if rule_name == "backward_activation_bias":
        return [([te.ops.Bias(H), act(), te.ops.Linear(width(act, H), H)], 0) for act in acts]
    if rule_name == "forward_linear_bias":
        return [([te.ops.Linear(H, F)], 0)]
    if rule_name == "backward_linear_bias":
        return [([te.ops.Linear(H, F)], 0), ([te.ops.Linear(H, F), te.ops.Linear(F, H)], 0)]
    if rule_name == "forward_linear_bias_add":
        return [([te.ops.Linear(H, F), te.ops.AddExtraInput()], 1)]
    if rule_name == "backward_linear_add":
        return [([te.ops.MakeExtraOutput(), te.ops.BasicLinear(H, F)], 0)]
    if rule_name in HAND_OFF:
        return _hand_off_models(rule_name)
    raise KeyError(rule_name)


def test_every_default_rule_has_a_test_model():
    names = {r.name for r in fusion_rules()}
    assert {r.name for r in DEFAULT_RULES} <= names
    for rule in DEFAULT_RULES:
        assert _models(rule.name)


def _representable_params(model, gen):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -3))


def _steps(rule, recipe_name):
    """(calls, with backward): a hand-off needs a seeded delayed-scaling quantizer (a
    fresh one seeds on its first call); an activation before the hand-off, no backward."""
    if rule not in HAND_OFF:
        return 1, True
    return 2, not rule.startswith("forward_linear_bias_activation_linear")


def _forward(model, x, *extras, recipe=None):
    with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x, *extras)
    return (out if isinstance(out, tuple) else (out,)), {}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8", "block"])
@pytest.mark.parametrize("rule", [r.name for r in DEFAULT_RULES])
def test_fused_equals_unfused(rule, recipe_name, dtype, backend):
    recipe = RECIPES[recipe_name]
    if rule in ("backward_linear_bias_activation", "backward_linear_bias") and recipe is None:
        pytest.skip("the rule declines without an FP8 recipe (tested below)")
    if rule in HAND_OFF and recipe_name != "delayed":
        pytest.skip("the FP8 hand-off is a delayed-scaling rule (test_forward_linear_bias_linear.py)")
    if backend == "triton" and (rule not in HAND_OFF or dtype is torch.float32):
        pytest.skip("under the Triton interpreter: the FP8 hand-off rules, in bf16 (slow)")
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("these CPU models take the Triton kernels only under the interpreter, which a GPU machine "
                    "does not run (test_forward_linear_bias_linear.py tests the hand-off on the GPU)")
    calls, backward = _steps(rule, recipe_name)
    models = _models(rule)
    for mods, n_extra in models[:1] if backend == "triton" else models:
        gen = torch.Generator().manual_seed(7)
        fused = te.ops.Sequential(*mods).to(dtype)
        _representable_params(fused, gen)
        unfused = te.ops.Sequential(*copy.deepcopy(list(fused)), fuse=False)
        with te.autocast(enabled=False, backend=backend):
            for _ in range(calls):
                for model in (fused, unfused):
                    model.zero_grad(set_to_none=True)
                x = representable(2, 16, H, generator=gen, dtype=dtype, scale_exp=-3)
                extras = [representable(2, 16, F, generator=gen, dtype=dtype, scale_exp=-3) for _ in range(n_extra)]
                with torch.no_grad():  # on a copy: a high-precision call would reset delayed scaling
                    probe = copy.deepcopy(unfused)(x, *extras)
                probe = probe if isinstance(probe, tuple) else (probe,)
                dy = representable(*probe[0].shape, generator=gen, dtype=dtype)
                dextras = [representable(*p.shape, generator=gen, dtype=dtype) for p in probe[1:]]
                if backward:
                    out_f, g_f = run(fused, x, *extras, recipe=recipe, dy=dy, dextras=dextras)
                    out_u, g_u = run(unfused, x, *extras, recipe=recipe, dy=dy, dextras=dextras)
                else:
                    out_f, g_f = _forward(fused, x, *extras, recipe=recipe)
                    out_u, g_u = _forward(unfused, x, *extras, recipe=recipe)
        assert rule in fused.fusion_plan().rules(), fused.fusion_plan()
        assert not unfused.fusion_plan().rules()
        context = f"rule={rule} recipe={recipe_name} backend={backend} model={[type(m).__name__ for m in mods]}"
        # Where a fused op's output is re-quantized downstream (the second linear's
        # input, the first linear's grad output), a last-bit difference of the
        # skipped rounding can move a value by one FP8 step: compare within that
        # format's tolerance. Elsewhere only the compute dtype's rounding differs.
        linears = sum(isinstance(m, (te.ops.Linear, te.ops.BasicLinear)) for m in mods)
        requantized = recipe is not None and (len(mods) > 2 or linears > 1 or rule in HAND_OFF)
        out_key = recipe.fp8_format.fwd_dtype if requantized else dtype
        grad_key = recipe.fp8_format.bwd_dtype if requantized else dtype
        for a, b in zip(out_f, out_u):
            assert_close(a, b, out_key, f"{context} output", scaled=True)
        assert g_f.keys() == g_u.keys()
        for name in g_u:
            assert (g_f[name] is None) == (g_u[name] is None), name
            if g_u[name] is not None:
                assert_close(g_f[name], g_u[name], grad_key, f"{context} grad {name}", scaled=True)


def test_rules_that_read_the_recipe_decline_with_a_reason():
    model = te.ops.Sequential(te.ops.Linear(H, F), te.ops.GELU())
    run(model, representable(4, H))
    plan = model.fusion_plan()
    assert "declined: backward_linear_bias_activation" in plan and "no FP8 recipe" in plan
    assert "[rule backward_activation_bias]" in plan
    run(model, representable(4, H), recipe=te.recipe.Float8CurrentScaling(backward_override="high_precision"))
    assert "backward_override='high_precision'" in model.fusion_plan()
    run(model, representable(4, H), recipe=te.recipe.Float8CurrentScaling())
    assert "backward_linear_bias_activation" in model.fusion_plan().rules()


def test_user_registered_rule_fires():
    from te_fuser.ops import FusedOperation, FusionRule, register_fusion_rule, unregister_fusion_rule

    class ForwardScaleScale(FusedOperation):
        def fuser_forward(self, ctxs, x, extra_inputs):
            a, b = self.basic_ops
            return x * (a.scale * b.scale), [[], []]

    register_fusion_rule(
        FusionRule("forward_scale_scale_test", "forward", ((te.ops.ConstantScale,), (te.ops.ConstantScale,)),
                   ForwardScaleScale)
    )
    try:
        model = te.ops.Sequential(te.ops.ConstantScale(2.0), te.ops.ConstantScale(0.25))
        out, grads = run(model, torch.ones(3, 4))
    finally:
        unregister_fusion_rule("forward_scale_scale_test")
    assert "forward_scale_scale_test" in model.fusion_plan().rules()
    torch.testing.assert_close(out[0], torch.full((3, 4), 0.5))
    torch.testing.assert_close(grads["x"], torch.full((3, 4), 0.5))
    with pytest.raises(ValueError, match="already exists"):
        register_fusion_rule(DEFAULT_RULES[0])


def test_without_fusion_rules_leaves_rules_out_for_a_block_and_puts_them_back():
    before = [r.name for r in fusion_rules()]
    with te.ops.without_fusion_rules("forward_linear_bias", "backward_activation_bias"):
        inside = [r.name for r in fusion_rules()]
        model = te.ops.Sequential(te.ops.Linear(H, H))
        with torch.no_grad():
            model(torch.randn(3, H))
        assert "rule forward_linear_bias]" not in model.fusion_plan()
    assert inside == [n for n in before if n not in ("forward_linear_bias", "backward_activation_bias")]
    assert [r.name for r in fusion_rules()] == before
    with pytest.raises(KeyError, match="no rule named 'no_such_rule'"):
        with te.ops.without_fusion_rules("forward_linear_bias", "no_such_rule"):
            pass
    assert [r.name for r in fusion_rules()] == before  # nothing removed by the rejected call


def test_a_sequential_takes_a_rule_table_of_its_own():
    """A table is a value: one model without a rule, the others (and other threads) untouched."""
    table = te.ops.fusion_rule_table().without("forward_linear_bias")
    own = te.ops.Sequential(te.ops.Linear(H, H), rules=table)
    other = te.ops.Sequential(te.ops.Linear(H, H))
    with torch.no_grad():
        own(torch.randn(3, H))
        other(torch.randn(3, H))
    assert "forward_linear_bias" not in own.fusion_plan().rules()
    assert "forward_linear_bias" in other.fusion_plan().rules()
    assert "forward_linear_bias" in {r.name for r in te.ops.fusion_rules()}


def test_without_fusion_rules_is_this_threads_only():
    import threading

    seen = {}

    def build_in_another_thread():
        model = te.ops.Sequential(te.ops.Linear(H, H))
        with torch.no_grad():
            model(torch.randn(3, H))
        seen["rules"] = model.fusion_plan().rules()

    with te.ops.without_fusion_rules("forward_linear_bias"):
        thread = threading.Thread(target=build_in_another_thread)
        thread.start()
        thread.join()
    assert "forward_linear_bias" in seen["rules"]


def test_a_predicate_may_read_the_build_context():
    seen = []

    def predicate(ops, recipe, context):
        seen.append((context.needs_backward, context.device.type))
        return "declined for the test"

    rule = FusionRule("forward_linear_context_test", "forward", ((te.ops.BasicLinear,), (te.ops.Bias,)),
                      lambda ops: None, predicate)
    model = te.ops.Sequential(te.ops.Linear(H, H), rules=te.ops.RuleTable().with_rules(rule))  # only this rule
    with torch.no_grad():
        model(torch.randn(3, H))
    assert seen == [(False, "cpu")]
    assert "forward_linear_context_test at ops 0..1: declined for the test" in model.fusion_plan().groups[0].declined
