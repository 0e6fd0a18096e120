"""Training as users train: fused AdamW, fp32 master weights under
``torch.autocast(bfloat16)``, validation between phases, recipe switches.

FP8 runs end within the tolerance table's band of the bf16 run, evaluated in
bf16 and under their own recipe; a mid-training switch moves the loss no more
than the step-to-step noise of a run that never switched."""

from __future__ import annotations

import io

import pytest
import torch

import te_fuser as te
from te_fuser import recipe as R
from tolerances import tolerance

H, F, BATCH, STEPS = 64, 128, 64, 100
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the Triton and CUDA kernels
FP8 = {
    "delayed": R.DelayedScaling(amax_history_len=16),
    "current": R.Float8CurrentScaling(),
    "block": R.Float8BlockScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
}


def teacher():
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, H)).to(DEVICE)


TEACHER = teacher()


def data(step: int, rows: int = BATCH):
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(step)).to(DEVICE)
    with torch.no_grad():
        return x, TEACHER(x)


VALIDATION = [data(10_000 + i, 128) for i in range(4)]


def student(dtype: torch.dtype = torch.float32):
    """fp32 master weights by default; ``dtype=torch.bfloat16``: a model held in bf16
    (its bias gradients come from the gradient casts in bf16)."""
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(),
                             te.ops.Linear(F, H)).to(DEVICE, dtype)


def loss_of(model, x, y, recipe):
    with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def validate(model, recipe) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(loss_of(model, x, y, recipe).item() for x, y in VALIDATION) / len(VALIDATION)
    model.train()
    return total


def train(schedule: list[tuple[str, int]], resume_after: int | None = None, dtype: torch.dtype = torch.float32):
    """Train through ``schedule`` ([(recipe name or 'bf16', steps)]); returns the
    per-step losses and the model. Validates in bf16 after every phase; after phase
    ``resume_after``, saves a checkpoint and goes on from it in a new model and
    optimizer. ``dtype``: the parameters' (see :func:`student`)."""
    model = student(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    losses, step = [], 0
    for phase, (name, steps) in enumerate(schedule):
        if phase == resume_after:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False, map_location=DEVICE)
            model = student(dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        recipe = FP8.get(name)
        for _ in range(steps):
            loss = loss_of(model, *data(step), recipe)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        validate(model, None)  # an evaluation pass between phases, as a user's loop does
    return losses, model


BF16_LOSSES, BF16_MODEL = None, None


def _bf16_run():
    global BF16_LOSSES, BF16_MODEL
    if BF16_LOSSES is None:
        BF16_LOSSES, BF16_MODEL = train([("bf16", STEPS)])
    return BF16_LOSSES, BF16_MODEL


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_training_ends_within_the_band_of_bf16_evaluated_in_bf16_and_in_fp8(name):
    _, reference = _bf16_run()
    target = validate(reference, None)
    losses, model = train([(name, STEPS)])
    assert losses[-1] < 0.5 * losses[0], f"{name}: did not train ({losses[0]:.4f} -> {losses[-1]:.4f})"
    assert_within_band(model, target, [("bf16", None), (name, FP8[name])])


def assert_no_spike(schedule, switched: list[float], plain: list[float]) -> None:
    """No switch of ``schedule`` raises the loss by more than the unswitched run's
    (``plain``) largest step-to-step change past its first ten steps."""
    noise = max(abs(b - a) for a, b in zip(plain[10:], plain[11:]))
    step = 0
    for name, steps in schedule[:-1]:
        step += steps
        jump = switched[step] - switched[step - 1]
        assert jump <= noise, (
            f"switch after {name} at step {step}: the loss rose by {jump:.5f}, the unswitched run's largest "
            f"step-to-step change is {noise:.5f} ({switched[step - 1]:.5f} -> {switched[step]:.5f})"
        )


def assert_within_band(model, target: float, evaluations) -> None:
    """``model``'s validation loss under each of ``evaluations`` ((name, recipe or
    None)) is within the FP8 band of ``target``."""
    for evaluated_in, recipe in evaluations:
        got = validate(model, recipe)
        rtol = tolerance(torch.float8_e4m3fn)["rtol"]
        assert abs(got - target) <= rtol * target, (
            f"evaluated in {evaluated_in}: validation loss {got:.5f} against bf16's {target:.5f} "
            f"(band {rtol:.3f} relative)")


def test_a_switch_schedule_has_no_loss_spike():
    plain, _ = _bf16_run()
    schedule = [("bf16", 20), ("delayed", 20), ("current", 20), ("block", 15), ("mxfp8", 15), ("bf16", 10)]
    switched, model = train(schedule)
    assert_no_spike(schedule, switched, plain)
    assert_within_band(model, validate(BF16_MODEL, None), [("bf16", None)])


def test_switching_back_to_recipes_seen_before_holds_loss_parity():
    """Switches back to recipes seen before (their plans come from kept templates,
    their quantizers are fresh copies) through a checkpoint resumed mid-way: no
    switch moves the loss more than the unswitched run's step-to-step noise, and
    the run ends within the band of bf16, evaluated in bf16 and under its recipe."""
    plain, _ = _bf16_run()
    schedule = [("bf16", 15), ("delayed", 15), ("current", 15), ("delayed", 15), ("current", 15), ("delayed", 25)]
    switched, model = train(schedule, resume_after=3)
    assert_no_spike(schedule, switched, plain)
    assert_within_band(model, validate(BF16_MODEL, None), [("bf16", None), ("delayed", FP8["delayed"])])


def test_a_model_held_in_bf16_switches_without_a_spike_and_ends_within_the_band():
    """A model held in bf16 (no fp32 masters; fused AdamW on bf16 parameters, the bias
    gradients as the gradient casts return them in bf16) through bf16, delayed,
    current, back to delayed (a checkpoint resumed before it) and bf16: no switch
    moves the loss past its own unswitched run's step-to-step noise, and it ends
    within the FP8 band of that run, evaluated in bf16 and under current scaling."""
    plain, reference = train([("bf16", 80)], dtype=torch.bfloat16)
    schedule = [("bf16", 15), ("delayed", 20), ("current", 20), ("delayed", 15), ("bf16", 10)]
    switched, model = train(schedule, resume_after=3, dtype=torch.bfloat16)
    assert all(p.dtype is torch.bfloat16 for p in model.parameters())
    assert switched[-1] < 0.5 * switched[0], f"did not train ({switched[0]:.4f} -> {switched[-1]:.4f})"
    assert_no_spike(schedule, switched, plain)
    assert_within_band(model, validate(reference, None), [("bf16", None), ("current", FP8["current"])])


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_a_switch_of_a_model_held_in_bf16_trains_as_a_fresh_model_on_the_recipe(name):
    """A model held in bf16 switched after bf16 steps trains bit for bit as a new
    model and optimizer given its weights and optimizer state (a checkpoint resumed
    at the switch) and trained on the recipe from there."""
    switched, model = train([("bf16", 10), (name, 12)], dtype=torch.bfloat16)
    fresh, fresh_model = train([("bf16", 10), (name, 12)], resume_after=1, dtype=torch.bfloat16)
    assert switched == fresh
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def _state(model) -> list[torch.Tensor]:
    """The parameters and every delayed-scaling state tensor."""
    out = [p.detach().clone() for p in model.parameters()]
    for module in model.modules():
        for q in getattr(module, "installed_quantizers", {}).values():
            out += [t.clone() for t in getattr(q, "state_tensors", dict)().values()]
    return out


@pytest.mark.parametrize("name", list(FP8))
def test_validating_under_inference_mode_trains_as_validating_under_no_grad(name):
    """Validation between steps under the training recipe, as a user's loop
    validates: under ``torch.inference_mode()``, under ``torch.no_grad()``, or not
    at all. The FP8 weight casts kept for the unchanged weights and the scaling
    state a validation touches must not leak inference tensors into the next
    training step (which would raise when saved for backward) nor change what it
    computes: the three loops give the same losses, parameters and delayed-scaling
    state, bit for bit."""
    recipe = FP8[name]

    def run(grad_mode):
        model = student()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=DEVICE == "cuda")
        losses = []
        for step in range(6):
            if grad_mode is not None and step % 2 == 0:  # before the step, on the weights it will read
                model.eval()
                with grad_mode():
                    for x, y in VALIDATION[:2]:
                        loss_of(model, x, y, recipe)
                model.train()
            loss = loss_of(model, *data(step), recipe)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return torch.stack(losses), _state(model)

    plain, no_grad, inference = run(None), run(torch.no_grad), run(torch.inference_mode)
    if name == "delayed":  # the histories, scales and counts are compared too
        assert len(plain[1]) > len(list(student().parameters()))
    for other in (no_grad, inference):
        assert torch.equal(other[0], plain[0])
        assert len(other[1]) == len(plain[1])
        assert all(torch.equal(a, b) for a, b in zip(other[1], plain[1]))


def test_calibration_records_in_evaluation_mode_and_an_fp8_evaluation_does_not():
    """``te.autocast(enabled=False, calibrating=True)`` on a model in evaluation mode
    (calibrating a trained model for inference) records each amax; an FP8 forward in
    evaluation mode afterwards casts with the calibrated scales and records nothing."""
    model = student().eval()
    recipe = R.DelayedScaling(amax_history_len=4)
    x = data(0)[0]
    with torch.no_grad(), te.autocast(enabled=False, calibrating=True, recipe=recipe):
        model(x)
    calibrated = _state(model)
    n_params = len(list(model.parameters()))
    assert len(calibrated) > n_params
    histories = [t for t in calibrated[n_params:] if t.dim() == 1 and t.numel() == 4]
    assert histories and all(h[0] > 0 for h in histories[:2]), histories
    with torch.no_grad(), te.autocast(recipe=recipe):
        model(x)
    assert all(torch.equal(a, b) for a, b in zip(_state(model), calibrated, strict=True))


def test_calibrating_a_model_trained_under_another_recipe_installs_what_it_records():
    """A model trained under current scaling, then calibrated for delayed scaling in
    evaluation mode and evaluated under it: the calibration installs its quantizers
    (an evaluation under another recipe keeps its own, a calibration does not), so
    the evaluation casts with the calibrated scales, bit for bit as a model with the
    same weights that was never trained under another recipe."""
    recipe = R.DelayedScaling(amax_history_len=4)
    model = student()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=DEVICE == "cuda")
    for step in range(2):
        loss_of(model, *data(step), FP8["current"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    twin = student()
    twin.load_state_dict(model.state_dict())
    x = data(0)[0]
    outputs = []
    for m in (model, twin):
        m.eval()
        with torch.no_grad(), te.autocast(enabled=False, calibrating=True, recipe=recipe):
            m(x)
        with torch.no_grad(), te.autocast(recipe=recipe):
            outputs.append(m(x))
        assert "quantizers=private" not in str(m.fusion_plan())
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(_state(model), _state(twin), strict=True))


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_an_ema_copy_evaluates_under_the_recipe_as_in_bf16(name):
    """An exponential moving average of the weights (``torch.optim.swa_utils``'s
    ``AveragedModel``, a deep copy updated after every step), validated under the
    recipe as users validate one: its loss is the one it has in bf16 within the
    tolerance table's band, and its delayed-scaling state stays the one it was
    copied with (an evaluation records nothing)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    recipe = FP8[name]
    model = student()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=DEVICE == "cuda")
    for step in range(3):  # a few steps first, so the copy holds seeded delayed-scaling state
        loss_of(model, *data(step), recipe).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    copied = _state(ema.module)
    for step in range(3, 20):
        loss_of(model, *data(step), recipe).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update_parameters(model)
    in_fp8, in_bf16 = validate(ema.module, recipe), validate(ema.module, None)
    band = tolerance(torch.float8_e4m3fn)["rtol"] * in_bf16
    assert abs(in_fp8 - in_bf16) <= band, (in_fp8, in_bf16)
    n_params = len(list(ema.module.parameters()))
    assert name != "delayed" or len(copied) > n_params
    assert all(torch.equal(a, b) for a, b in zip(_state(ema.module)[n_params:], copied[n_params:], strict=True))


def _run_interrupted(recipe_at, interrupt=None, steps: int = 6):
    """``steps`` AdamW steps, step ``i`` under ``recipe_at(i)``, with
    ``interrupt(model, i)`` before each when given (a validation, gradients taken in
    evaluation mode): ``(losses, _state(model))``."""
    model = student()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=DEVICE == "cuda")
    losses = []
    for step in range(steps):
        if interrupt is not None:
            interrupt(model, step)
        loss = loss_of(model, *data(step), recipe_at(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), _state(model)


@pytest.mark.parametrize("trained, validated", [
    ("delayed", "current"), ("delayed", "block"), ("delayed", "mxfp8"), ("delayed", "delayed_other"),
    ("current", "delayed"),
])
def test_validating_under_another_recipe_leaves_training_as_it_was(trained, validated):
    """Validation under another recipe than training's (to see how the model fares
    in it) between training steps: the training run's losses, parameters and
    delayed-scaling state are those of a run that never validated, bit for bit. The
    evaluation casts with its own quantizers and leaves the installed ones as they
    are; before, its plan installed its recipe's, and training's delayed-scaling
    history started over (or, from another delayed recipe, came back resized)."""
    recipes = {**FP8, "delayed_other": R.DelayedScaling(amax_history_len=2, margin=1)}
    recipe, other = recipes[trained], recipes[validated]

    def validating(model, step):
        if step in (2, 4):
            validate(model, other)

    plain, validated_run = _run_interrupted(lambda step: recipe), _run_interrupted(lambda step: recipe, validating)
    if trained == "delayed":  # the report says so while the evaluation's plan is the published one
        model = student()
        loss_of(model, *data(0), recipe).backward()
        validate(model, other)
        assert "quantizers=private" in str(model.fusion_plan())
    assert torch.equal(validated_run[0], plain[0])
    assert len(validated_run[1]) == len(plain[1])
    assert trained != "delayed" or len(plain[1]) > len(list(student().parameters()))
    assert all(torch.equal(a, b) for a, b in zip(validated_run[1], plain[1]))


def test_a_switch_after_validating_under_its_recipe_is_a_switch():
    """Training delayed -> validating under current scaling -> training under current
    scaling: the switch gives the losses and parameters of a run that switched
    without the validation (a fresh model's quantizers on the target recipe)."""

    def recipe_at(step):
        return FP8["delayed"] if step < 3 else FP8["current"]

    def validating(model, step):
        if step == 3:
            validate(model, FP8["current"])

    plain, validated = _run_interrupted(recipe_at), _run_interrupted(recipe_at, validating)
    assert torch.equal(validated[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(validated[1], plain[1], strict=True))


@pytest.mark.parametrize("validated", ["delayed", "current"])
def test_a_backward_in_evaluation_mode_leaves_training_as_it_was(validated):
    """Gradients taken in evaluation mode between training steps (a saliency map, an
    input attack on the model being trained), under training's delayed recipe or
    another: the backward of an evaluation records nothing, as its forward does, so
    the training run's losses, parameters and delayed-scaling state are those of a
    run without them, bit for bit (the backward's gradient casts had recorded into
    training's histories)."""
    recipe, other = FP8["delayed"], FP8[validated]

    def probing(model, step):
        if step in (2, 4):
            model.eval()
            x = VALIDATION[0][0].clone().requires_grad_()
            with torch.autocast(DEVICE, dtype=torch.bfloat16), te.autocast(recipe=other):
                saliency = torch.autograd.grad(model(x).float().sum(), x)[0]
            assert torch.isfinite(saliency).all()
            model.train()

    plain, probed = _run_interrupted(lambda step: recipe), _run_interrupted(lambda step: recipe, probing)
    assert torch.equal(probed[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(probed[1], plain[1], strict=True))


def test_parameter_gradients_in_evaluation_mode_under_delayed_scaling_warn_once(monkeypatch):
    """Training with the model left in evaluation mode (a forgotten model.train(), or
    eval mode to switch dropout off) under delayed scaling: the histories do not move,
    so the first such backward warns, naming model.train(); once a process. Input
    gradients alone and current scaling do not warn."""
    import warnings

    from te_fuser.ops import fuser as fuser_module

    monkeypatch.setattr(fuser_module, "_EVAL_BACKWARD_WARNED", [])
    model = student().eval()
    x = data(0)[0].clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_of(model, x, data(0)[1], FP8["current"]).backward()
        model.requires_grad_(False)
        loss_of(model, x, data(0)[1], FP8["delayed"]).backward()
        model.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"evaluation mode.*records no amax.*model\.train\(\)"):
        loss_of(model, x, data(0)[1], FP8["delayed"]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_of(model, x, data(0)[1], FP8["delayed"]).backward()
