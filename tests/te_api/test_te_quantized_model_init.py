"""te.quantized_model_init as TransformerEngine documents it: modules made inside
hold only quantized copies of their weights (here: the Parameter is the FP8
tensor, with its high-precision ``dtype``), train with a torch optimizer, and
``preserve_high_precision_init_val`` keeps the initial value on the CPU."""

from __future__ import annotations

import torch

import te_fuser as te
from op_testing import FP8_RECIPES


def test_a_linear_made_inside_holds_a_quantized_weight_of_its_dtype():
    with te.quantized_model_init(enabled=True, recipe=FP8_RECIPES["current"]):
        layer = te.ops.Linear(128, 64)
    w = layer.linear.weight
    assert isinstance(w, torch.nn.Parameter) and w.dtype is torch.float32 and w.shape == (64, 128)
    assert w.fp8_nbytes == 64 * 128 + 4 and w.fp8_storage.q.fp8_dtype is torch.float8_e4m3fn
    assert te.parameter_bytes(layer) == 64 * 128 + 4 + 64 * 4  # the FP8 weight and the fp32 bias


def test_it_trains_with_a_torch_optimizer_under_autocast():
    recipe = FP8_RECIPES["current"]
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        layer = te.ops.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen)
    target = x.flip(-1)
    losses = []
    for _ in range(30):
        with te.autocast(recipe=recipe):
            loss = (layer(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_enabled_false_keeps_high_precision_weights():
    with te.quantized_model_init(enabled=False):
        layer = te.ops.Linear(32, 32)
    assert type(layer.linear.weight) is torch.nn.Parameter
