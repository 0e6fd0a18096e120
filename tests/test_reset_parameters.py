"""Deferred initialisation, as large models are made: ``with torch.device("meta")``,
then ``to_empty(device=...)``, then each module's ``reset_parameters()`` (or the
model's ``init_weights()``). Every te op with parameters draws them again as its
construction drew them, so under one seed the result is the model built directly,
bit for bit, and trains as it does; FP8 parameters (``te.quantized_model_init``)
stay FP8 through ``to_empty`` and device moves. (FSDP2 sharding before the
initialisation: ``test_fsdp.py``.)"""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT
from te_fuser.quantization.float8_tensor import Float8Tensor

OPS = {
    "BasicLinear": lambda: te.ops.BasicLinear(24, 40),
    "Linear": lambda: te.ops.Linear(24, 40),
    "Linear-no-bias": lambda: te.ops.Linear(24, 40, bias=False),
    "Bias": lambda: te.ops.Bias(40),
    "Bias-bounded": lambda: te.ops.Bias(40, init_bound=0.25),
    "LayerNorm": lambda: te.ops.LayerNorm(40),
    "LayerNorm-zero-centered": lambda: te.ops.LayerNorm(40, zero_centered_gamma=True),
    "RMSNorm": lambda: te.ops.RMSNorm(40),
    "Embedding": lambda: te.ops.Embedding(50, 16),
    "GroupedLinear": lambda: te.ops.GroupedLinear(3, 24, 40),
}


def _values(module: torch.nn.Module) -> dict:
    return {name: (p.dequantize() if type(p) is Float8Tensor else p.detach()).clone()
            for name, p in module.named_parameters()}


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: parameters {sorted(a)} against {sorted(b)}"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}"


@pytest.mark.parametrize("name", OPS)
def test_reset_draws_as_construction(name):
    """Under one seed, reset_parameters() after to_empty gives the parameters the
    op's construction gave, bit for bit, and drawing again changes them."""
    torch.manual_seed(3)
    built = _values(OPS[name]())
    with torch.device("meta"):
        op = OPS[name]()
    assert all(p.is_meta for p in op.parameters())
    op.to_empty(device="cpu")
    torch.manual_seed(3)
    op.reset_parameters()
    _assert_same(_values(op), built, name)
    drawn = any(not torch.equal(built[n], built[n].flatten()[0].expand_as(built[n])) for n in built)
    if drawn:  # a random init: a second draw differs
        op.reset_parameters()
        assert any(not torch.equal(v, built[n]) for n, v in _values(op).items()), f"{name}: a second draw was the same"


def test_reset_parameters_resets_each_module_once_in_construction_order():
    """te.ops.reset_parameters(model) after to_empty gives the model built under the
    seed, torch modules among te ops included; a loop over modules() is right in
    distribution but draws a Linear's weight twice."""
    def build():
        return torch.nn.Sequential(te.ops.Sequential(te.ops.LayerNorm(32), te.ops.Linear(32, 64), te.ops.GELU()),
                                   torch.nn.Linear(64, 16), te.ops.Linear(16, 8, bias=False))

    torch.manual_seed(11)
    built = _values(build())
    with torch.device("meta"):
        made = build()
    made.to_empty(device="cpu")
    torch.manual_seed(11)
    assert te.ops.reset_parameters(made) is made
    _assert_same(_values(made), built, "te.ops.reset_parameters")
    torch.manual_seed(11)
    for module in made.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert not torch.equal(_values(made)["0.1.linear.weight"], built["0.1.linear.weight"])


def test_linear_bias_keeps_its_uniform_init():
    """A Linear's bias is drawn within 1/sqrt(in_features), also when every module
    of the model resets itself in turn (the composite, then its basic ops)."""
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 256))
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    bias = model[1].bias
    assert 0 < bias.abs().max() <= 1 / 8 and bias.abs().min() < 1 / 64, bias
    with pytest.raises(ValueError, match="Bias.init_bound"):
        te.ops.Bias(8, init_bound=-1.0)


@pytest.mark.parametrize("attention", ["te", "sdpa"])
def test_gpt_made_on_meta_trains_as_built(attention):
    """The GPT made on the meta device, moved to storage with to_empty and
    initialised with init_weights() under the seed holds the directly built GPT's
    parameters, and trains through a recipe schedule (fused AdamW, an evaluation,
    a switch) to the same losses, bit for bit; the plain-torch twin alike."""
    config = GPTConfig(n_layer=2, d_model=64, n_head=4, d_ffn=128, seq_len=16, batch_size=2, attention=attention)
    torch.manual_seed(7)
    built = GPT(config)
    with torch.device("meta"):
        made = GPT(config)
    made.to_empty(device="cpu")
    torch.manual_seed(7)
    made.init_weights()
    _assert_same(_values(made), _values(built), f"GPT({attention})")
    torch.manual_seed(7)
    twin = _values(TorchGPT(config))
    with torch.device("meta"):
        twin_made = TorchGPT(config)
    twin_made.to_empty(device="cpu")
    torch.manual_seed(7)
    twin_made.init_weights()
    _assert_same(_values(twin_made), twin, f"TorchGPT({attention})")

    batches = torch.randint(0, config.vocab_size, (5, 2, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    schedule = [None, te.recipe.DelayedScaling(), te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling(), None]

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = []
        for batch, recipe in zip(batches, schedule):
            with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if recipe is not None and len(losses) == 2:  # an evaluation under the recipe between steps
                model.eval()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(recipe=recipe):
                    losses.append(model(batch[:, :-1]).float().sum().item())
                model.train()
        return losses

    assert train(made) == train(built)


@pytest.mark.parametrize("recipe", [te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling(),
                                    te.recipe.MXFP8BlockScaling()], ids=lambda r: type(r).__name__)
def test_fp8_parameters_made_on_meta(recipe):
    """An FP8 parameter stays FP8 through to_empty and device moves (its quantizer
    kept), reset_parameters() casts the construction's draw again (its kept init
    value too), and the model's forward and backward match the one built directly."""
    torch.manual_seed(5)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        built = te.ops.Sequential(te.ops.Linear(64, 96), te.ops.GELU(), te.ops.Linear(96, 32))
    with torch.device("meta"), te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        made = te.ops.Sequential(te.ops.Linear(64, 96), te.ops.GELU(), te.ops.Linear(96, 32))
    assert type(made[0].weight) is Float8Tensor and made[0].weight.is_meta
    made.to_empty(device="cpu")
    for op in (made[0], made[2]):
        assert type(op.weight) is Float8Tensor and isinstance(op.weight, torch.nn.Parameter), type(op.weight)
        assert op.weight.device.type == "cpu" and op.weight.requires_grad
    torch.manual_seed(5)
    for module in made.modules():
        if isinstance(module, te.ops.Linear):
            module.reset_parameters()
    _assert_same(_values(made), _values(built), "FP8 parameters")
    for a, b in ((made[0], built[0]), (made[2], built[2])):
        assert torch.equal(a.weight.get_high_precision_init_val(), b.weight.get_high_precision_init_val())
        assert a.weight.fp8_storage.quantizer is not None
    moved = made.to("meta")  # a device move keeps FP8 (as .cuda() does on a GPU)
    assert type(moved[0].weight) is Float8Tensor and moved[0].weight.is_meta
    assert moved[0].weight.get_high_precision_init_val() is not None, "the kept init value was lost in the move"
    made.to_empty(device="cpu")
    torch.manual_seed(5)
    for module in made.modules():
        if isinstance(module, te.ops.Linear):
            module.reset_parameters()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (made, built):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = model(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, model[0].bias.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_an_fp8_parameters_data_set_takes_the_new_values():
    """``p.data = new`` on an FP8 parameter (what Module._apply does for .cuda() and
    .to(device) where the new value is of a compatible kind) takes new's FP8 values,
    as a plain tensor's does."""
    recipe = te.recipe.Float8CurrentScaling()
    with te.quantized_model_init(recipe=recipe):
        torch.manual_seed(1)
        a = te.ops.Linear(32, 64, bias=False)
        torch.manual_seed(2)
        b = te.ops.Linear(32, 64, bias=False)
    w = a.weight
    w.data = b.weight.detach()
    assert w is a.weight and type(w) is Float8Tensor and isinstance(w, torch.nn.Parameter)
    assert torch.equal(w.dequantize(), b.weight.dequantize())
    x = torch.randn(4, 32)
    with te.autocast(recipe=recipe):
        assert torch.equal(a(x), b(x))


def test_reset_drops_a_kept_weight_cast():
    """A weight cast kept inside te.reuse_quantized_weights() is not used after the
    weight is drawn again: the next forward casts the new values."""
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 48))
    x = torch.randn(4, 32)
    recipe = te.recipe.Float8CurrentScaling()
    with te.reuse_quantized_weights(), te.autocast(recipe=recipe):
        before = model(x)
        torch.manual_seed(1)
        model[0].reset_parameters()
        after = model(x)
    torch.manual_seed(0)
    fresh = te.ops.Sequential(te.ops.Linear(32, 48))
    torch.manual_seed(1)
    fresh[0].reset_parameters()
    with te.autocast(recipe=recipe):
        expected = fresh(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", [te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling()],
                         ids=lambda r: type(r).__name__)
def test_fp8_parameters_move_to_the_gpu_as_fp8(recipe):
    """A model with FP8 parameters made on the CPU (directly, or on the meta device
    then reset there) and moved with .cuda() keeps FP8 parameters with the same
    bytes, and trains a step on the GPU as the one made there from the same bytes."""
    torch.manual_seed(5)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        built = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(), te.ops.Linear(128, 64))
    with torch.device("meta"), te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        made = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(), te.ops.Linear(128, 64))
    made.to_empty(device="cpu")
    torch.manual_seed(5)
    te.ops.reset_parameters(made)
    cpu_bytes = built[1].weight.fp8_storage.q.rowwise.data.view(torch.uint8).clone()
    built.cuda()
    made.cuda()
    for model in (built, made):
        w = model[1].weight
        assert type(w) is Float8Tensor and w.is_cuda and isinstance(w, torch.nn.Parameter)
        assert torch.equal(w.fp8_storage.q.rowwise.data.view(torch.uint8).cpu(), cpu_bytes)
        assert w.get_high_precision_init_val() is not None
    x = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for model in (built, made):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with te.autocast(recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
        results.append((y, model[3].weight.dequantize()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
