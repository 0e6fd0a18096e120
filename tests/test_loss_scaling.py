"""fp16 training with ``torch.amp.GradScaler`` through te_fuser ops, as users train it.

A loss scaler learns of an overflow only from the gradients it unscales: an inf or
NaN anywhere and it skips the step and lowers the scale. An FP8 cast sits between
every overflowing gradient and the GEMMs, so it must keep that signal: a value
that is not finite casts to NaN (a finite one beyond the format's range still
saturates). Had inf saturated to +-fmax, an overflowing step would have looked
like a very large, finite gradient: the scaler would have applied it and raised
its scale again. Here the scaler skips exactly the steps that a model without FP8
skips, under every recipe, and training goes on after them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES
from te_fuser.models.gpt import GPT, GPTConfig, load_stdlib_corpus, sample_windows
from te_fuser.quantization import DelayedScalingQuantizer

H, F, TOKENS = 64, 128, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["delayed", "current", "block", "mxfp8", "rowwise"]


def _model() -> te.ops.Sequential:
    """A pre-norm MLP ending in a Linear without a bias, as a language model's head
    (a bias's gradient is a sum of the output gradient, which would show an inf on
    its own; the GEMMs' gradients are the ones the FP8 casts touch)."""
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, F), te.ops.GELU(),
                             te.ops.Linear(F, H, bias=False))


def _train(model, recipe, steps: int = 8):
    """AdamW under fp16 autocast with a GradScaler whose scale moves in steps of
    2**8: the loss is ``sum(y * target)`` with ``max|target| = 1``, so the output
    gradient is the scale times the target and overflows fp16 (inf) exactly when
    the scale is 2**16 or more, and the gradients within stay far from fp16's
    range at 2**8. Returns the scale before each step and the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**24, growth_factor=2.0**8, backoff_factor=2.0**-8,
                                  growth_interval=2)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(TOKENS, H, generator=gen)
    target = (target / target.abs().max()).to(DEVICE)
    scales, losses = [], []
    for _ in range(steps):
        x = torch.randn(TOKENS, H, generator=gen).to(DEVICE)
        with torch.autocast(DEVICE, dtype=torch.float16), te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        loss = (y.float() * target).sum()
        before = [p.detach().clone() for p in model.parameters()]
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped = scaler.get_scale() < scales[-1]
        for b, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(b, p) == skipped, f"step {len(scales)}: skipped {skipped}, a parameter changed or not"
        losses.append(loss.item())
    return scales, losses


@pytest.mark.parametrize("name", NAMES)
def test_the_loss_scaler_skips_the_steps_a_model_without_fp8_skips(name):
    """Eight steps: the scale starts at 2**24 and 2**16 (both overflow), trains at
    2**8, grows back to 2**16 (overflows again), ...: every FP8 recipe sees the same
    overflows as the model without FP8, so the scales are the same sequence; every
    parameter and every delayed-scaling scale ends finite, and the loss falls."""
    torch.manual_seed(0)
    plain = _model().to(DEVICE)
    fp8 = copy.deepcopy(plain)
    want, _ = _train(plain, None)
    got, losses = _train(fp8, RECIPES[name])
    assert want == [2.0**24, 2.0**16, 2.0**8, 2.0**8, 2.0**16, 2.0**8, 2.0**8, 2.0**16], want
    assert got == want
    assert all(torch.isfinite(p).all() for p in fp8.parameters())
    quantizers = [q for m in fp8.modules() for q in getattr(m, "installed_quantizers", {}).values()]
    assert quantizers
    for q in quantizers:
        if isinstance(q, DelayedScalingQuantizer):
            assert torch.isfinite(q.scale).all() and (q.scale > 0).all(), q.scale
    trained = [loss for loss, scale in zip(losses, got) if scale == 2.0**8]
    assert trained[-1] < trained[0], losses


@pytest.mark.parametrize("name", ["none", *NAMES])
def test_a_non_finite_input_gives_a_non_finite_output(name):
    """An inf in the input (a diverged activation) and a NaN: the output row it
    reaches is not finite under every recipe, as in plain torch, so a loop that
    checks its loss sees it; the other rows stay finite under a recipe whose scale
    does not come from that input (delayed scaling)."""
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(H, H, bias=False)).to(DEVICE)
    recipe = RECIPES[name]
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        model(torch.randn(TOKENS, H, device=DEVICE))  # delayed scaling: a finite history first
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(TOKENS, H, device=DEVICE)
        x[3, 7] = bad
        with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        assert not torch.isfinite(y[3]).any(), f"{name}: an input {bad} vanished from its output row"
        if name == "delayed":
            assert torch.isfinite(y[torch.arange(TOKENS, device=DEVICE) != 3]).all()


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_the_gpt_under_a_loss_scaler_skips_what_it_skips_without_fp8(name):
    """The yardstick GPT (smoke size, te attention) on real text under fp16 autocast
    and a GradScaler that starts at 2**40 and backs off by 2**8: the cross-entropy's
    gradients overflow fp16 at 2**40, 2**32 and 2**24 and not at 2**16, and the FP8
    run skips exactly the steps the run without FP8 skips, then trains on."""
    data = load_stdlib_corpus(200_000)
    config = GPTConfig.smoke().replace(n_layer=2, seq_len=32, batch_size=2)
    runs = {}
    for key, recipe in (("none", None), (name, RECIPES[name])):
        torch.manual_seed(0)
        model = GPT(config).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**40, backoff_factor=2.0**-8, growth_interval=100)
        gen = torch.Generator().manual_seed(0)
        scales, losses = [], []
        for _ in range(7):
            idx = sample_windows(data, config.batch_size, config.seq_len, gen).to(DEVICE)
            with torch.autocast(DEVICE, dtype=torch.float16), te.autocast(enabled=recipe is not None, recipe=recipe):
                logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs[key] = scales, losses
    assert runs["none"][0] == [2.0**40, 2.0**32, 2.0**24] + [2.0**16] * 4, runs["none"][0]
    assert runs[name][0] == runs["none"][0]
    assert runs[name][1][-1] < runs[name][1][3], runs[name][1]
