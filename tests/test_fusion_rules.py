"""Every fusion rule: fused equals unfused on the same inputs, outputs and gradients.

Each rule of ``DEFAULT_RULES`` has an entry in :data:`EXAMPLES`: small
``te.ops.Sequential`` models the rule fires in, and the runs it fires in (which
recipes, how many steps, with a backward or not). ``test_fused_equals_unfused``
builds every example under every recipe, dtype and backend the entry allows; a
rule without an entry fails ``test_every_rule_has_an_example_model`` (and its own
cases there), by name."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser.ops import FusionRule, fusion_rules
from te_fuser.kernels.formats import GLU_GATES
from te_fuser.ops.fused import DEFAULT_RULES
from tolerances import assert_close

H, F = 64, 128  # multiples of 32 (also F / 2) so that MXFP8 applies too
ALL_RECIPES = ("none", "delayed", "current", "mxfp8", "block")
ATTENTION_RECIPES = ("delayed_mha", "current_mha")  # fp8_mha: the attention hand-offs' recipes
FP8_RECIPES = ("delayed", "current", "mxfp8", "block")
ACTIVATIONS = (te.ops.GELU, te.ops.ReLU, te.ops.SiLU, te.ops.SwiGLU)
# activations the GEMM epilogue does not apply: only the backward rules take them
BACKWARD_ONLY_ACTIVATIONS = (te.ops.QGELU, te.ops.SReLU, te.ops.GLU, te.ops.GEGLU, te.ops.QGEGLU, te.ops.ReGLU,
                             te.ops.SReGLU)


@dataclass(frozen=True)
class Example:
    """A small model the rule fires in: ``build()`` makes it afresh."""

    build: Callable[[], te.ops.Sequential]
    extra_inputs: int = 0


@dataclass(frozen=True)
class RuleExamples:
    """A rule's example models and the runs in which it fires."""

    models: tuple[Example, ...]
    recipes: tuple[str, ...] = ALL_RECIPES  # op_testing.RECIPES names
    why_not_other_recipes: str = ""
    steps: int = 1  # forward (and backward) steps; the last one is compared
    backward: bool = True  # False: the rule fires only without a backward (forwards under torch.no_grad)
    on_triton: bool = False  # also on the Triton backend (under the interpreter: bf16, the first model only)


def _width(act, n: int) -> int:
    return n // 2 if act is not None and act.kind in GLU_GATES else n


def _linear_activation_linear(act) -> te.ops.Sequential:
    return te.ops.Sequential(te.ops.Linear(H, F), act(), te.ops.Linear(_width(act, F), H))


def _bias_activation_linear(act) -> te.ops.Sequential:
    return te.ops.Sequential(te.ops.Bias(H), act(), te.ops.Linear(_width(act, H), H))


def _sequential(*make: Callable[[], torch.nn.Module]) -> Callable[[], te.ops.Sequential]:
    return lambda: te.ops.Sequential(*(m() for m in make))


def _hand_off_model(act, tail: str) -> te.ops.Sequential:
    """Linear(+bias) [-> act] -> the second linear, then ``tail``: "" (no bias), "bias",
    "bias_activation" or "bias_add"."""
    mods = [te.ops.Linear(H, F)] + ([act()] if act else [])
    width = _width(act, F)
    mods.append(te.ops.BasicLinear(width, F) if tail == "" else te.ops.Linear(width, F))
    if tail == "bias_activation":
        mods.append(te.ops.SwiGLU() if act is te.ops.GELU else te.ops.GELU())
    if tail == "bias_add":
        mods.append(te.ops.AddExtraInput())
    return te.ops.Sequential(*mods)


def _hand_off(with_activation: bool, tail: str = "") -> RuleExamples:
    """A hand-off rule's examples: with every activation between the linears when its
    pattern has one. A delayed-scaling rule; its second step is compared (a fresh
    quantizer seeds its scale on the first); with an activation it fires without a backward."""
    acts = ACTIVATIONS if with_activation else (None,)
    return RuleExamples(
        tuple(Example(partial(_hand_off_model, act, tail), extra_inputs=int(tail == "bias_add")) for act in acts),
        recipes=("delayed",),
        why_not_other_recipes="the FP8 hand-off is a delayed-scaling rule (test_forward_linear_bias_linear.py)",
        steps=2, backward=not with_activation, on_triton=True)


def _amax_hand_off(tail: str) -> RuleExamples:
    """A current-scaling amax hand-off's examples: an activation kernel between the
    linears (any kind: with a backward it runs apart from the GEMM), trained."""
    acts = ACTIVATIONS + (te.ops.QGELU, te.ops.SReLU, te.ops.GEGLU)
    return RuleExamples(
        tuple(Example(partial(_hand_off_model, act, tail), extra_inputs=int(tail == "bias_add")) for act in acts),
        recipes=("current",),
        why_not_other_recipes="the amax hand-off is a current-scaling rule (test_forward_linear_bias_linear.py)",
        on_triton=True)


_DECLINES_WITHOUT_FP8 = ("the rule declines without an FP8 recipe "
                        "(test_rules_that_read_the_recipe_decline_with_a_reason)")
_LINEAR_ACTIVATION_LINEAR = tuple(Example(partial(_linear_activation_linear, act)) for act in ACTIVATIONS)

# Attention examples: 2 query heads and 1 kv head of dim 32 on the (., ., H) input.
_QKV_WIDTH, _ATTN_WIDTH = (2 + 2 * 1) * 32, 2 * 32


def _attention_model(head: str, tail: str) -> te.ops.Sequential:
    """[QKV projection (head: "linear", "linear_bias", or "rope": a biased one, then RoPE)]
    -> attention -> [projection (tail: "", "linear", "linear_bias", "linear_bias_add")]."""
    mods = [te.ops.BasicLinear(H, _QKV_WIDTH) if head == "linear" else te.ops.Linear(H, _QKV_WIDTH)]
    if head == "rope":
        mods.append(te.ops.RotaryEmbedding(2, 32, 1))
    mods.append(te.ops.DotProductAttention(2, 32, 1))
    if tail == "linear":
        mods.append(te.ops.BasicLinear(_ATTN_WIDTH, H))
    elif tail:
        mods.append(te.ops.Linear(_ATTN_WIDTH, F if tail == "linear_bias_add" else H))
    if tail == "linear_bias_add":
        mods.append(te.ops.AddExtraInput())
    return te.ops.Sequential(*mods)


def _attention(head: str, tail: str) -> RuleExamples:
    """A fp8_mha hand-off's example: the QKV epilogue's rules under delayed scaling only
    (the scale must be known before the GEMM), attention's O hand-off under both
    per-tensor recipes; the second step is compared (a fresh quantizer seeds first)."""
    return RuleExamples((Example(partial(_attention_model, head, tail), extra_inputs=int(tail == "linear_bias_add")),),
                        recipes=ATTENTION_RECIPES if head == "rope" else ("delayed_mha",),
                        why_not_other_recipes="attention's hand-offs run under fp8_mha (the QKV epilogue's under "
                                              "delayed scaling only: test_attention_op.py)", steps=2)


_ATTENTION_TAILS = ("linear", "linear_bias", "linear_bias_add")
_ATTENTION_EXAMPLES = {
    **{f"forward_dpa_{tail}": _attention("rope", tail) for tail in _ATTENTION_TAILS},
    **{f"forward_{head}_dpa" + (f"_{tail}" if tail else ""): _attention(head, tail)
       for head in ("linear", "linear_bias") for tail in ("",) + _ATTENTION_TAILS},
}

EXAMPLES: dict[str, RuleExamples] = {
    **_ATTENTION_EXAMPLES,
    "forward_linear_bias_linear": _hand_off(False),
    "forward_linear_bias_linear_bias": _hand_off(False, "bias"),
    "forward_linear_bias_linear_bias_activation": _hand_off(False, "bias_activation"),
    "forward_linear_bias_linear_bias_add": _hand_off(False, "bias_add"),
    "forward_linear_bias_activation_linear": _hand_off(True),
    "forward_linear_bias_activation_linear_bias": _hand_off(True, "bias"),
    "forward_linear_bias_activation_linear_bias_activation": _hand_off(True, "bias_activation"),
    "forward_linear_bias_activation_linear_bias_add": _hand_off(True, "bias_add"),
    "forward_activation_amax_linear": _amax_hand_off(""),
    "forward_activation_amax_linear_bias": _amax_hand_off("bias"),
    "forward_activation_amax_linear_bias_activation": _amax_hand_off("bias_activation"),
    "forward_activation_amax_linear_bias_add": _amax_hand_off("bias_add"),
    # a norm after the activation: with a linear there, current scaling takes the amax hand-off instead
    "forward_linear_bias_activation": RuleExamples(
        tuple(Example(_sequential(partial(te.ops.Linear, H, F), act, partial(te.ops.LayerNorm, _width(act, F))))
              for act in ACTIVATIONS)),
    "forward_linear_bias_add": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, F), te.ops.AddExtraInput), extra_inputs=1),)),
    "forward_linear_add": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, F, bias=False), te.ops.AddExtraInput), extra_inputs=1),
         Example(_sequential(partial(te.ops.Linear, H, F, bias=False), partial(te.ops.AddExtraInput, in_place=True)),
                 extra_inputs=1))),
    "forward_linear_bias": RuleExamples((Example(_sequential(partial(te.ops.Linear, H, F))),)),
    "forward_linear_bias_rotary": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, _QKV_WIDTH), partial(te.ops.RotaryEmbedding, 2, 32, 1))),
         Example(partial(_attention_model, "rope", "linear_bias"))), on_triton=True),
    "forward_linear_rotary": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, _QKV_WIDTH, bias=False),
                             partial(te.ops.RotaryEmbedding, 2, 32, 1))),), on_triton=True),
    "forward_linear_scale_add": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, F, bias=False), partial(te.ops.ConstantScale, -0.37),
                             te.ops.AddExtraInput), extra_inputs=1),
         Example(_sequential(partial(te.ops.BasicLinear, H, F), partial(te.ops.ConstantScale, 1.7),
                             partial(te.ops.AddExtraInput, in_place=True)), extra_inputs=1))),
    "backward_linear_bias_activation": RuleExamples(
        _LINEAR_ACTIVATION_LINEAR + tuple(Example(partial(_linear_activation_linear, act))
                                          for act in BACKWARD_ONLY_ACTIVATIONS), recipes=FP8_RECIPES,
                                                    why_not_other_recipes=_DECLINES_WITHOUT_FP8),
    "backward_linear_bias": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, F))),
         Example(_sequential(partial(te.ops.Linear, H, F), partial(te.ops.Linear, F, H)))),
        recipes=FP8_RECIPES, why_not_other_recipes=_DECLINES_WITHOUT_FP8),
    "backward_activation_bias": RuleExamples(tuple(Example(partial(_bias_activation_linear, act))
                                                   for act in ACTIVATIONS + BACKWARD_ONLY_ACTIVATIONS)),
    "backward_linear_scale": RuleExamples(
        (Example(_sequential(partial(te.ops.Linear, H, F, bias=False), partial(te.ops.ConstantScale, -0.37))),
         Example(_sequential(partial(te.ops.BasicLinear, H, F), partial(te.ops.ConstantScale, 3.0),
                             partial(te.ops.Linear, F, H)))), on_triton=True),
    "backward_linear_add": RuleExamples(
        (Example(_sequential(te.ops.MakeExtraOutput, partial(te.ops.BasicLinear, H, F))),)),
    "backward_rotary_dpa": RuleExamples((Example(partial(_attention_model, "rope", "")),
                                         Example(partial(_attention_model, "rope", "linear_bias")))),
    "backward_add_rmsnorm": RuleExamples(
        (Example(_sequential(te.ops.MakeExtraOutput, partial(te.ops.RMSNorm, H))),)),
}


def _examples_of(rule: str) -> RuleExamples:
    if rule not in EXAMPLES:
        pytest.fail(f"fusion rule {rule!r} has no example model: add an entry to tests/test_fusion_rules.py's "
                    "EXAMPLES (a small te.ops.Sequential the rule fires in, and the recipes it fires under)")
    return EXAMPLES[rule]


@pytest.mark.parametrize("rule", [r.name for r in DEFAULT_RULES])
def test_every_rule_has_an_example_model(rule):
    entry = _examples_of(rule)
    assert entry.models and set(entry.recipes) <= set(ALL_RECIPES + ATTENTION_RECIPES), rule
    for example in entry.models:
        assert isinstance(example.build(), te.ops.Sequential), rule


def test_every_example_is_of_a_default_rule():
    assert set(EXAMPLES) <= {r.name for r in DEFAULT_RULES}
    assert {r.name for r in DEFAULT_RULES} <= {r.name for r in fusion_rules()}


def _representable_params(model, gen):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -3))


def _forward(model, x, *extras, recipe=None):
    with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x, *extras)
    return (out if isinstance(out, tuple) else (out,)), {}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", ALL_RECIPES + ATTENTION_RECIPES)
@pytest.mark.parametrize("rule", [r.name for r in DEFAULT_RULES])
def test_fused_equals_unfused(rule, recipe_name, dtype, backend):
    entry = _examples_of(rule)
    recipe = RECIPES[recipe_name]
    if recipe_name not in entry.recipes:
        pytest.skip(entry.why_not_other_recipes or "fp8_mha changes attention only, and these models have none")
    if backend == "triton" and (not entry.on_triton or dtype is torch.float32):
        pytest.skip("under the Triton interpreter: the FP8 hand-off rules, in bf16 (slow)")
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("these CPU models take the Triton kernels only under the interpreter, which a GPU machine "
                    "does not run (test_forward_linear_bias_linear.py tests the hand-off on the GPU)")
    for example in entry.models[:1] if backend == "triton" else entry.models:
        gen = torch.Generator().manual_seed(7)
        fused = example.build().to(dtype)
        mods, n_extra = list(fused), example.extra_inputs
        _representable_params(fused, gen)
        unfused = te.ops.Sequential(*copy.deepcopy(mods), fuse=False)
        with te.autocast(enabled=False, backend=backend):
            for _ in range(entry.steps):
                for model in (fused, unfused):
                    model.zero_grad(set_to_none=True)
                x = representable(2, 16, H, generator=gen, dtype=dtype, scale_exp=-3)
                extras = [representable(2, 16, F, generator=gen, dtype=dtype, scale_exp=-3) for _ in range(n_extra)]
                with torch.no_grad():  # on a copy: a high-precision call would reset delayed scaling
                    probe = copy.deepcopy(unfused)(x, *extras)
                probe = probe if isinstance(probe, tuple) else (probe,)
                dy = representable(*probe[0].shape, generator=gen, dtype=dtype)
                dextras = [representable(*p.shape, generator=gen, dtype=dtype) for p in probe[1:]]
                if entry.backward:
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
        # FP8 attention casts its output too (the o role).
        linears = sum(isinstance(m, (te.ops.Linear, te.ops.BasicLinear)) for m in mods)
        fp8_attention = recipe is not None and recipe.fp8_attention and any(
            isinstance(m, te.ops.DotProductAttention) for m in mods)
        requantized = recipe is not None and (len(mods) > 2 or linears > 1 or fp8_attention)
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


def _match_trying_every_rule(ops, pass_, recipe, context, table):
    """What ``match`` decides when every rule of the pass is tried at every op (as
    it did before the table indexed its rules by their first op type)."""
    rules = table.for_pass(pass_)
    steps, declined, i = [], [], 0
    while i < len(ops):
        for rule in rules:
            n = len(rule.pattern)
            if i + n > len(ops) or not all(isinstance(ops[i + j], t) for j, t in enumerate(rule.pattern)):
                continue
            if rule.applies_to is not None and not rule.applies_to(recipe):
                continue
            reason = rule.decline_reason(ops[i : i + n], recipe, context)
            if reason is None:
                steps.append((rule.name, tuple(range(i, i + n))))
                i += n
                break
            declined.append(f"{rule.name} at ops {i}..{i + n - 1}: {reason}")
        else:
            steps.append((None, (i,)))
            i += 1
    return steps, declined


def test_the_rules_indexed_by_their_first_op_decide_as_trying_every_rule():
    """Re-fusion tries at each op only the rules whose first position takes it: on
    every example model, under every recipe, for both passes (with and without a
    backward), the steps and the declined reasons are those of trying every rule,
    and an op of a subclass of a rule's type still starts the rule."""
    from te_fuser.ops.rules import BuildContext, match

    table = te.ops.fusion_rule_table()
    for name, entry in EXAMPLES.items():
        for example in entry.models:
            ops = [op for fuser in example.build()._fusers() for op in fuser.ops]
            for recipe_name in entry.recipes:
                recipe = RECIPES[recipe_name]
                for pass_, needs_backward in (("forward", True), ("forward", False), ("backward", True)):
                    context = BuildContext(needs_backward, torch.device("cpu"))
                    got = match(ops, pass_, recipe, context=context, table=table)
                    want = _match_trying_every_rule(ops, pass_, recipe, context, table)
                    assert [(s.rule, s.indices) for s in got.steps] == want[0], (name, recipe_name, pass_)
                    assert got.declined == want[1], (name, recipe_name, pass_)

    class OwnLinear(te.ops.BasicLinear):
        pass

    ops = [OwnLinear(H, H), te.ops.Bias(H)]
    got = match(ops, "forward", None, context=BuildContext(True, torch.device("cpu")), table=table)
    assert [s.rule for s in got.steps] == ["forward_linear_bias"]
