"""te.ops.DotProductAttention against float64 attention (forward and every gradient) on
odd shapes (sequence 67, grouped kv heads 8:2, causal and not) under every recipe;
the FP8 path's roles, the errors raised before any state changes, and recipe switches
in and out of FP8 attention (bit-identical to a fresh model on the target recipe)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser import recipe as R
from te_fuser.quantization import IdentityQuantizer
from tolerances import assert_close

H, HKV, D, T, B = 8, 2, 32, 67, 2
W = (H + 2 * HKV) * D
FP8_ATTENTION = ("delayed_dpa", "current_dpa", "delayed_mha", "current_mha")
ALL = {**RECIPES, "delayed_dpa": R.DelayedScaling(fp8_dpa=True), "current_dpa": R.Float8CurrentScaling(fp8_dpa=True)}
NOT_PER_TENSOR = ("mxfp8", "block", "rowwise")


def attention64(x, causal, heads=H, kv_heads=HKV, dim=D):
    """Float64 attention on the fused QKV ``x`` (B, T, W): the reference."""
    batch, seq, _ = x.shape
    q, k, v = x.reshape(batch, seq, heads + 2 * kv_heads, dim).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # head h reads kv head h // (H / Hkv)
    s = q @ k.transpose(-1, -2) / math.sqrt(dim)
    if causal:
        s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v  # (B, H, T, D)
    return o.transpose(1, 2).reshape(batch, seq, heads * dim)


def _inputs(gen, dtype, shape=(B, T, W)):
    x = representable(*shape, generator=gen, dtype=dtype, scale_exp=-3)  # every per-tensor scale a power of 2
    dy = representable(*shape[:-1], H * D, generator=gen, dtype=dtype)
    return x, dy


def _tolerance(recipe_name, dtype):
    if recipe_name in FP8_ATTENTION:
        return "attention_fp8_op"
    return "attention_bf16" if dtype is torch.bfloat16 else "attention_fp32"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", [n for n in ALL if n not in NOT_PER_TENSOR])
def test_attention_matches_float64(recipe_name, dtype, causal):
    gen = torch.Generator().manual_seed(3)
    op = te.ops.DotProductAttention(H, D, HKV, causal=causal)
    x, dy = _inputs(gen, dtype)
    outs, grads = run(op, x, recipe=ALL[recipe_name], dy=dy)
    x64 = x.double().requires_grad_(True)
    ref = attention64(x64, causal)
    ref.backward(dy.double())
    key, context = _tolerance(recipe_name, dtype), f"attention recipe={recipe_name} dtype={dtype} causal={causal}"
    assert outs[0].dtype == dtype and outs[0].shape == (B, T, H * D)
    assert_close(outs[0], ref.detach(), key, f"{context} output", scaled=True)
    for part, sl in (("dq", slice(0, H * D)), ("dk", slice(H * D, (H + HKV) * D)), ("dv", slice((H + HKV) * D, W))):
        assert_close(grads["x"][..., sl], x64.grad[..., sl], key, f"{context} {part}", scaled=True)


@pytest.mark.parametrize("recipe_name", ["none", "delayed_dpa"])
def test_two_dimensional_input_is_one_sequence(recipe_name):
    gen = torch.Generator().manual_seed(4)
    op = te.ops.DotProductAttention(4, 32, 1, causal=True)
    x, _ = _inputs(gen, torch.bfloat16, (1, 13, 6 * 32))
    dy = representable(1, 13, 4 * 32, generator=gen, dtype=torch.bfloat16)
    out3, g3 = run(op, x, recipe=ALL[recipe_name], dy=dy)
    out2, g2 = run(copy.deepcopy(op), x[0], recipe=ALL[recipe_name], dy=dy[0])
    assert out2[0].shape == (13, 4 * 32)
    assert torch.equal(out2[0], out3[0][0]) and torch.equal(g2["x"], g3["x"][0])


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "block", "rowwise"])
def test_without_fp8_dpa_attention_runs_in_high_precision_under_any_recipe(recipe_name):
    gen = torch.Generator().manual_seed(5)
    op = te.ops.DotProductAttention(H, D, HKV)
    x, dy = _inputs(gen, torch.bfloat16, (B, 64, W))
    hp_out, hp_grads = run(op, x, dy=dy)
    out, grads = run(op, x, recipe=RECIPES[recipe_name], dy=dy)
    assert torch.equal(out[0], hp_out[0]) and torch.equal(grads["x"], hp_grads["x"])
    assert all(isinstance(q, IdentityQuantizer) for q in op.installed_quantizers.values())


@pytest.mark.parametrize("recipe_name", NOT_PER_TENSOR)
def test_fp8_attention_needs_per_tensor_scales_and_says_so_at_plan_build(recipe_name):
    op = te.ops.DotProductAttention(H, D, HKV)
    x, dy = _inputs(torch.Generator().manual_seed(6), torch.bfloat16, (B, 64, W))
    before, _ = run(op, x, recipe=RECIPES["delayed_mha"], dy=dy)
    installed = op.installed_quantizers
    state = {t: q.state_dict() for t, q in installed.items()}
    for field in ("fp8_dpa", "fp8_mha"):
        with pytest.raises(ValueError, match=r"DotProductAttention.*fp8_dpa / fp8_mha.*one scale per tensor"):
            run(op, x, recipe=RECIPES[recipe_name].replace(**{field: True}), dy=dy)
    assert op.installed_quantizers is installed  # nothing published
    for t, q in installed.items():
        for name, value in q.state_dict().items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[t][name])), (t, name)
    again, _ = run(op, x, recipe=RECIPES["delayed_mha"], dy=dy)  # the old plan still works, with its quantizers
    assert again[0].shape == before[0].shape and op.installed_quantizers is installed


def test_the_fp8_path_casts_q_k_v_p_o_and_do_with_the_roles_quantizers():
    gen = torch.Generator().manual_seed(7)
    op = te.ops.DotProductAttention(H, D, HKV, name="attn")
    x, dy = _inputs(gen, torch.bfloat16)
    run(op, x, recipe=ALL["delayed_dpa"], dy=dy)
    qs = op.installed_quantizers
    assert set(qs) == {"qkv", "s", "o", "do"}
    assert [str(q.role) for q in qs.values()] == ["dpa:attn.qkv", "dpa:attn.s", "dpa:attn.o", "dpa:attn.do"]
    assert qs["qkv"].amax_history[0] == x.abs().max().float()
    assert qs["s"].amax_history[0] == 1.0 and qs["s"].scale == 448.0  # P's bound, not a look at P
    assert qs["do"].amax_history[0] == dy.abs().max().float() and qs["do"].fp8_dtype == torch.float8_e5m2
    assert qs["o"].amax_history[0] > 0
    run(op, x, recipe=R.DelayedScaling(fp8_dpa=True, margin=2), dy=dy)
    assert op.installed_quantizers["s"].scale == 448.0 / 4 and op.installed_quantizers["s"].amax_history[1] == 1.0


def test_a_custom_recipe_sees_attentions_roles_under_fp8_dpa_only():
    seen = []

    def factory(role):
        seen.append(str(role))
        return te.quantization.Float8CurrentScalingQuantizer(
            torch.float8_e5m2 if role.is_backward else torch.float8_e4m3fn)

    model = te.ops.Sequential(te.ops.Linear(64, W, name="qkv"), te.ops.DotProductAttention(H, D, HKV, name="attn"))
    x = representable(B, 16, 64, scale_exp=-3)
    run(model, x, recipe=R.CustomRecipe(factory, qfactory_key="current"))
    assert not any(r.startswith("dpa") for r in seen)
    seen.clear()
    out, _ = run(model, x, recipe=R.CustomRecipe(factory, qfactory_key="current", fp8_dpa=True))
    assert {"dpa:attn.qkv", "dpa:attn.s", "dpa:attn.o", "dpa:attn.do"} <= set(seen)
    ref, _ = run(model, x, recipe=RECIPES["current_mha"].replace(fp8_mha=False, fp8_dpa=True))
    assert torch.equal(out[0], ref[0])  # the same quantizers as Float8CurrentScaling's


def test_bad_constructor_arguments_name_the_op_and_the_constraint():
    for kwargs, message in (
        (dict(num_heads=8, head_dim=32, num_kv_heads=3), r"DotProductAttention\.num_kv_heads: must divide num_heads"),
        (dict(num_heads=8, head_dim=24), r"DotProductAttention\.head_dim: the attention kernels take head dims"),
        (dict(num_heads=0, head_dim=32), r"DotProductAttention\.num_heads: must be a positive integer"),
        (dict(num_heads=8, head_dim=32, softmax_scale=-1.0), r"DotProductAttention\.softmax_scale"),
    ):
        with pytest.raises(ValueError, match=message):
            te.ops.DotProductAttention(**kwargs)
    with pytest.raises(TypeError, match=r"DotProductAttention\.causal"):
        te.ops.DotProductAttention(8, 32, causal=1)


def _trained_model():
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.Linear(64, W, name="qkv"), te.ops.DotProductAttention(H, D, HKV, name="attn"),
                             te.ops.Linear(H * D, 64, name="proj"))


def test_bad_shapes_raise_before_any_state_changes_and_the_old_plan_keeps_working():
    model = _trained_model()
    x = representable(B, 16, 64, scale_exp=-3)
    first, _ = run(model, x, recipe=RECIPES["delayed_mha"])
    attn = model[1]
    installed, plan, key = attn.installed_quantizers, te.ops.fusers_of(model)[0].plan, attn.quantizer_key
    history = attn.installed_quantizers["qkv"].amax_history.clone()
    wrong = te.ops.Sequential(te.ops.DotProductAttention(H, D, HKV, name="attn"))
    with pytest.raises(ValueError, match=r"DotProductAttention\('attn'\): input's last dim is 320; .* = 384 wide"):
        wrong(torch.zeros(2, 5, 320))
    with pytest.raises(ValueError, match=r"the FP8 attention kernel takes head dims|whose kernel takes head dims"):
        with te.autocast(recipe=RECIPES["delayed_mha"]):
            te.ops.DotProductAttention(4, 16)(torch.zeros(2, 5, 12 * 16))
    # a rejected recipe for the trained model: the published plan and its state stay
    with pytest.raises(ValueError, match="one scale per tensor"):
        run(model, x, recipe=RECIPES["mxfp8"].replace(fp8_dpa=True))
    assert te.ops.fusers_of(model)[0].plan is plan and attn.installed_quantizers is installed and attn.quantizer_key == key
    assert torch.equal(attn.installed_quantizers["qkv"].amax_history, history)
    with pytest.raises(ValueError, match="one scale per tensor"):
        te.apply_recipe(model, RECIPES["block"].replace(fp8_mha=True), example_inputs=(x,))
    assert attn.installed_quantizers is installed
    again, _ = run(model, x, recipe=RECIPES["delayed_mha"])
    assert again[0].shape == first[0].shape and te.ops.fusers_of(model)[0].plan is plan


def _step(model, x, recipe, opt):
    model.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(xx)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = xx.grad
    opt.step()
    return y.detach(), grads


@pytest.mark.parametrize("a,b", [("delayed", "delayed_mha"), ("delayed_mha", "delayed"), ("none", "current_mha"),
                                 ("current_mha", "delayed_dpa"), ("delayed_dpa", "delayed_mha")])
def test_mid_training_switch_is_bit_identical_to_a_fresh_model_on_the_target(a, b):
    x = [representable(B, 16, 64, generator=torch.Generator().manual_seed(i), scale_exp=-3) for i in range(6)]
    model = _trained_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(3):
        _step(model, x[i], ALL[a], opt)
    model.prepare(x[3], recipe=ALL[b])  # the switch: plan and quantizers for b, nothing run
    fresh = _trained_model()
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    for i in range(3, 6):
        out_m, g_m = _step(model, x[i], ALL[b], opt)
        out_f, g_f = _step(fresh, x[i], ALL[b], fresh_opt)
        assert torch.equal(out_m, out_f), f"step {i}: output"
        for name in g_m:
            assert torch.equal(g_m[name], g_f[name]), f"step {i}: grad {name}"


def test_attentions_delayed_scaling_state_carries_across_switches():
    x = [representable(B, 16, 64, generator=torch.Generator().manual_seed(i), scale_exp=-3) for i in range(4)]
    model = _trained_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, x[i], ALL["delayed_mha"], opt)
    attn = model[1]
    before = {t: q.amax_history.clone() for t, q in attn.installed_quantizers.items()}
    _step(model, x[2], None, opt)  # high precision leaves the state alone
    _step(model, x[2], ALL["delayed"], opt)  # attention in high precision: identity quantizers
    assert all(isinstance(q, IdentityQuantizer) for q in attn.installed_quantizers.values())
    model.prepare(x[3], recipe=R.DelayedScaling(fp8_mha=True, amax_history_len=4))
    for t, q in attn.installed_quantizers.items():
        assert torch.equal(q.amax_history, before[t][:4]), t  # resized, never dropped


def test_a_checkpoint_taken_while_attention_runs_in_high_precision_keeps_its_fp8_state():
    x = [representable(B, 16, 64, generator=torch.Generator().manual_seed(i), scale_exp=-3) for i in range(6)]
    model = _trained_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, x[i], ALL["delayed_mha"], opt)
    _step(model, x[2], ALL["delayed"], opt)
    fresh = _trained_model()
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    for i in range(3, 6):
        out_m, g_m = _step(model, x[i], ALL["delayed_mha"], opt)
        out_f, g_f = _step(fresh, x[i], ALL["delayed_mha"], fresh_opt)
        assert torch.equal(out_m, out_f) and all(torch.equal(g_m[n], g_f[n]) for n in g_m), f"step {i}"
    assert model[1].installed_quantizers["qkv"].seeded and model[1].installed_quantizers["qkv"].amax_history[4] > 0


def test_the_fp8_mha_hand_offs_skip_the_separate_casts(monkeypatch):
    """Under fp8_mha and delayed scaling the QKV GEMM's epilogue casts q, k, v (once the
    qkv quantizer is seeded) and the projection reads attention's FP8 O: neither the
    qkv quantizer nor the projection's input quantizer casts on its own."""
    from te_fuser.quantization.delayed import DelayedScalingQuantizer

    casts = []
    real = DelayedScalingQuantizer._cast  # every cast of a tensor passes here

    def recording(self, x_hp, *args):
        casts.append(str(self.role))
        return real(self, x_hp, *args)

    monkeypatch.setattr(DelayedScalingQuantizer, "_cast", recording)
    model = _trained_model()
    x = representable(B, 16, 64, scale_exp=-3)
    run(model, x, recipe=RECIPES["delayed_mha"])  # seeds the qkv quantizer
    casts.clear()
    run(model, x, recipe=RECIPES["delayed_mha"])
    assert "forward_linear_bias_dpa_linear_bias" in model.fusion_plan().rules()
    assert "dpa:attn.qkv" not in casts and "linear:proj.input" not in casts, casts
    assert {"linear:qkv.input", "dpa:attn.s", "dpa:attn.o", "dpa:attn.do"} <= set(casts), casts
    assert not model[2].linear.installed_quantizers["input"].seeded


def test_attention_kernels_run_outside_autocast_and_turn_it_back_on():
    """Under torch.autocast the op's kernel call computes as outside it (the reference's
    fp32 matmuls are not cast down: the same bits), and autocast is on again after the
    call, also after a kernel that raised."""
    from te_fuser.ops.basic.attention import _kernel

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    plain = _kernel("attention_forward", torch.device("cpu"))(q, k, v, True, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernel = _kernel("attention_forward", torch.device("cpu"))
        inside = kernel(q, k, v, True, 0.25)
        assert torch.is_autocast_enabled("cpu")
        with pytest.raises(ValueError, match="softmax_scale"):
            kernel(q, k, v, True, -1.0)
        assert torch.is_autocast_enabled("cpu")
    for a, b in zip(plain, inside):
        assert torch.equal(a, b)
