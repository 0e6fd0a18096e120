"""torch's contracts hold for te_fuser models: a second backward through a freed
graph raises, a second derivative through te ops raises rather than coming out
wrong, a non-floating input is a TypeError, and a warm model checks its input as a
fresh one does, with the op's own message, on the hot path too."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser import recipe as R
from te_fuser.ops import hot_guard

H = 64
RECIPES = {"none": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(),
           "mxfp8": R.MXFP8BlockScaling()}


def build():
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))


def call(model, x, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        return model(x)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_second_backward_through_a_freed_graph_raises(recipe_name):
    model = build()
    loss = call(model, torch.randn(32, H), RECIPES[recipe_name]).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
def test_a_second_derivative_through_te_ops_raises_and_the_first_is_right(recipe_name):
    """A gradient penalty (``autograd.grad(create_graph=True)`` on the input, then a
    backward through that gradient): the gradients made under create_graph are the
    plain backward's, bit for bit, and the backward through them raises, naming te
    ops, where it used to run and leave out the second derivative through the
    group's saved input and weights; plain torch modules around the group still
    differentiate twice."""
    recipe = RECIPES[recipe_name]
    model = build()
    head = torch.nn.Linear(H, 1)
    x = torch.randn(16, H)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    grads = []
    for create_graph, xi in zip((False, True), xs):
        model.zero_grad(set_to_none=True)
        y = head(call(model, xi, recipe)).sum()
        grads.append(torch.autograd.grad(y, [xi, *model.parameters()], create_graph=create_graph))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(RuntimeError, match="second derivative through te ops is not supported"):
        grads[1][0].square().sum().backward()
    z = torch.randn(16, H, requires_grad=True)  # torch's own layers: untouched
    (g,) = torch.autograd.grad(head(z).sum(), z, create_graph=True)
    g.square().sum().backward()
    assert head.weight.grad is not None


def test_retain_graph_runs_the_backward_twice():
    model = build()
    loss = call(model, torch.randn(32, H), RECIPES["current"]).sum()
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for g1, p in zip(once, model.parameters()):
        torch.testing.assert_close(p.grad, 2 * g1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_non_floating_input_is_a_type_error_and_the_plan_keeps_working(dtype):
    model = build()
    x = torch.randn(32, H)
    expected = call(model, x, RECIPES["current"])
    with pytest.raises(TypeError, match=r"input dtype must be one of .*got " + str(dtype).replace("torch.", "")):
        call(model, torch.ones(32, H, dtype=dtype), RECIPES["current"])
    assert torch.equal(call(model, x, RECIPES["current"]), expected)


def test_float64_is_refused_under_an_fp8_recipe_and_runs_in_high_precision():
    model = build().double()
    x = torch.randn(32, H, dtype=torch.float64)
    assert call(model, x, None).dtype == torch.float64
    with pytest.raises(TypeError, match="under an FP8 recipe, got float64"):
        call(model, x, RECIPES["delayed"])


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return type(err), str(err)
    raise AssertionError("no error")


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("recipe_name", ["none", "current"])
def test_a_warm_model_checks_the_input_width_with_the_ops_message(recipe_name, compiled, monkeypatch):
    if compiled and hot_guard.guard_module() is None:
        pytest.skip(f"no compiled hot path: {hot_guard.unavailable_reason()}")
    recipe = RECIPES[recipe_name]
    fresh_error = _message(lambda: call(build(), torch.randn(32, H + 1), recipe))
    model = build()
    for _ in range(3):
        call(model, torch.randn(32, H), recipe)  # warm: hits on the hot path
    if not compiled:
        for fuser in model._fusers():
            fuser.entry = fuser.run  # the Python path
        model.__dict__.pop("forward", None)
    assert _message(lambda: call(model, torch.randn(32, H + 1), recipe)) == fresh_error
    assert "LayerNorm: input's last dim is 65, expected 64" in fresh_error[1]
    assert call(model, torch.randn(32, H), recipe).shape == (32, H)


def test_a_warm_mxfp8_model_refuses_rows_a_fresh_one_refuses():
    """MXFP8 blocks of 32 run along the rows of the wgrad operands: a row count the
    fresh model refuses must be refused by the warm one too."""
    recipe = RECIPES["mxfp8"]
    fresh_error = _message(lambda: call(build(), torch.randn(48, H, requires_grad=True), recipe))
    model = build()
    for _ in range(2):
        call(model, torch.randn(64, H, requires_grad=True), recipe)
    assert _message(lambda: call(model, torch.randn(48, H, requires_grad=True), recipe)) == fresh_error
    assert call(model, torch.randn(96, H, requires_grad=True), recipe).shape == (96, H)  # a new valid shape


def test_varying_row_counts_hit_the_published_plan():
    model = build()
    recipe = RECIPES["current"]
    for rows in (8, 16, 8, 24, 16):
        call(model, torch.randn(rows, H), recipe)
    stats = model.fusion_stats()
    assert stats.builds == 1 and stats.hits == 4


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the input dtypes of every matrix product torch runs."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def test_high_precision_under_bf16_autocast_runs_every_gemm_in_bf16():
    """fp32 master weights, bf16 compute: forward, dgrad and wgrad all multiply bf16
    (an fp32 product of bf16 data would leave the tensor cores idle)."""
    model = build()
    x = torch.randn(32, H, requires_grad=True)
    with _MatmulDtypes() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
    assert mode.seen == {torch.bfloat16}
    assert model[1].weight.grad.dtype == torch.float32


@pytest.mark.parametrize("fuse", [True, False])
def test_an_fp32_residual_stream_stays_fp32_under_bf16_autocast(fuse):
    """``bf16 sub-layer output + fp32 residual`` is fp32, as in plain torch."""
    torch.manual_seed(0)
    block = te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, H), te.ops.AddExtraInput(), fuse=fuse)
    x = torch.randn(8, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x, x)
        expected = torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (H,), block[0].weight, block[0].bias),
                                              block[1].weight, block[1].bias) + x
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1.6e-2, atol=1e-2)
