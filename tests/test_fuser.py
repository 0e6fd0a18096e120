"""The op fuser's contract: one build per key change, atomic rejection, continuity,
weight caching, backward with the forward's plan, and a switch that equals a
fresh model on the target recipe."""

from __future__ import annotations

import copy
import warnings

import expecttest
import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, identity_factory, record_matches, representable
from te_fuser import recipe as R
from te_fuser.quantization import DelayedScalingQuantizer, IdentityQuantizer

H, F = 64, 128


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return te.ops.Sequential(
        te.ops.RMSNorm(H), te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H)
    ).to(dtype)


def step(model, x, recipe, opt=None):
    """One training step; returns (output, grads by parameter name)."""
    model.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(xx)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = xx.grad
    if opt is not None:
        opt.step()
    return y.detach(), grads


def assert_identical(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_identical(a[k], b[k], f"{what}[{k}]")
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for i, (u, v) in enumerate(zip(a, b)):
            assert_identical(u, v, f"{what}[{i}]")
        return
    if not isinstance(a, torch.Tensor):
        assert a == b, f"{what}: {a!r} != {b!r}"
        return
    assert torch.equal(a, b), f"{what}: not bit-identical (max diff {(a.double() - b.double()).abs().max()})"


def test_exactly_one_build_per_key_change():
    model = mlp()
    x = torch.randn(8, H)
    schedule = ["delayed", "delayed", "current", "current", "current", "block", "delayed", "none", "none"]
    for name in schedule:
        step(model, x, RECIPES[name])
    changes = 1 + sum(a != b for a, b in zip(schedule, schedule[1:]))
    stats = model.fusion_stats()
    assert stats.builds == changes and stats.hits == len(schedule) - changes


def test_no_build_over_1000_steps_with_new_but_equal_recipes():
    model = te.ops.Sequential(te.ops.Linear(32, 32))
    x = torch.randn(4, 32)
    with torch.no_grad():
        for _ in range(1000):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                model(x)
    stats = model.fusion_stats()
    assert stats.builds == 1 and stats.hits == 999
    assert stats.key == str(R.Float8CurrentScaling())


@pytest.mark.parametrize("a,b", [("delayed", "current"), ("current", "delayed"), ("none", "mxfp8"),
                                 ("block", "delayed"), ("mxfp8", "none")])
def test_mid_training_switch_is_bit_identical_to_a_fresh_model_on_the_target(a, b):
    x = [representable(32, H, generator=torch.Generator().manual_seed(i)) * 0.125 for i in range(6)]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(3):
        step(model, x[i], RECIPES[a], opt)
    model.prepare(x[3], recipe=RECIPES[b])  # the switch: plan and quantizers for B, nothing run
    assert_trains_as_a_fresh_model(model, opt, x, range(3, 6), RECIPES[b])


def assert_trains_as_a_fresh_model(model, opt, x, steps, recipe):
    """``model`` (SGD ``opt``) and a fresh ``mlp`` loaded with its state dict train
    ``steps`` of ``x`` under ``recipe`` bit for bit alike; returns the fresh one."""
    fresh = mlp(seed=123)
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    for i in steps:
        out_m, g_m = step(model, x[i], recipe, opt)
        out_f, g_f = step(fresh, x[i], recipe, fresh_opt)
        assert_identical(out_m, out_f, f"step {i} output")
        assert_identical(g_m, g_f, f"step {i} grads")
    return fresh


def test_delayed_to_delayed_carries_the_history_and_a_fresh_model_with_that_state_matches():
    x = [torch.randn(32, H, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    a, b = R.DelayedScaling(amax_history_len=8), R.DelayedScaling(amax_history_len=4, margin=1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(3):
        step(model, x[i], a, opt)
    old = model[1].quantizer("input")
    old_history = old.amax_history.clone()
    model.prepare(x[3], recipe=b)
    new = model[1].quantizer("input")
    assert isinstance(new, DelayedScalingQuantizer) and new is not old and new.amax_history_len == 4
    assert torch.equal(new.amax_history, old_history[:4])
    expected_scale = torch.tensor(448.0) / old_history.max() / 2.0  # fmax / amax / 2**margin
    assert torch.equal(new.scale, expected_scale)
    fresh = mlp(seed=5)
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    for i in range(3, 6):
        assert_identical(step(model, x[i], b, opt), step(fresh, x[i], b, fresh_opt), f"step {i}")


def test_entering_delayed_scaling_seeds_the_scale_from_the_current_amax():
    model = te.ops.Sequential(te.ops.BasicLinear(H, H))
    x = torch.randn(8, H) * 10
    step(model, x, RECIPES["current"])
    step(model, x, R.DelayedScaling())
    q = model[0].quantizer("input")
    assert q.seeded
    assert torch.equal(q.amax_history[0], x.abs().max())


def test_rejected_switch_raises_and_leaves_the_old_plan_untouched():
    x = [torch.randn(8, 48, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    make = lambda: te.ops.Sequential(te.ops.Linear(48, 40), te.ops.ReLU(), te.ops.Linear(40, 48))  # noqa: E731
    torch.manual_seed(1)
    model = make()
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    recipe = R.DelayedScaling(amax_history_len=4)
    for m, o in ((model, opt), (twin, twin_opt)):
        step(m, x[0], recipe, o)
    plan_before = model.fusion_plan()
    quantizers_before = model[0].linear._quantizers
    state_before = copy.deepcopy(model[0].linear.quantizer("input").state_dict())
    with pytest.raises(ValueError, match=r"dim 1 \(columns, 48\).*multiple of 32"):
        step(model, x[1], R.MXFP8BlockScaling())

    def refuse_grads(role):
        if role.tensor_type == "grad_output":
            raise ValueError("no gradients here")
        return IdentityQuantizer()

    with pytest.raises(RuntimeError, match="grad_output"):
        step(model, x[1], R.CustomRecipe(refuse_grads, qfactory_key="refuse"))
    assert model.fusion_plan() == plan_before
    assert model[0].linear._quantizers is quantizers_before
    assert_identical(model[0].linear.quantizer("input").state_dict(), state_before, "delayed state")
    for i in range(1, 4):
        assert_identical(step(model, x[i], recipe, opt), step(twin, x[i], recipe, twin_opt), f"step {i}")


def test_backward_uses_the_quantizers_of_its_forward():
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3))
    model = mlp()
    twin = copy.deepcopy(model)
    xa = x.clone().requires_grad_(True)
    with te.autocast(recipe=RECIPES["block"]):
        ya = model(xa)
    with te.autocast(recipe=RECIPES["current"]):
        model(torch.randn(16, H))  # re-fuses under another recipe before the backward
    ya.sum().backward()
    xb = x.clone().requires_grad_(True)
    with te.autocast(recipe=RECIPES["block"]):
        yb = twin(xb)
    yb.sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_custom_recipe_calls_qfactory_once_per_role_per_build():
    calls = []

    def factory(role):
        calls.append(role)
        return IdentityQuantizer()

    model = mlp()
    recipe = R.CustomRecipe(factory, qfactory_key="counting")
    x = torch.randn(4, H)
    for _ in range(3):
        step(model, x, recipe)
    roles = [(r.module_type, r.tensor_type) for r in calls]
    assert roles == [("linear", "input"), ("linear", "weight"), ("linear", "grad_output")] * 2
    step(model, x, R.CustomRecipe(factory, qfactory_key="counting-2"))
    assert len(calls) == 12


def test_identity_only_custom_recipe_matches_plain_bf16_bit_for_bit():
    x = torch.randn(8, H).bfloat16()
    model = mlp(torch.bfloat16)
    twin = copy.deepcopy(model)
    with_identity = step(model, x, R.CustomRecipe(identity_factory, qfactory_key="identity"))
    plain = step(twin, x, None)
    assert_identical(with_identity, plain, "identity recipe vs bf16")
    assert all(q.min_compute_capability is None for q in model[1].linear._quantizers.values())


def test_an_op_called_on_its_own_is_as_correct_as_in_a_sequential():
    x = torch.randn(8, H)
    model = te.ops.Sequential(te.ops.Linear(H, H))
    twin = copy.deepcopy(model)
    step(model, x, RECIPES["current"])
    step(twin, x, RECIPES["current"])
    with te.autocast(recipe=RECIPES["block"]), torch.no_grad():
        model[0](x)  # the Linear on its own installs block-scaling quantizers
    assert model[0].linear._quantizer_key == str(RECIPES["block"])
    assert_identical(step(model, x, RECIPES["current"]), step(twin, x, RECIPES["current"]), "after standalone use")
    assert model[0].linear._quantizer_key == str(RECIPES["current"])


def test_a_fresh_lambda_per_step_warns_once_from_the_fuser():
    model = te.ops.Sequential(te.ops.Linear(32, 32))
    x = torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            step(model, x, R.DelayedScaling(amax_compute_algo=lambda h: h.max()))
    assert len([w for w in caught if "re-fuses" in str(w.message)]) == 1
    assert model.fusion_stats().builds == 6


def test_grad_mode_changes_share_quantizers_and_weight_cache():
    model = te.ops.Sequential(te.ops.Linear(H, H))
    x = torch.randn(4, H)
    recipe = R.DelayedScaling()
    step(model, x, recipe)
    quantizers = model[0].linear._quantizers
    with torch.no_grad(), te.autocast(recipe=recipe):
        model(x)
    assert model[0].linear._quantizers is quantizers


class TestFusionPlanText(expecttest.TestCase):
    def test_fusion_plan_strings(self):
        model = te.ops.Sequential(
            te.ops.LayerNorm(H, name="ln"), te.ops.MakeExtraOutput(), te.ops.BasicLinear(H, F, name="fc1"),
            te.ops.Bias(F), te.ops.SwiGLU(), te.ops.Linear(F // 2, H, name="fc2"), te.ops.AddExtraInput(),
            torch.nn.Tanh(), te.ops.Linear(H, H, name="fc3"),
        )
        self.assertExpectedInline(model.fusion_plan(), """\
group 0: 8 ops: 0:LayerNorm('ln'), 1:MakeExtraOutput, 2:BasicLinear('fc1'), 3:Bias, 4:SwiGLU, 5:BasicLinear('fc2'), 6:Bias('fc2'), 7:AddExtraInput
  not built yet (call the model once)
group 1: plain module Tanh (runs as is)
group 2: 2 ops: 0:BasicLinear('fc3'), 1:Bias('fc3')
  not built yet (call the model once)""")
        x = torch.randn(4, H, requires_grad=True)
        with te.autocast(recipe=R.Float8CurrentScaling()):
            y, branch = model(x, torch.randn(4, H))
        text = model.fusion_plan().replace(str(R.Float8CurrentScaling()), "<Float8CurrentScaling>")
        self.assertExpectedInline(text, """\
group 0: 8 ops: 0:LayerNorm('ln'), 1:MakeExtraOutput, 2:BasicLinear('fc1'), 3:Bias, 4:SwiGLU, 5:BasicLinear('fc2'), 6:Bias('fc2'), 7:AddExtraInput
  recipe: <Float8CurrentScaling>
  built for: backward=True dtype=float32 training=True calibrating=False device=cpu backend=auto
  forward:
    LayerNorm(0:LayerNorm('ln'))
    MakeExtraOutput(1:MakeExtraOutput)
    ForwardLinearBiasLinear(2:BasicLinear('fc1'), 3:Bias, 4:SwiGLU, 5:BasicLinear('fc2'), 6:Bias('fc2'), 7:AddExtraInput)  [rule forward_activation_amax_linear_bias_add]
  backward:
    LayerNorm(0:LayerNorm('ln'))
    BackwardLinearAdd(1:MakeExtraOutput, 2:BasicLinear('fc1'))  [rule backward_linear_add]
    BackwardActivationBias(3:Bias, 4:SwiGLU)  [rule backward_activation_bias]
    BackwardLinearBias(5:BasicLinear('fc2'), 6:Bias('fc2'))  [rule backward_linear_bias]
    AddExtraInput(7:AddExtraInput)
  kernel: gemm: reference
  kernel: dequantize: reference
  kernel: quantize_current: reference
  kernel: quantize_current_column_sums: reference
group 1: plain module Tanh (runs as is)
group 2: 2 ops: 0:BasicLinear('fc3'), 1:Bias('fc3')
  recipe: <Float8CurrentScaling>
  built for: backward=True dtype=float32 training=True calibrating=False device=cpu backend=auto
  forward:
    ForwardLinearBiasActivation(0:BasicLinear('fc3'), 1:Bias('fc3'))  [rule forward_linear_bias]
  backward:
    BackwardLinearBias(0:BasicLinear('fc3'), 1:Bias('fc3'))  [rule backward_linear_bias]
  kernel: gemm: reference
  kernel: dequantize: reference
  kernel: quantize_current: reference
  kernel: quantize_current_column_sums: reference""")
        with torch.no_grad():
            model(x, torch.randn(4, H))
        self.assertExpectedInline(model.fusion_plan(), """\
group 0: 8 ops: 0:LayerNorm('ln'), 1:MakeExtraOutput, 2:BasicLinear('fc1'), 3:Bias, 4:SwiGLU, 5:BasicLinear('fc2'), 6:Bias('fc2'), 7:AddExtraInput
  recipe: high_precision
  built for: backward=False dtype=float32 training=True calibrating=False device=cpu backend=auto
  forward:
    LayerNorm(0:LayerNorm('ln'))
    MakeExtraOutput(1:MakeExtraOutput)
    ForwardLinearBiasActivation(2:BasicLinear('fc1'), 3:Bias, 4:SwiGLU)  [rule forward_linear_bias_activation]
    ForwardLinearBiasAdd(5:BasicLinear('fc2'), 6:Bias('fc2'), 7:AddExtraInput)  [rule forward_linear_bias_add]
group 1: plain module Tanh (runs as is)
group 2: 2 ops: 0:BasicLinear('fc3'), 1:Bias('fc3')
  recipe: high_precision
  built for: backward=False dtype=float32 training=True calibrating=False device=cpu backend=auto
  forward:
    ForwardLinearBiasActivation(0:BasicLinear('fc3'), 1:Bias('fc3'))  [rule forward_linear_bias]""")


class Square(te.ops.BasicOperation):
    """A user-written basic op: y = x * x."""

    module_type = "square"

    def op_forward(self, ctx, x, extra_inputs):
        ctx.saved["x"] = x
        return x * x, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return 2 * ctx.saved["x"] * dy, [], []


def test_a_user_written_basic_op_runs_in_a_sequential():
    model = te.ops.Sequential(te.ops.Linear(8, 8), Square(), te.ops.Linear(8, 4))
    reference = torch.nn.Sequential(copy.deepcopy(model[0]), copy.deepcopy(model[2]))
    x = torch.randn(5, 8, requires_grad=True)
    y = model(x)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = reference[1](reference[0](x2) ** 2)
    y2.sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    assert "Square(2:Square)" in model.fusion_plan()


def test_autocast_amax_reduction_group_reaches_delayed_quantizers_when_the_recipe_reduces():
    group = object()  # stands for a torch.distributed group; only its identity is used here
    model = te.ops.Sequential(te.ops.Linear(16, 16))
    x = torch.randn(4, 16)
    with torch.no_grad():
        with te.autocast(recipe=R.DelayedScaling(reduce_amax=False), amax_reduction_group=group):
            model.prepare(x)
        assert model[0].linear.quantizer("input").amax_reduction_group is None
        with te.autocast(recipe=R.DelayedScaling(), amax_reduction_group=group):
            model.prepare(x)
        assert model[0].linear.quantizer("input").amax_reduction_group is group
        builds = model.fusion_stats().builds
        with te.autocast(recipe=R.DelayedScaling()):
            model.prepare(x)  # same recipe, no group: the plan is rebuilt for the default process group
        from te_fuser.quantization.amax_reduction import WORLD

        assert model[0].linear.quantizer("input").amax_reduction_group is WORLD  # (none here: nothing reduced)
        assert model.fusion_stats().builds == builds + 1


def test_a_new_kernel_backend_rebuilds_the_plan_and_its_report_names_it(monkeypatch):
    """The backend is part of a plan's conditions: its fusion decisions and kernel
    notes read it, so a plan built for another backend is not reused."""
    monkeypatch.setattr(te.backend, "_unavailable_reason", lambda backend, device: None)  # any backend "runs" here
    model, x = mlp(), torch.randn(8, H)
    recipe = RECIPES["current"]
    with te.autocast(recipe=recipe):
        model(x)
    assert "backend=auto" in model.fusion_plan()
    builds = model.fusion_stats().builds
    try:
        te.set_backend("reference")
        with te.autocast(recipe=recipe):
            model(x)
            model(x)
        assert model.fusion_stats().builds == builds + 1
        assert "backend=reference" in model.fusion_plan()
        with te.autocast(recipe=recipe, backend="auto"):
            model(x)
        assert "backend=auto" in model.fusion_plan() and model.fusion_stats().builds == builds + 2
    finally:
        te.set_backend("auto")


@pytest.mark.parametrize("a,b", [("delayed", "current"), ("current", "none"), ("mxfp8", "delayed")])
def test_a_switch_back_matches_no_rules_and_equals_a_fresh_model(a, b, monkeypatch):
    """A -> B -> A: the switch back to A takes the fusion steps, kernel notes and
    validated shapes matched under A before (the plan template) and builds only
    fresh quantizers (under a recipe with scaling state; without, A's plan is
    published again), and trains bit for bit as a fresh model built on A."""
    x = [representable(32, H, generator=torch.Generator().manual_seed(i)) * 0.125 for i in range(8)]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(3):
        step(model, x[i], RECIPES[a], opt)
    for i in range(3, 5):
        step(model, x[i], RECIPES[b], opt)
    matched = record_matches(monkeypatch)
    builds = model.fusion_stats().builds
    model.prepare(x[5], recipe=RECIPES[a])  # the switch back
    assert model.fusion_stats().builds == builds + 1 and matched == []
    fresh = assert_trains_as_a_fresh_model(model, opt, x, range(5, 8), RECIPES[a])
    assert model.fusion_plan() == fresh.fusion_plan()


@pytest.mark.parametrize("a", ["current", "mxfp8", "block", "rowwise", "none"])
def test_a_switch_back_to_a_recipe_without_state_publishes_its_plan_again(a):
    """A recipe whose quantizers keep no scaling state: the switch back publishes
    the plan built under it before (its quantizers, prepared casts and steps), a
    "kept" build, where a recipe with state (delayed scaling) builds fresh
    quantizers; both train bit for bit as a fresh model on the recipe."""
    x = [representable(32, H, generator=torch.Generator().manual_seed(i)) * 0.125 for i in range(6)]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step(model, x[0], RECIPES[a], opt)
    plans = [f._plan for f in model._fusers()]
    installed = [op.installed_quantizers for f in model._fusers() for op in f.ops]
    step(model, x[1], RECIPES["delayed"], opt)
    builds = model.fusion_stats().builds
    step(model, x[2], RECIPES[a], opt)
    assert [f._plan for f in model._fusers()] == plans and all(
        f._plan is p for f, p in zip(model._fusers(), plans)), "the plan built before, published again"
    assert model.fusion_stats().builds == builds + len(plans)
    assert set(model.fusion_stats().last_build_phases) == {"kept", "publish"}
    if a != "none":  # a high-precision plan installs none (the delayed ones stay)
        ops = [op for f in model._fusers() for op in f.ops]
        assert all(op.installed_quantizers is qs for op, qs in zip(ops, installed)), "its quantizers, again"
    assert_trains_as_a_fresh_model(model, opt, x, range(3, 6), RECIPES[a])
    step(model, x[3], RECIPES["current"], opt)
    step(model, x[4], RECIPES["delayed"], opt)
    delayed_plans = [f._plan for f in model._fusers()]
    step(model, x[5], RECIPES["current"], opt)
    step(model, x[5], RECIPES["delayed"], opt)
    assert not any(f._plan is p for f, p in zip(model._fusers(), delayed_plans)), "delayed scaling builds again"
    assert "kept" not in model.fusion_stats().last_build_phases


def test_a_subclass_of_a_quantizer_without_state_is_built_afresh():
    """Only the built-in classes without state are kept: a custom recipe's
    subclass (which may keep state of its own) gets fresh quantizers at every
    switch back."""
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    class Counting(Float8CurrentScalingQuantizer):
        pass

    def factory(role):
        return Counting(torch.float8_e4m3fn)

    custom = R.CustomRecipe(factory, qfactory_key="counting")
    model, x = mlp(), torch.randn(8, H)
    step(model, x, custom)
    first = [f._plan for f in model._fusers()]
    step(model, x, RECIPES["current"])
    step(model, x, custom)
    assert not any(f._plan is p for f, p in zip(model._fusers(), first))
    assert "kept" not in model.fusion_stats().last_build_phases


def test_plans_of_one_recipe_share_its_quantizers_after_a_switch_back():
    """A training and an evaluation plan of one recipe share the installed
    quantizers (one plan is published at a time: each call of the other kind
    publishes its own again). After a switch away and back, both kept plans are
    published again on those same quantizers; one built afresh in between (the
    kept one was for another te.autocast group) takes the installed ones, and the
    kept plan of the other kind is then built again on them, not published with
    quantizers of its own."""
    model, x = mlp(), torch.randn(8, H)
    current = RECIPES["current"]

    def evaluate(group=None):
        with torch.no_grad(), te.autocast(recipe=current, amax_reduction_group=group):
            model(x)
        return [f._plan for f in model._fusers()]

    def train():
        step(model, x, current)
        return [f._plan for f in model._fusers()]

    def shared(a, b):
        return all(qa is qb for pa, pb in zip(a, b) for qa, qb in zip(pa.quantizers, pb.quantizers))

    trained, evaluated = train(), evaluate()
    assert shared(trained, evaluated)
    step(model, x, RECIPES["delayed"])
    assert evaluate() == evaluated and train() == trained and shared(trained, evaluated)
    assert set(model.fusion_stats().last_build_phases) == {"kept", "publish"}
    step(model, x, RECIPES["delayed"])
    other_group = evaluate(group=object())  # a plan of its own for another group: built, on new quantizers
    assert not any(p is q for p, q in zip(other_group, evaluated))
    retrained = train()  # the kept training plan holds other quantizers than the installed ones of its key: built
    assert not any(p is q for p, q in zip(retrained, trained)) and shared(retrained, other_group)
    for f in model._fusers():
        for op, qs in zip(f.ops, f._plan.quantizers):
            assert op.installed_quantizers is qs


@pytest.mark.parametrize("validate_under", ["delayed", "delayed_margin"])
def test_validations_between_steps_publish_the_plans_with_state_again(validate_under, monkeypatch):
    """Delayed scaling: a training and an evaluation plan of one recipe share the
    installed quantizers, so a validation between training steps publishes the
    kept evaluation plan and the step after it the kept training plan again (no
    build), as long as the ops hold exactly those quantizers. A validation under
    another delayed recipe casts with quantizers of its own, continuing the state
    as it is at that call: its plan is built each time. Either way the losses,
    weights and scaling states equal a model that builds every plan, bit for bit."""
    from te_fuser.ops.fuser import OperationFuser

    x = [representable(32, H, generator=torch.Generator().manual_seed(i)) * 0.125 for i in range(5)]
    other = R.DelayedScaling(margin=1) if validate_under == "delayed_margin" else RECIPES["delayed"]

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        outs, phases = [], []
        for i in range(4):
            outs.append(step(model, x[i], RECIPES["delayed"], opt))
            phases.append(set(model.fusion_stats().last_build_phases))
            model.eval()
            with torch.no_grad(), te.autocast(recipe=other):
                outs.append(model(x[4]))
            phases.append(set(model.fusion_stats().last_build_phases))
            model.train()
        states = [q.state_tensors() for f in model._fusers() for op in f.ops
                  for q in op.installed_quantizers.values()]
        return outs, [p.detach().clone() for p in model.parameters()], states, phases

    kept = train(mlp())
    original = OperationFuser._may_publish_again
    monkeypatch.setattr(OperationFuser, "_may_publish_again", lambda self, plan: plan.stateless and original(self, plan))
    built = train(mlp())
    assert_identical(kept[:3], built[:3], "training with validations, plans kept against built")
    steps, validations = kept[3][0::2], kept[3][1::2]
    assert all(p == {"kept", "publish"} for p in steps[1:]), "the training plan published again"
    if validate_under == "delayed":
        assert all(p == {"kept", "publish"} for p in validations[1:]), "the evaluation plan published again"
    else:  # the validation's own quantizers continue the state of its call: built each time
        assert all("kept" not in p for p in validations)
    assert all("kept" not in p for p in built[3])


def test_a_switch_back_matches_again_under_another_rule_table():
    """A plan template belongs to the rule table it was matched with: a switch back
    inside ``without_fusion_rules`` (or after a rule is registered) matches again."""
    model, x = mlp(), torch.randn(8, H)
    current, delayed = RECIPES["current"], RECIPES["delayed"]
    for recipe in (current, delayed):
        step(model, x, recipe)
    assert "rule forward_linear_bias_activation" in model.fusion_plan()  # delayed scaling's plan
    from te_fuser.ops.fused import DEFAULT_RULES

    amax_rules = [rule.name for rule in DEFAULT_RULES if rule.name.startswith("forward_activation_amax_")]
    with te.ops.without_fusion_rules(*amax_rules):
        step(model, x, current)
        assert "rule forward_activation_amax_linear_bias" not in model.fusion_plan()
        assert "rule forward_linear_bias_activation" in model.fusion_plan()
    step(model, x, delayed)
    step(model, x, current)
    assert "rule forward_activation_amax_linear_bias" in model.fusion_plan()


def test_a_switch_back_checks_a_new_input_shape_again():
    """The shapes a template validated are reused; another shape is checked under
    the switch's quantizers, with the op's own error."""
    model = mlp()
    step(model, torch.randn(8, H), RECIPES["current"])
    step(model, torch.randn(8, H), None)
    with pytest.raises(ValueError, match="RMSNorm: input's last dim is 65, expected 64"):
        step(model, torch.randn(8, H + 1), RECIPES["current"])
    step(model, torch.randn(8, H), RECIPES["current"])


def test_a_training_loop_keeps_every_loss_bit_with_what_switches_reuse(monkeypatch):
    """The smoke GPT as users train it (fused AdamW, evaluations without FP8, a
    checkpoint resumed, bf16 -> delayed -> current -> bf16 twice, so the second
    round switches back to recipes seen before): every loss the same bits with plan
    templates, prototype quantizers and shared prepared casts as with each switch
    matching, making and preparing everything afresh."""
    from training_loops import gpt_losses

    from te_fuser.ops.fuser import OperationFuser
    from te_fuser.quantization import base, factory

    reused = gpt_losses(steps=12)
    template = OperationFuser._template

    def matched_afresh(self, *args):
        self._templates.clear()
        return template(self, *args)

    class NoneKept(dict):
        def get(self, key, default=None):
            return default

    monkeypatch.setattr(OperationFuser, "_template", matched_afresh)
    monkeypatch.setattr(factory, "_made", lambda recipe, role, *_: recipe.make_quantizer(role))
    monkeypatch.setattr(base, "_SHARED_CASTERS", NoneKept())
    assert gpt_losses(steps=12) == reused


def test_a_switch_back_matches_again_once_auto_chooses_otherwise(monkeypatch):
    """A template's fusion decisions read which backend runs each kernel: after
    ``backend.set_auto_entry`` a switch back to a recipe seen before matches again."""
    from te_fuser import backend

    model, x = mlp(), torch.randn(8, H)
    for recipe in (RECIPES["current"], RECIPES["delayed"]):
        step(model, x, recipe)
    matched = record_matches(monkeypatch)
    step(model, x, RECIPES["current"])
    assert matched == []
    before = backend.set_auto_entry("gemm", "triton")
    try:
        step(model, x, RECIPES["delayed"])
        assert matched == ["forward", "backward"]
    finally:
        backend.set_auto_entry("gemm", before)
