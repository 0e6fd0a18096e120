"""A residual whose extra input is the fuser's own input (``seq(x, x)``, the GPT's
sub-layers): the first op (a norm) adds the residual branch's gradient into its
own input gradient, inside its kernel, instead of autograd adding the two in a
kernel of their own. With an fp32 input that is the same sum, rounded once as
autograd's addition rounds it: every gradient equals the run where the extra
input is a copy of x (autograd then adds them), bit for bit, under every recipe.
Elsewhere (a bf16 input, a first op that cannot add, two uses of x) autograd
adds, as before. The GPT trained as a user trains it (fused AdamW, evaluations
without FP8, a checkpoint resumed, recipe switches) gives the same loss bits
either way."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser.ops.basic import norm as norm_module
from training_loops import gpt_losses

H, F, ROWS = 32, 64, 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"] + (["cuda"] if DEVICE == "cuda" else [])
RECIPES = {"bf16": None, "delayed": te.recipe.DelayedScaling(), "current": te.recipe.Float8CurrentScaling()}


def residual_mlp(first: str = "layer_norm") -> te.ops.Sequential:
    torch.manual_seed(0)
    head = te.ops.LayerNorm(H) if first == "layer_norm" else te.ops.Linear(H, H)
    return te.ops.Sequential(head, te.ops.Linear(H, F), te.ops.GELU(), te.ops.Linear(F, H),
                             te.ops.AddExtraInput()).to(DEVICE)


def grads(model, x, recipe, alias: bool, dtype=torch.float32, steps: int = 2, backend: str | None = None):
    """The input's and parameters' gradients after ``steps`` fwd+bwd (a second step:
    delayed scaling's updated scales), with the residual the input itself or a copy."""
    model.zero_grad(set_to_none=True)
    x = x.clone().to(DEVICE, dtype).requires_grad_()
    for _ in range(steps):
        with torch.autocast(DEVICE, dtype=torch.bfloat16), \
                te.autocast(enabled=recipe is not None, recipe=recipe, backend=backend):
            y = model(x, x if alias else x.view_as(x))  # view_as: another tensor, the same values
        y.float().square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.fixture
def adds(monkeypatch):
    """How often the norm added the residual's gradient itself."""
    calls = []
    real = norm_module.LayerNorm.op_backward_adding

    def counted(self, ctx, dy, grad_add):
        if grad_add is not None:
            calls.append(grad_add.dtype)
        return real(self, ctx, dy, grad_add)

    monkeypatch.setattr(norm_module.LayerNorm, "op_backward_adding", counted)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_norm_adds_the_residual_gradient_and_every_gradient_keeps_its_bits(recipe, backend, adds):
    x = -2.3 + 0.5 * torch.randn(ROWS, H)
    fused = grads(residual_mlp(), x, RECIPES[recipe], alias=True, backend=backend)
    assert len(adds) == 2 and set(adds) == {torch.float32}, recipe
    apart = grads(residual_mlp(), x, RECIPES[recipe], alias=False, backend=backend)
    assert len(adds) == 2, "a copy of x as the residual: autograd adds"
    for i, (a, b) in enumerate(zip(fused, apart)):
        assert a is not None and torch.equal(a, b), f"{recipe}: gradient {i} differs"


def test_elsewhere_autograd_adds_and_the_gradients_are_the_same(adds):
    x = torch.randn(ROWS, H)
    for dtype in (torch.bfloat16,):
        fused = grads(residual_mlp(), x, None, alias=True, dtype=dtype)
        apart = grads(residual_mlp(), x, None, alias=False, dtype=dtype)
        assert all(torch.equal(a, b) for a, b in zip(fused, apart))
    fused = grads(residual_mlp("linear"), x, None, alias=True)
    apart = grads(residual_mlp("linear"), x, None, alias=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, apart))
    assert adds == [], "a bf16 input or a first op that cannot add: autograd adds"


def _train(adding: bool, monkeypatch) -> list:
    """The smoke GPT as a user trains it (``training_loops.gpt_losses``) with the
    norms adding the residual's gradient or not."""
    monkeypatch.setattr(norm_module.LayerNorm, "adds_input_grad", adding)  # read when the fusers are made
    return gpt_losses()


def test_a_training_loop_keeps_every_loss_bit_with_the_norm_adding(monkeypatch, adds):
    with_adding = _train(True, monkeypatch)
    handed = len(adds)
    assert handed, "the GPT's residual sub-layers hand their gradient to the norm"
    assert with_adding == _train(False, monkeypatch)
    assert len(adds) == handed, "without adds_input_grad autograd adds"
