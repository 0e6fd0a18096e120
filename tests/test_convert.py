"""``te.convert``: an existing torch model's layers become te_fuser ops with the same
Parameters and state-dict keys; the converted model trains under every recipe
like its unconverted self, and checkpoints load both ways."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import te_fuser as te
from op_testing import FP8_RECIPES
from tolerances import tolerance

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("convert_hf_style", ROOT / "examples" / "convert_hf_style.py")
HF = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(HF)  # the example's HF-style modules (it also runs its own short demo)


def decoder(seed=0):
    torch.manual_seed(seed)
    return HF.DecoderLayer(hidden=64, intermediate=128, heads=4)


def test_the_layers_are_replaced_keeping_their_parameters():
    plain = decoder()
    params = {name: p for name, p in plain.named_parameters()}
    model, report = te.convert(plain, report=True)
    assert model is plain
    assert isinstance(model.mlp.gate_proj, te.ops.Linear) and isinstance(model.input_layernorm, te.ops.RMSNorm)
    assert len(report.converted) == 9 and report.kept == []
    for name, p in model.state_dict().items():
        assert params[name] is getattr(_module(model, name), name.rsplit(".", 1)[1])


def _module(model, key):
    module = model
    for part in key.split(".")[:-1]:
        module = getattr(module, part)
    return module


def test_an_optimizer_made_before_the_conversion_trains_the_converted_model():
    model = decoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    te.convert(model)
    before = model.mlp.down_proj.weight.detach().clone()
    model(torch.randn(2, 8, 64)).square().mean().backward()
    opt.step()
    assert not torch.equal(model.mlp.down_proj.weight, before)


def test_high_precision_outputs_and_gradients_match_the_unconverted_model():
    plain = decoder()
    model = te.convert(copy.deepcopy(plain))
    x = torch.randn(2, 8, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), model(xb)
    torch.testing.assert_close(yb, ya, **tolerance(torch.float32))
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_checkpoints_load_both_ways_strictly():
    plain, model = decoder(), te.convert(decoder(seed=1))
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(decoder(seed=2).state_dict())
    assert torch.equal(model.mlp.up_proj.weight, decoder(seed=2).mlp.up_proj.weight)


def _train(model, recipe, steps=25):
    HF.train(model, recipe, steps)  # the example's loop: AdamW, bf16 autocast, the recipe when given
    return model


def _validation(model) -> float:
    x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(99))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return (model(x).float() - x.flip(-1)).square().mean().item()


@pytest.mark.parametrize("recipe_name", list(FP8_RECIPES))
def test_the_converted_model_trains_like_its_unconverted_self(recipe_name):
    target = _validation(_train(decoder(), None))
    converted = _train(te.convert(decoder()), FP8_RECIPES[recipe_name])
    got = _validation(converted)  # evaluated in bf16
    assert abs(got - target) <= tolerance(torch.float8_e4m3fn)["rtol"] * target, (recipe_name, got, target)


def test_sequentials_become_fused_groups_and_what_cannot_convert_stays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32),
                          nn.GELU(), nn.LayerNorm(32, bias=False), nn.Linear(32, 32))
    plain = copy.deepcopy(model)
    converted, report = te.convert(model, report=True, skip=["6"])
    assert isinstance(converted, te.ops.Sequential)
    kinds = [type(m).__name__ for m in converted]
    assert kinds == ["LayerNorm", "Linear", "GELU", "Linear", "GELU", "LayerNorm", "Linear"]
    assert isinstance(converted[4], nn.GELU) and isinstance(converted[5], nn.LayerNorm)  # torch's, kept
    assert isinstance(converted[6], nn.Linear)  # skipped by path
    kept = dict(report.kept)
    assert "erf" in kept["4"] and "no weight or no bias" in kept["5"] and kept["6"] == "skipped"
    with te.autocast(recipe=FP8_RECIPES["current"]):
        converted(torch.randn(8, 32))
    plan = converted.fusion_plan()
    assert "ForwardLinearBiasLinear" in plan and "[rule forward_activation_amax_linear_bias]" in plan, plan
    plain.load_state_dict(converted.state_dict())


def test_a_pruned_parametrized_or_hooked_layer_stays_torchs_and_keeps_what_it_has():
    """Layers whose te op would drop something of theirs stay torch's, each with the
    reason: a pruned Linear (its mask goes on applying: the pruned entries stay zero
    through two SGD steps), a weight-normed one and one with a forward hook (which
    goes on firing); their plain neighbours convert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 32), nn.GELU(approximate="tanh"),
                          nn.Linear(32, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 32))
    mask = (torch.rand(32, 32) > 0.5).float()
    torch.nn.utils.prune.custom_from_mask(model[0], "weight", mask)
    torch.nn.utils.parametrizations.weight_norm(model[2], "weight")
    fired = []
    model[4].register_forward_hook(lambda module, args, out: fired.append(True))
    converted, report = te.convert(model, report=True)
    kept = dict(report.kept)
    assert "is pruned (weight" in kept["0"] and "is parametrized (weight" in kept["2"]
    assert "module hooks" in kept["4"]
    assert [type(converted[i]).__module__.startswith("torch") for i in (0, 2, 4, 6)] == [True, True, True, False]
    opt = torch.optim.SGD(converted.parameters(), lr=0.5)
    for _ in range(2):
        with te.autocast(recipe=FP8_RECIPES["current"]):
            converted(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(converted[0].weight * (1 - mask), torch.zeros(32, 32)) and len(fired) == 2


def test_skip_takes_a_predicate_and_refuses_a_bare_string():
    model = decoder()
    te.convert(model, skip=lambda path, m: path.startswith("self_attn"))
    assert isinstance(model.self_attn.q_proj, nn.Linear) and isinstance(model.mlp.up_proj, te.ops.Linear)
    with pytest.raises(TypeError, match="in a list"):
        te.convert(decoder(), skip="mlp")


def test_converting_inside_quantized_model_init_is_refused_before_anything_changes():
    """te.convert keeps the model's own Parameters, so inside quantized_model_init no
    weight would be FP8 (each linear would then warn at its first forward): a clear
    error naming both, with the model untouched."""
    model = decoder()
    before = {name: type(m) for name, m in model.named_modules()}
    with te.quantized_model_init(enabled=True, recipe=FP8_RECIPES["current"]):
        with pytest.raises(RuntimeError, match="convert: called inside te.quantized_model_init.*own Parameters"):
            te.convert(model)
    assert {name: type(m) for name, m in model.named_modules()} == before
    with te.quantized_model_init(enabled=False):
        assert isinstance(te.convert(model).mlp.up_proj, te.ops.Linear)
