"""ForwardLinearBiasLinear: the first GEMM's epilogue casts the second linear's FP8 input.

The hand-off equals the separate cast bit for bit (the epilogue rounds to the
compute dtype before the cast): outputs, gradients and the delayed-scaling state
after several steps match the plan without the hand-off rules, on the reference
backend and under the Triton interpreter. See test_fusion_rules.py for fused
against unfused within tolerance.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import te_fuser as te
import te_fuser.ops.basic.linear as linear_module
from op_testing import representable
from te_fuser import backend
from te_fuser.kernels import reference as ref
from te_fuser.ops import rules
from te_fuser.ops.fused import DEFAULT_RULES, ForwardLinearBiasLinear
from te_fuser.quantization import DelayedScalingQuantizer, Float8CurrentScalingQuantizer
from tolerances import assert_bitwise

H, F = 64, 128
HAND_OFF = [r.name for r in DEFAULT_RULES if r.build is ForwardLinearBiasLinear]
E4M3 = torch.float8_e4m3fn


def _without_hand_off():
    return rules.without_fusion_rules(*HAND_OFF)


def _count_epilogue_casts(monkeypatch) -> list:
    calls = []
    inner = linear_module.gemm_fp8_out

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(linear_module, "gemm_fp8_out", counting)
    return calls


def _model(kind: str, dtype: torch.dtype, gen: torch.Generator):
    mods = {
        "bias": [te.ops.Linear(H, F), te.ops.Linear(F, H)],
        "bias_basic": [te.ops.Linear(H, F), te.ops.BasicLinear(F, H)],
        "gelu": [te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H)],
        "swiglu_gelu": [te.ops.Linear(H, F), te.ops.SwiGLU(), te.ops.Linear(F // 2, H), te.ops.GELU()],
        "add": [te.ops.Linear(H, F), te.ops.Linear(F, H), te.ops.AddExtraInput()],
    }[kind]
    model = te.ops.Sequential(*mods).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -3))
    return model


def _steps(model, xs, recipe, backward: bool, extras=()):
    """Outputs, gradients and every quantizer's state after each step."""
    results = []
    for i, x in enumerate(xs):
        model.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(backward)
        with contextlib.ExitStack() as stack:
            if not backward:
                stack.enter_context(torch.no_grad())
            stack.enter_context(te.autocast(enabled=recipe is not None, recipe=recipe))
            y = model(x, *extras[i : i + 1])
        if backward:
            y.backward(torch.ones_like(y) * 0.25)
        grads = {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
        results.append((y.detach(), grads, copy.deepcopy(model.state_dict())))
    return results


def _assert_identical(got, want, context):
    for step, ((y_a, g_a, s_a), (y_b, g_b, s_b)) in enumerate(zip(got, want)):
        assert_bitwise(y_a, y_b, f"{context} step {step} output")
        for name in g_b:
            if g_b[name] is None:
                assert g_a[name] is None, name
            else:
                assert_bitwise(g_a[name], g_b[name], f"{context} step {step} grad {name}")
        assert s_a.keys() == s_b.keys()
        for key in s_b:
            if isinstance(s_b[key], torch.Tensor):
                assert_bitwise(s_a[key], s_b[key], f"{context} step {step} {key}")
            else:  # extra state: the quantizers' scaling state
                for role, entry in s_b[key]["quantizers"].items():
                    for name, value in entry["state"].items():
                        other = s_a[key]["quantizers"][role]["state"][name]
                        if isinstance(value, torch.Tensor):
                            assert_bitwise(other, value, f"{context} step {step} {key} {role} {name}")
                        else:
                            assert other == value, (context, step, key, role, name)


CASES = [  # (model, backward, rule expected to fire)
    ("bias", True, "forward_linear_bias_linear_bias"),
    ("bias_basic", True, "forward_linear_bias_linear"),
    ("gelu", False, "forward_linear_bias_activation_linear_bias"),
    ("swiglu_gelu", False, "forward_linear_bias_activation_linear_bias_activation"),
    ("add", True, "forward_linear_bias_linear_bias_add"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,backward,rule", CASES)
def test_hand_off_is_bit_identical_to_the_separate_cast(monkeypatch, kind, backward, rule, dtype):
    _check_bit_identical(monkeypatch, kind, backward, rule, dtype, "reference", steps=4)


# Triton kernels: compiled on a GPU (the forward-only cases: with a backward the rule
# declines on a GPU), the interpreter on CPU (two cases: it is slow)
TRITON_CASES = [c for c in CASES if not c[1]] if torch.cuda.is_available() else [CASES[0], CASES[3]]


@pytest.mark.parametrize("kind,backward,rule", TRITON_CASES)
def test_hand_off_is_bit_identical_on_the_triton_backend(monkeypatch, kind, backward, rule):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_bit_identical(monkeypatch, kind, backward, rule, torch.bfloat16, "triton", steps=3, device=device)


def _check_bit_identical(monkeypatch, kind, backward, rule, dtype, backend_name, steps, device="cpu"):
    gen = torch.Generator().manual_seed(11)
    fused = _model(kind, dtype, gen).to(device)
    plain = copy.deepcopy(fused)
    # growing, off-centre inputs: the delayed scale lags and some values saturate
    xs = [((-2.3 + 0.5 * torch.randn(3, 7, H, generator=gen)) * 2.0**i / 8).to(device, dtype) for i in range(steps)]
    extras = [torch.randn(3, 7, H, generator=gen).to(device, dtype) for _ in range(steps)] if kind == "add" else []
    recipe = te.recipe.DelayedScaling(amax_history_len=3)
    calls = _count_epilogue_casts(monkeypatch)
    with te.autocast(enabled=False, backend=backend_name):
        got = _steps(fused, xs, recipe, backward, extras)
        assert len(calls) == steps - 1, "the first call seeds the fresh quantizer; every later one hands FP8 over"
        with _without_hand_off():
            want = _steps(plain, xs, recipe, backward, extras)
    assert rule in fused.fusion_plan().rules(), fused.fusion_plan()
    assert "ForwardLinearBiasLinear" not in plain.fusion_plan()
    _assert_identical(got, want, f"{kind} {dtype} {backend_name}")


def test_dequantized_backward_hands_off_and_high_precision_declines(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    xs = [representable(5, H, generator=gen, scale_exp=-3) for _ in range(3)]
    recipe = te.recipe.DelayedScaling(backward_override="dequantized")
    fused = _model("bias", torch.float32, gen)
    plain = copy.deepcopy(fused)
    calls = _count_epilogue_casts(monkeypatch)
    got = _steps(fused, xs, recipe, True)
    assert len(calls) == 2 and "forward_linear_bias_linear_bias" in fused.fusion_plan().rules()
    with _without_hand_off():
        want = _steps(plain, xs, recipe, True)
    _assert_identical(got, want, "dequantized")
    _steps(fused, xs, recipe.replace(backward_override="high_precision"), True)
    plan = fused.fusion_plan()
    assert "ForwardLinearBiasLinear" not in plan
    assert "declined: forward_linear_bias_linear_bias at ops 0..3: backward_override='high_precision'" in plan


def test_activation_declines_with_a_backward_and_fires_without():
    gen = torch.Generator().manual_seed(13)
    model = _model("gelu", torch.float32, gen)
    x = representable(4, H, generator=gen, scale_exp=-3)
    recipe = te.recipe.DelayedScaling()
    _steps(model, [x], recipe, True)
    plan = model.fusion_plan()
    assert "declined: forward_linear_bias_activation_linear_bias at ops 0..4: the activation's backward" in plan
    assert "[rule forward_linear_bias_activation]" in plan and "ForwardLinearBiasLinear" not in plan
    _steps(model, [x], recipe, False)
    assert "forward_linear_bias_activation_linear_bias" in model.fusion_plan().rules()


def test_rules_see_whether_the_plan_needs_a_backward():
    """The predicate reads the plan's needs_backward (the build context), not the
    grad mode the plan happens to be built in."""
    model = _model("gelu", torch.float32, torch.Generator().manual_seed(16))
    x = representable(4, H, scale_exp=-3)
    recipe = te.recipe.DelayedScaling()
    model.prepare(x, recipe=recipe, needs_backward=False)  # grad mode is on here
    assert "forward_linear_bias_activation_linear_bias" in model.fusion_plan().rules()
    model.prepare(x.requires_grad_(), recipe=recipe, needs_backward=True)
    assert "the activation's backward needs the pre-activation" in model.fusion_plan()


def test_declines_where_the_gemm_and_the_epilogue_run_on_different_backends(monkeypatch):
    """Under auto on a GPU the GEMM is cuBLASLt's and the fused cast epilogue Triton's
    (slower than cuBLASLt plus a separate cast): the hand-off declines, saying so."""
    real_resolve = backend.resolve

    def resolve(kernel, device, backend_name=None):
        choice = real_resolve(kernel, device, backend_name)
        if kernel == "gemm":
            return backend.KernelChoice(kernel, "cuda", choice.fn)
        return choice

    monkeypatch.setattr(backend, "resolve", resolve)
    gen = torch.Generator().manual_seed(15)
    model = _model("bias", torch.float32, gen)
    _steps(model, [representable(4, H, generator=gen, scale_exp=-3)] * 2, te.recipe.DelayedScaling(), True)
    plan = model.fusion_plan()
    assert "the GEMM runs on the cuda backend and the fused cast epilogue only on reference" in plan
    assert "ForwardLinearBiasLinear" not in plan


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "block", "none"])
def test_other_recipes_do_not_try_the_hand_off(recipe_name):
    """The next input's scale is not known before the GEMM: no rule fires, and the
    plan is not crowded with the same decline (see the rules' ``applies_to``)."""
    from op_testing import RECIPES

    model = _model("bias", torch.float32, torch.Generator().manual_seed(14))
    _steps(model, [representable(32, H, scale_exp=-3)] * 2, RECIPES[recipe_name], False)
    plan = model.fusion_plan()
    assert "[rule forward_linear_bias]" in plan
    assert "forward_linear_bias_linear" not in plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_epilogue_cast_equals_a_call(dtype):
    gen = torch.Generator().manual_seed(15)
    q = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    assert q.epilogue_cast(torch.device("cpu")) is None, "a fresh quantizer seeds its scale from the tensor first"
    q(torch.randn(6, 10, generator=gen).to(dtype))
    q_call, q_epi = copy.deepcopy(q), copy.deepcopy(q)
    x = (torch.randn(2, 3, 10, generator=gen) * 40).to(dtype)  # beyond the lagging scale: saturates
    want = q_call(x, rowwise=True, columnwise=True)
    cast = q_epi.epilogue_cast(x.device)
    data, _, _ = ref.quantize_tensorwise_reference(x.reshape(6, 10), cast.scale, cast.fp8_dtype, amax_out=cast.amax)
    got = q_epi.adopt_epilogue_cast(cast, data, x.shape, dtype, columnwise=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_bitwise(got.rowwise.data, want.rowwise.data, "rowwise")
    assert_bitwise(got.columnwise.data, want.columnwise.data, "columnwise (transposed bytes)")
    assert_bitwise(got.rowwise.scale_inv, want.rowwise.scale_inv, "scale_inv")
    for name, value in q_call.state_dict().items():
        other = q_epi.state_dict()[name]
        assert (torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value), name
    assert Float8CurrentScalingQuantizer(E4M3).epilogue_cast(torch.device("cpu")) is None


def test_backends_know_the_kernel():
    assert "gemm_fp8_out" in backend.KERNELS
    assert backend.resolve("gemm_fp8_out", "cpu", backend="auto").backend == "reference"
    if torch.cuda.is_available():  # compiled Triton: CUDA tensors only
        assert backend.resolve("gemm_fp8_out", "cuda", backend="triton").backend == "triton"
    else:  # the interpreter runs Triton on CPU tensors
        assert backend.resolve("gemm_fp8_out", "cpu", backend="triton").backend == "triton"
    # the cuda backend has no such kernel: it falls back to triton where triton runs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert backend._fallback("gemm_fp8_out", "cuda", device).backend == "triton"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decline is the GPU's")
def test_a_training_step_on_the_gpu_declines_the_hand_off():
    """With a backward, wgrad needs the FP8 input transposed: after the epilogue that
    is a separate byte transpose, which measured slower than the separate cast."""
    gen = torch.Generator().manual_seed(14)
    model = _model("bias", torch.bfloat16, gen).cuda()
    x = representable(4, H, generator=gen, scale_exp=-3).cuda().bfloat16()
    with te.autocast(enabled=False, backend="triton"):
        _steps(model, [x, x], te.recipe.DelayedScaling(), True)
    plan = model.fusion_plan()
    assert "ForwardLinearBiasLinear" not in plan
    assert "declined: forward_linear_bias_linear_bias at ops 0..3: a backward follows" in plan, plan


# -- current scaling: the activation kernel's amax handed to the second linear's cast ----------

AMAX_RULES = [r.name for r in DEFAULT_RULES if r.name.startswith("forward_activation_amax_")]
AMAX_CASES = [  # (model, rule expected to fire)
    ("gelu", "forward_activation_amax_linear_bias"),
    ("swiglu_gelu", "forward_activation_amax_linear_bias_activation"),
]


def _amax_models(kind: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    fused = _model(kind, dtype, gen)
    xs = [((-2.3 + 0.5 * torch.randn(3, 7, H, generator=gen)) * 2.0**i / 8).to(dtype) for i in range(2)]
    return fused, copy.deepcopy(fused), xs


def _amax_models_for(backend_name: str, kind: str, seed: int, dtype: torch.dtype = torch.bfloat16):
    """:func:`_amax_models` on the backend's device (Triton's: a GPU where one is)."""
    device = "cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu"
    fused, plain, xs = _amax_models(kind, dtype, seed)
    return fused.to(device), plain.to(device), [x.to(device) for x in xs]


def _count_given_amax_casts(monkeypatch) -> list:
    """The tensor types of the quantizers that cast with an amax given, call by call."""
    calls = []
    inner = Float8CurrentScalingQuantizer.cast_given_amax

    def counting(self, *args, **kwargs):
        calls.append(self.role.tensor_type)
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(Float8CurrentScalingQuantizer, "cast_given_amax", counting)
    return calls


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("kind,rule", AMAX_CASES)
def test_amax_hand_off_is_bit_identical_to_the_separate_cast(monkeypatch, kind, rule, backend_name):
    """Training under current scaling: the activation kernel reduces its output's amax
    and the second linear casts with it given; outputs and gradients are those of
    the plan without the rule, bit for bit (on the Triton backend under the
    interpreter on the CPU, compiled on a GPU)."""
    fused, plain, xs = _amax_models_for(backend_name, kind, 21)
    recipe = te.recipe.Float8CurrentScaling()
    calls = _count_given_amax_casts(monkeypatch)
    with te.autocast(enabled=False, backend=backend_name):
        got = _steps(fused, xs, recipe, True)
        assert calls.count("input") == len(xs), "every training step's hidden tensor is cast with its amax given"
        with rules.without_fusion_rules(*AMAX_RULES):
            want = _steps(plain, xs, recipe, True)
    assert calls.count("input") == len(xs)
    assert rule in fused.fusion_plan().rules(), fused.fusion_plan()
    assert "ForwardLinearBiasLinear" not in plain.fusion_plan()
    _assert_identical(got, want, f"{kind} current {backend_name}")


def test_amax_hand_off_declines_without_a_backward_and_with_a_high_precision_one():
    fused, _, xs = _amax_models("gelu", torch.float32, 22)
    recipe = te.recipe.Float8CurrentScaling()
    _steps(fused, xs[:1], recipe, False)
    plan = fused.fusion_plan()
    assert "declined: forward_activation_amax_linear_bias at ops 0..4: no backward follows" in plan, plan
    _steps(fused, xs[:1], recipe.replace(backward_override="high_precision"), True)
    assert "declined: forward_activation_amax_linear_bias at ops 0..4: backward_override='high_precision'" in \
        fused.fusion_plan()
    _steps(fused, xs[:1], te.recipe.DelayedScaling(), True)  # not tried: the delayed rules decline instead
    assert "forward_activation_amax" not in fused.fusion_plan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("kind,per_step", [("gelu", 1), ("swiglu_gelu", 2)])
def test_the_backward_hands_the_gradient_amax_to_its_cast(monkeypatch, kind, per_step, backend_name, dtype):
    """The backward's twin: ``Linear -> Bias -> activation``'s fused backward reduces
    the amax of the gradient its ``dact_dbias`` pass writes and the linear's
    grad-output quantizer casts with it given; outputs, gradients and states are
    those of the same plan casting the gradient itself, bit for bit (a bf16 and an
    fp32 model: the gradient cast as the pass wrote it)."""
    import te_fuser.ops.fused.backward_linear_bias_activation as backward_module

    fused, plain, xs = _amax_models_for(backend_name, kind, 25, dtype)
    recipe = te.recipe.Float8CurrentScaling()
    calls = _count_given_amax_casts(monkeypatch)
    with te.autocast(enabled=False, backend=backend_name):
        got = _steps(fused, xs, recipe, True)
        # each Linear -> Bias -> activation's gradient, every step
        assert calls.count("grad_output") == per_step * len(xs), calls
        monkeypatch.setattr(backward_module, "_grad_amax_slot", lambda ctx, dy: None)
        want = _steps(plain, xs, recipe, True)
    assert calls.count("grad_output") == per_step * len(xs)
    assert "backward_linear_bias_activation" in fused.fusion_plan().rules(), fused.fusion_plan()
    _assert_identical(got, want, f"{kind} current backward {backend_name}")


@pytest.mark.parametrize("recipe_name", ["delayed", "block"])
def test_the_backward_casts_the_gradient_itself_under_other_recipes(monkeypatch, recipe_name):
    """Only a quantizer that casts with an amax given takes one: delayed scaling (its
    scale known before the tensor) and block scaling reduce nothing in the pass."""
    from op_testing import RECIPES

    fused, _, xs = _amax_models("gelu", torch.bfloat16, 26)
    calls = _count_given_amax_casts(monkeypatch)
    _steps(fused, xs[:1], RECIPES[recipe_name], True)
    assert calls == []
    assert "backward_linear_bias_activation" in fused.fusion_plan().rules(), fused.fusion_plan()


def test_cast_given_amax_equals_the_cast():
    gen = torch.Generator().manual_seed(23)
    x = (torch.randn(9, 40, generator=gen) * 3).to(torch.bfloat16)
    q = Float8CurrentScalingQuantizer(E4M3, power_2_scales=True, amax_epsilon=1e-3)
    want = q.cast(x, rowwise=True, columnwise=True)
    got = q.cast_given_amax(x, x.float().abs().amax().reshape(1), rowwise=True, columnwise=True)
    assert_bitwise(got.rowwise.data.view(torch.uint8), want.rowwise.data.view(torch.uint8), "row-wise bytes")
    assert_bitwise(got.columnwise.data.view(torch.uint8), want.columnwise.data.view(torch.uint8), "column-wise bytes")
    assert_bitwise(got.rowwise.scale_inv.reshape(()), want.rowwise.scale_inv.reshape(()), "scale_inv")
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_the_fused_activation_saves_its_input_as_the_op_does(recipe_name):
    """``cache_quantized_input``: the activation's backward reads its input through
    FP8 in the fused forwards (ForwardLinearBiasActivation, the amax hand-off) as in
    the op's own forward: the same gradients as the plan without fusion, bit for bit."""
    from op_testing import RECIPES

    gen = torch.Generator().manual_seed(24)
    fused = te.ops.Sequential(te.ops.Linear(H, F), te.ops.GELU(cache_quantized_input=True), te.ops.Linear(F, H))
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -3))
    plain = te.ops.Sequential(*copy.deepcopy(list(fused)), fuse=False)
    xs = [representable(3, 7, H, generator=gen, scale_exp=-1) for _ in range(2)]
    got = _steps(fused, xs, RECIPES[recipe_name], True)
    want = _steps(plain, xs, RECIPES[recipe_name], True)
    _assert_identical(got, want, f"cache_quantized_input {recipe_name}")
    assert fused.fusion_plan().rules() and not plain.fusion_plan().rules()
