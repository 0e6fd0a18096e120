"""FP8 parameters (te.quantized_model_init) as users train them: torch optimizers
(fused, foreach and for-loop AdamW, SGD) update the master copies; the weights'
memory is measured; recipe switches, checkpoints and writes never leave a stale
FP8 weight."""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import FP8_RECIPES
from te_fuser.ops.fp8_parameters import fp8_model_init, master_of, parameter_bytes, quantized_model_init
from te_fuser.quantization.float8_tensor import Float8Tensor

_OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, foreach=True),
    "adamw_forloop": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _model(hidden=64, ffn=192, dtype=torch.float32):
    return te.ops.Sequential(te.ops.Linear(hidden, ffn, dtype=dtype), te.ops.GELU(),
                             te.ops.Linear(ffn, hidden, dtype=dtype))


def _fp8_model(recipe, seed=0, **kw):
    torch.manual_seed(seed)
    with quantized_model_init(enabled=True, recipe=recipe):
        return _model(**kw)


def _twin(fp8_model, dtype=torch.float32):
    """A high-precision model whose weights are the FP8 model's values (or masters)."""
    ref = _model(dtype=dtype)
    with torch.no_grad():
        for p_ref, p in zip(ref.parameters(), fp8_model.parameters()):
            src = p if type(p) is not Float8Tensor else (master_of(p) if master_of(p) is not None else p.dequantize())
            p_ref.copy_(src.reshape(p_ref.shape))
    return ref


def _batches(n, seed=1):
    """``n`` batches of one task (a fixed linear map plus noise), so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    task = torch.randn(64, 64, generator=gen) / 8
    xs = [torch.randn(32, 64, generator=gen) for _ in range(n)]
    return [(x, x @ task + 0.01 * torch.randn(32, 64, generator=gen)) for x in xs]


def _train(model, optimizer, batches, recipe):
    losses = []
    for x, target in batches:
        with te.autocast(recipe=recipe):
            loss = (model(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_linears_made_inside_hold_fp8_weights_and_outside_do_not():
    model = _fp8_model(FP8_RECIPES["current"])
    assert type(model[0].linear.weight) is Float8Tensor and isinstance(model[0].linear.weight, torch.nn.Parameter)
    assert model[0].linear.weight.dtype is torch.float32 and model[0].linear.weight.requires_grad
    assert type(model[0].bias_op.bias) is torch.nn.Parameter  # biases stay high precision
    with quantized_model_init(enabled=False):
        assert type(_model()[0].linear.weight) is torch.nn.Parameter
    with pytest.warns(DeprecationWarning):
        with fp8_model_init(enabled=True, recipe=FP8_RECIPES["current"]):
            assert type(_model()[0].linear.weight) is Float8Tensor


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "block"])
def test_training_is_bit_identical_to_fp32_masters_under_the_same_recipe(recipe_name, optimizer):
    """FP8 weights cast from the master every step are exactly what a model with
    fp32 weights casts in its forward: the two trainings agree bit for bit."""
    recipe = FP8_RECIPES[recipe_name]
    model = _fp8_model(recipe)
    ref = _twin(model)
    batches = _batches(6)
    opt, ref_opt = _OPTIMIZERS[optimizer](model.parameters()), _OPTIMIZERS[optimizer](ref.parameters())
    got = _train(model, opt, batches, recipe)
    want = _train(ref, ref_opt, batches, recipe)
    assert got == want, f"recipe={recipe_name} optimizer={optimizer}: losses {got} != {want}"
    assert got[-1] < got[0]
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        hp = master_of(p) if type(p) is Float8Tensor else p
        assert torch.equal(hp.reshape(p_ref.shape), p_ref.detach()), f"{optimizer}: the master is the fp32 weight"


def test_delayed_scaling_trains_with_loss_parity_against_high_precision():
    recipe = FP8_RECIPES["delayed"]
    model = _fp8_model(recipe)
    ref = _twin(model)
    batches = _batches(20)
    got = _train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), batches, recipe)
    want = _train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3), batches, None)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 0.05 * b, f"step {i}: FP8 parameters' loss {a} vs high precision {b}"
    assert got[-1] < 0.8 * got[0]


def test_weight_memory_is_about_half_of_bf16_weights():
    recipe = FP8_RECIPES["current"]
    hidden, ffn = 256, 1024
    fp8 = _fp8_model(recipe, hidden=hidden, ffn=ffn)
    bf16 = _model(hidden, ffn, dtype=torch.bfloat16)
    weights_fp8 = sum(p.fp8_nbytes for p in fp8.parameters() if type(p) is Float8Tensor)
    weights_bf16 = sum(m.linear.weight.untyped_storage().nbytes() for m in (bf16[0], bf16[2]))
    assert weights_bf16 == 2 * 2 * hidden * ffn
    assert weights_fp8 == 2 * hidden * ffn + 2 * 4  # one byte an element, one fp32 scale a weight
    assert 0.49 <= weights_fp8 / weights_bf16 <= 0.51
    # the whole model (fp32 biases included) under the bf16 model's bytes by about half
    assert parameter_bytes(fp8) < 0.52 * parameter_bytes(bf16)


def test_the_master_lives_in_the_optimizer_state_and_no_high_precision_weight_in_the_model():
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = parameter_bytes(model)
    _train(model, optimizer, _batches(2), recipe)
    assert parameter_bytes(model) == before
    for p in model.parameters():
        if type(p) is Float8Tensor:
            master = optimizer.state[p]["master"]
            assert master is master_of(p) and master.dtype is torch.float32 and master.grad is None
    assert all(type(p) in (Float8Tensor, torch.nn.Parameter) for g in optimizer.param_groups for p in g["params"])


def test_a_recipe_switch_mid_training_matches_a_fresh_model_on_the_target_recipe():
    first, target = FP8_RECIPES["current"], FP8_RECIPES["mxfp8"]
    model = _fp8_model(first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = _batches(8)
    _train(model, optimizer, batches[:4], first)
    # a fresh model on the target recipe with the same weights (the masters) and optimizer state
    fresh = _fp8_model(target)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    with torch.no_grad():
        for p_new, p in zip(fresh.parameters(), model.parameters()):
            hp = master_of(p) if type(p) is Float8Tensor else p
            p_new.copy_(hp.reshape(p_new.shape))
    fresh_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    got = _train(model, optimizer, batches[4:], target)
    want = _train(fresh, fresh_opt, batches[4:], target)
    assert got == want, f"after the switch {got} != a fresh model's {want}"
    assert model[0].linear.weight.fp8_storage.q.scaling == fresh[0].linear.weight.fp8_storage.q.scaling


def test_a_checkpoint_round_trips_weights_masters_and_training(tmp_path):
    """Saved to a file and read back with torch.load's defaults (weights_only): the
    FP8 bytes, the masters and training go on as before; a model without FP8
    parameters loads the same file as the FP8 values."""
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = _batches(6)
    _train(model, optimizer, batches[:3], recipe)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
    ckpt = torch.load(path)
    plain = _model()
    plain.load_state_dict(ckpt["model"])
    assert torch.equal(plain[0].linear.weight, model[0].linear.weight.dequantize())
    restored = _fp8_model(recipe, seed=123)  # other initial weights
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=3e-3)
    restored.load_state_dict(ckpt["model"])
    restored_opt.load_state_dict(ckpt["optim"])
    w, w2 = model[0].linear.weight, restored[0].linear.weight
    assert torch.equal(w.fp8_storage.q.rowwise.data.view(torch.uint8), w2.fp8_storage.q.rowwise.data.view(torch.uint8))
    assert _train(restored, restored_opt, batches[3:], recipe) == _train(model, optimizer, batches[3:], recipe)


def test_no_stale_weight_after_a_step_the_forward_reads_the_updated_weight():
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, target = _batches(1)[0]
    with te.autocast(recipe=recipe):
        y0 = model(x)
    (y0 - target).square().mean().backward()
    optimizer.step()
    with te.autocast(recipe=recipe):
        y1 = model(x)
    with te.autocast(recipe=recipe):
        y_ref = _twin(model)(x)  # a model with the stepped masters as plain weights
    assert not torch.equal(y1, y0)
    assert torch.equal(y1, y_ref)


@pytest.mark.parametrize("how", ["copy_", "data_copy_", "load_state_dict"])
def test_a_write_to_the_weight_is_what_the_next_forward_and_step_use(how):
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(3)
    _train(model, optimizer, batches[:1], recipe)
    w = model[0].linear.weight
    ref = _twin(model)  # the masters as plain weights; the written one is set below
    new = torch.full(w.shape, 0.0625) + 0.01 * torch.randn(w.shape)
    with torch.no_grad():
        if how == "copy_":
            w.copy_(new)
        elif how == "data_copy_":
            w.data.copy_(new)
        else:
            sd = model.state_dict()
            sd["0.weight"] = new
            model.load_state_dict(sd)
    assert master_of(w) is None  # the old master is no longer the weight's source
    with torch.no_grad():
        ref[0].linear.weight.copy_(w.dequantize())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_state = copy.deepcopy(optimizer.state_dict())
    for s in ref_state["state"].values():
        s.pop("master", None)
    ref_opt.load_state_dict(ref_state)
    got = _train(model, optimizer, batches[1:], recipe)
    want = _train(ref, ref_opt, batches[1:], recipe)
    assert got == want, f"{how}: after the write {got} != {want}"


def test_a_weight_assigned_in_place_of_the_fp8_parameter_trains_and_is_named_once():
    """A plain Parameter assigned over an FP8 one: a warning naming the op (once),
    then the op trains as a high-precision model with that weight, bit for bit."""
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    ref = _twin(model)
    op = model[0].linear
    op.weight = torch.nn.Parameter(ref[0].linear.weight.detach().clone())
    optimizer, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    batches = _batches(3)
    with pytest.warns(UserWarning, match="made under te.quantized_model_init, its weight is now a plain float32") as w:
        got = _train(model, optimizer, batches, recipe)
    assert sum("quantized_model_init" in str(r.message) for r in w) == 1 and op.describe() in str(w[0].message)
    assert got == _train(ref, ref_opt, batches, recipe)
    assert type(model[2].linear.weight) is Float8Tensor  # the other linear keeps its FP8 parameter


@pytest.mark.parametrize("preserve", [False, True])
def test_the_fsdp2_fp8_all_gather_takes_fp8_parameters_on_from_their_start(preserve):
    """te.enable_fsdp_fp8_all_gather on FP8 parameters: each weight continues in high
    precision from the value its first optimizer step would start from (the
    preserved initial value, else the FP8 value), with no warning; after a step,
    from its master. It then trains as plain weights from that start, bit for bit
    (wrapping the FP8 tensor itself re-cast every update to FP8: 3e-3 off after 20
    AdamW steps of 1e-4)."""
    import warnings

    recipe = FP8_RECIPES["current"]
    torch.manual_seed(0)
    with quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=preserve):
        model = _model()
    stepped = _fp8_model(recipe)
    opt = torch.optim.AdamW(stepped.parameters(), lr=1e-2)
    _train(stepped, opt, _batches(1), recipe)
    for m in (model, stepped):
        w = m[0].linear.weight
        want = master_of(w) if master_of(w) is not None else (
            w.get_high_precision_init_val() if preserve else w.dequantize())
        want, fp8_value = want.clone().reshape(w.shape), w.dequantize()
        assert torch.equal(want, fp8_value) is (m is model and not preserve)  # a master or a preserved start differ
        te.enable_fsdp_fp8_all_gather(m)
        got = m[0].linear.weight.data._data
        assert type(got) is torch.Tensor and torch.equal(got, want)
    twin = _model()  # the same start as plain weights, trained alike: the same bits (no FP8 write in between)
    with torch.no_grad():
        for p_twin, p in zip(twin.parameters(), model.parameters()):
            p_twin.copy_(p)
    te.enable_fsdp_fp8_all_gather(twin)
    batches = _batches(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, recipe)
    assert got == _train(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3), batches, recipe)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_an_ema_copy_of_fp8_parameters_accumulates_its_updates_as_in_high_precision():
    """An EMA (torch's ``AveragedModel``, a deep copy updated by a foreach lerp after
    every step) of a model with FP8 parameters: each update starts from the
    previous update's high-precision result, which equals an fp32 EMA of the same
    weights bit for bit, and the copy's FP8 values are that result's cast. (Each
    update re-cast from the FP8 values drifted 0.06 from the fp32 EMA in 200 steps,
    twice the EMA's own distance from the weights.) A write that replaces the values
    ends it."""
    from tolerances import assert_close
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fp8 = [(e, p) for e, p in zip(ema.module.parameters(), model.parameters()) if type(p) is Float8Tensor]
    want = None
    for batch in _batches(30):
        _train(model, optimizer, [batch], recipe)
        ema.update_parameters(model)
        values = [p.dequantize() for _, p in fp8]
        if want is None:
            want = [v.clone() for v in values]
        else:
            torch._foreach_lerp_(want, values, 1 - 0.9)
    for (e, _), w in zip(fp8, want):
        assert type(e) is Float8Tensor
        assert torch.equal(e.fp8_storage.cast_from().reshape(w.shape), w)
        assert_close(e.dequantize(), w, torch.float8_e4m3fn, "the EMA's FP8 values against the fp32 EMA")
        assert torch.equal(e.dequantize(), e.fp8_storage.quantizer.cast(w, rowwise=True, columnwise=False)
                           .dequantize().reshape(w.shape))
    e = fp8[0][0]
    with torch.no_grad():
        e.copy_(torch.zeros(e.shape))
    assert e.fp8_storage.cast_from() is None


def test_a_step_after_an_in_place_update_starts_from_its_high_precision_result():
    """A decay written into FP8 parameters between steps (``p.mul_``): the next
    optimizer step's master is the update's high-precision result, not its FP8
    cast, so the run is a plain model's that decays alike, bit for bit."""
    recipe = FP8_RECIPES["current"]
    model = _fp8_model(recipe)
    twin = _twin(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    for batch in _batches(3):
        for m, opt in zip((model, twin), opts):
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(0.97)
            _train(m, opt, [batch], recipe)
    for p_twin, p in zip(twin.parameters(), model.parameters()):
        got = master_of(p) if type(p) is Float8Tensor else p
        assert torch.equal(got.reshape(p_twin.shape), p_twin)


def test_high_precision_forward_of_fp8_parameters_uses_their_values():
    model = _fp8_model(FP8_RECIPES["current"])
    x = _batches(1)[0][0]
    y = model(x)  # no recipe
    assert torch.equal(y, _twin(model)(x))


def test_preserve_high_precision_init_val_keeps_the_initial_value_on_the_cpu():
    torch.manual_seed(0)
    with quantized_model_init(enabled=True, recipe=FP8_RECIPES["current"], preserve_high_precision_init_val=True):
        layer = te.ops.BasicLinear(64, 32)
    torch.manual_seed(0)
    plain = te.ops.BasicLinear(64, 32)
    init = layer.weight.get_high_precision_init_val()
    assert init is not None and init.device.type == "cpu" and torch.equal(init, plain.weight.detach())
    layer.weight.clear_high_precision_init_val()
    assert layer.weight.get_high_precision_init_val() is None


@pytest.mark.parametrize("recipe_name", ["current", "block", "mxfp8"])
def test_a_preserved_initial_value_is_the_first_masters_start(recipe_name):
    """With ``preserve_high_precision_init_val`` the first step's master is the
    initial fp32 value, so training is the fp32-weight model's from the same init,
    bit for bit (a stateless recipe casts the stored and the fp32 weight alike);
    without it the master starts on the FP8 grid, and the runs differ."""
    recipe = FP8_RECIPES[recipe_name]
    batches = _batches(4)
    torch.manual_seed(0)
    with quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True):
        kept = _model()
    on_grid = _fp8_model(recipe)
    torch.manual_seed(0)
    plain = _model()
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (kept, on_grid, plain)]  # they hold the masters
    runs = [_train(m, opt, batches, recipe) for m, opt in zip((kept, on_grid, plain), opts)]
    assert runs[0] == runs[2], f"{recipe_name}: {runs[0]} != {runs[2]}"
    assert runs[1] != runs[2]
    weights = [p for p in kept.parameters() if type(p) is Float8Tensor]
    assert weights and all(w.get_high_precision_init_val() is None for w in weights)  # the master holds it now
    for w, p in zip(weights, [p for p in plain.parameters() if p.dim() == 2]):
        assert torch.equal(master_of(w), p.detach())


def test_a_preserved_initial_value_that_no_longer_casts_to_the_weight_is_not_used():
    """A write before the first step makes the written value the start."""
    recipe = FP8_RECIPES["current"]
    torch.manual_seed(0)
    with quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True):
        layer = te.ops.BasicLinear(64, 32)
    written = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer.weight.copy_(written)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    x = torch.randn(8, 64)
    with te.autocast(recipe=recipe):
        layer(x).sum().backward()
    opt.step()
    assert torch.equal(master_of(layer.weight), layer.weight.dequantize())  # the written value's FP8 cast
