"""The GPT built from te_fuser ops throughout (GPTConfig.attention="te", the default: te.ops.Embedding,
RotaryEmbedding, DotProductAttention): its plain-torch twin matches it, it trains,
FP8 attention keeps loss parity, and a mid-training switch into fp8_dpa / fp8_mha is
bit-identical to a fresh model on the target recipe."""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from te_fuser.models import GPT, GPTConfig, TorchGPT, copy_weights, parameter_name_map
from tolerances import assert_close

CONFIG = GPTConfig(n_layer=2, d_model=64, n_head=2, d_ffn=128, seq_len=32, batch_size=4, attention="te")
DPA = te.recipe.DelayedScaling(fp8_dpa=True)
MHA = te.recipe.DelayedScaling(fp8_mha=True)


def _batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 256, (4096,), generator=gen)
    text = (text % 23) + 97 * (torch.arange(4096) % 3 == 0)  # some structure to learn
    starts = torch.randint(0, 4096 - CONFIG.seq_len - 1, (n, CONFIG.batch_size), generator=gen)
    return [torch.stack([text[s:s + CONFIG.seq_len + 1] for s in row]) for row in starts]


OWN = "the model's own recipe"  # no te.autocast region: what te.apply_recipe gave the model


def _loss(model, batch, recipe):
    if recipe is OWN:
        logits = model(batch[:, :-1])
    else:
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))


def _train(model, batches, recipe, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch, recipe)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


def test_every_attention_sub_layer_is_one_sequential_of_te_ops():
    model = GPT(CONFIG)
    attn = model.blocks[0].attn
    assert [type(m).__name__ for m in attn] == ["LayerNorm", "Linear", "RotaryEmbedding", "DotProductAttention",
                                                "Linear", "AddExtraInput"]
    assert len(attn.groups()) == 1 and isinstance(model.embed.tokens, te.ops.Embedding)
    with pytest.raises(ValueError, match="GPTConfig.attention"):
        CONFIG.replace(attention="flash")


def test_the_torch_twin_matches_in_high_precision():
    torch.manual_seed(0)
    model, twin = GPT(CONFIG), TorchGPT(CONFIG)
    copy_weights(model, twin)
    assert len(parameter_name_map(model, twin)) == len(list(model.parameters()))
    batch = _batches(1)[0]
    loss_te, loss_torch = _loss(model, batch, None), _loss(twin, batch, None)
    loss_te.backward()
    loss_torch.backward()
    assert_close(loss_te.detach(), loss_torch.detach(), torch.float32, "loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):  # the same parameters, in order
        assert_close(p.grad, q.grad, "attention_fp32", f"grad {name}", scaled=True)


def test_fp8_attention_trains_with_loss_parity():
    torch.manual_seed(0)
    base = GPT(CONFIG)
    batches = _batches(30)
    runs = {}
    for name, recipe in (("bf16", None), ("fp8_mha", MHA), ("fp8_dpa_current", te.recipe.Float8CurrentScaling(
            fp8_dpa=True))):
        model = copy.deepcopy(base)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses, _ = _train(model, batches, recipe)
        runs[name] = losses
        assert sum(losses[-5:]) < sum(losses[:5]) - 2.5, f"{name}: the loss did not fall: {losses}"
    final = {k: sum(v[-5:]) / 5 for k, v in runs.items()}
    for name in ("fp8_mha", "fp8_dpa_current"):
        assert abs(final[name] - final["bf16"]) < 0.1, final  # nats per byte, averaged over the last 5 steps


@pytest.mark.parametrize("a,b", [("bf16", "fp8_mha"), ("delayed", "fp8_dpa"), ("fp8_mha", "delayed")])
def test_a_mid_training_switch_is_bit_identical_to_a_fresh_model_on_the_target(a, b):
    recipes = {"bf16": None, "delayed": te.recipe.DelayedScaling(), "fp8_dpa": DPA, "fp8_mha": MHA}
    batches = _batches(6, seed=1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for batch in batches[:3]:
        opt.zero_grad(set_to_none=True)
        _loss(model, batch, recipes[a]).backward()
        opt.step()
    te.apply_recipe(model, recipes[b], example_inputs=(batches[3][:, :-1],))  # the switch, nothing run yet
    fresh = GPT(CONFIG)
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    te.apply_recipe(fresh, recipes[b], example_inputs=(batches[3][:, :-1],))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    for i, batch in enumerate(batches[3:]):
        losses = []
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad(set_to_none=True)
            loss = _loss(m, batch, OWN)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {i}"
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p, q), f"step {i}: {name}"
    rules = model.blocks[0].attn.fusion_plan().rules()
    if b == "fp8_mha":
        assert "forward_dpa_linear_bias_add" in rules, rules
