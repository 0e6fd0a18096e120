"""te.ops.GroupedLinear under every recipe against a float64 reference: outputs and
every gradient on representable inputs, odd and empty splits; bad inputs."""

from __future__ import annotations

import os

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable
from tolerances import assert_close

G, K, N = 4, 48, 40
SPLITS = [0, 7, 3, 11]  # an empty group, odd sizes
MX_SPLITS = [0, 64, 32, 32]  # MXFP8 scales 32 rows of each group's column-wise copies


def _module(dtype, gen, bias=True, k=K, n=N):
    op = te.ops.GroupedLinear(G, k, n, bias=bias).to(dtype)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else 0))
    return op


def run(op, x, sizes, recipe=None, dy=None):
    """Forward under ``recipe`` with the split sizes as the extra input, backward with
    ``dy``; returns ((y,), grads by name) as op_testing.run does."""
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = op(x, sizes)
    y.backward(dy)
    grads = {"x": x.grad, **{name: p.grad for name, p in op.named_parameters()}}
    return (y.detach(),), grads


def _reference(x, params, splits):
    """float64 loop of linears over the row groups; params named like the op's."""
    outs, start = [], 0
    for g, m in enumerate(splits):
        y = x[start:start + m] @ params[f"weight{g}"].t()
        if f"bias{g}" in params:
            y = y + params[f"bias{g}"]
        outs.append(y)
        start += m
    return torch.cat(outs)


CASES = [(r, "auto") for r in RECIPES] + [(r, "triton") for r in ("delayed", "current", "rowwise")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name, backend", CASES)
def test_grouped_linear_matches_float64_reference(recipe_name, backend, dtype):
    """``backend='triton'``: the grouped kernels run (under the interpreter on a CPU)."""
    if backend == "triton" and torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("these cases run the Triton kernels on CPU tensors through the interpreter; on a GPU "
                    "tests/test_grouped_gemm_kernel.py runs them compiled")
    with te.backend.use_backend(backend):
        _check_against_reference(recipe_name, dtype)


def _check_against_reference(recipe_name, dtype):
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(hash(recipe_name) % 2**31)
    mx = recipe_name == "mxfp8"
    splits, k, n = (MX_SPLITS, 64, 96) if mx else (SPLITS, K, N)
    op = _module(dtype, gen, k=k, n=n)
    x = representable(sum(splits), k, generator=gen, dtype=dtype)
    dy = representable(sum(splits), n, generator=gen, dtype=dtype)
    sizes = torch.tensor(splits)
    outs, grads = run(op, x, sizes, recipe=recipe, dy=dy)

    x64 = x.double().requires_grad_(True)
    params64 = {name: p.detach().double().requires_grad_(True) for name, p in op.named_parameters()}
    ref = _reference(x64, params64, splits)
    ref.backward(dy.double())
    context = f"GroupedLinear splits={splits} recipe={recipe_name} dtype={dtype}"
    assert outs[0].dtype == dtype and outs[0].shape == ref.shape, context
    assert_close(outs[0], ref.detach(), dtype, f"{context} output")
    assert_close(grads["x"], x64.grad, dtype, f"{context} dx")
    for name, p in params64.items():
        assert grads[name] is not None, f"{context}: no gradient for {name}"
        assert_close(grads[name], p.grad, dtype, f"{context} d{name}")
    assert torch.count_nonzero(grads["weight0"]) == 0 and torch.count_nonzero(grads["bias0"]) == 0, context


def test_grouped_linear_equals_a_loop_of_basic_linears_bit_for_bit_under_current_scaling():
    """Per-expert current scales and one input scale: the grouped kernels give each
    group the products a BasicLinear with the same quantizers' scales would, up to
    fp32 accumulation order; in bf16 on representable data, exactly."""
    gen = torch.Generator().manual_seed(5)
    op = _module(torch.bfloat16, gen, bias=False)
    x = representable(sum(SPLITS), K, generator=gen, dtype=torch.bfloat16)
    recipe = te.recipe.Float8CurrentScaling()
    (y,), _ = run(op, x, torch.tensor(SPLITS), recipe=recipe, dy=torch.ones(sum(SPLITS), N, dtype=torch.bfloat16))
    start = 0
    for g, m in enumerate(SPLITS):
        lin = te.ops.BasicLinear(K, N).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(getattr(op, f"weight{g}"))
        with te.autocast(recipe=recipe):
            want = lin(x[start:start + m]) if m else torch.empty(0, N, dtype=torch.bfloat16)
        assert torch.equal(y[start:start + m], want), g
        start += m


def test_grouped_linear_in_a_sequential_with_its_split_sizes_as_the_extra_input():
    gen = torch.Generator().manual_seed(2)
    op = _module(torch.float32, gen)
    model = te.ops.Sequential(op, te.ops.ReLU())
    x = representable(sum(SPLITS), K, generator=gen)
    with te.autocast(recipe=te.recipe.DelayedScaling()):
        y = model(x, torch.tensor(SPLITS))
    params = {name: p.detach().double() for name, p in op.named_parameters()}
    assert_close(y, torch.relu(_reference(x.double(), params, SPLITS)), torch.float8_e4m3fn, "Sequential")


def test_state_dict_names_follow_transformer_engine():
    op = te.ops.GroupedLinear(3, 8, 16)
    names = [n for n, _ in op.named_parameters()]
    assert names == ["weight0", "weight1", "weight2", "bias0", "bias1", "bias2"]
    assert all(torch.count_nonzero(b) == 0 for b in op.biases)
    assert [n for n, _ in te.ops.GroupedLinear(2, 8, 16, bias=False).named_parameters()] == ["weight0", "weight1"]


@pytest.mark.parametrize("splits, match", [
    ([7, 3, 11], "num_groups"),
    ([0, 7, 3, 10], "sum to 20"),
    ([0, -1, 11, 11], "non-negative"),
])
def test_bad_split_sizes_name_the_op_and_leave_the_scaling_state_alone(splits, match):
    op = te.ops.GroupedLinear(G, K, N, name="experts")
    x = torch.randn(sum(SPLITS), K)
    recipe = te.recipe.DelayedScaling()
    with te.autocast(recipe=recipe):
        op(x, torch.tensor(SPLITS))
    before = {t: {k: v.clone() for k, v in q.state_dict().items() if isinstance(v, torch.Tensor)}
              for t, q in op.installed_quantizers.items()}
    with pytest.raises(ValueError, match=match) as info:
        with te.autocast(recipe=recipe):
            op(x, torch.tensor(splits))
    assert "GroupedLinear('experts')" in str(info.value)
    for t, q in op.installed_quantizers.items():
        for k, v in before[t].items():
            assert torch.equal(q.state_dict()[k], v), (t, k)


def test_mxfp8_split_sizes_not_multiples_of_32_are_refused_before_any_cast():
    op = te.ops.GroupedLinear(2, 64, 64)
    x = torch.randn(48, 64, requires_grad=True)
    with pytest.raises(ValueError, match="32"):
        with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
            op(x, torch.tensor([16, 32]))


def test_bad_constructor_arguments_and_inputs_name_the_field():
    for ctor, field in ((lambda: te.ops.GroupedLinear(0, 4, 4), "num_groups"),
                        (lambda: te.ops.GroupedLinear(2, -4, 4), "in_features"),
                        (lambda: te.ops.GroupedLinear(2, 4, 4.0), "out_features")):
        with pytest.raises(ValueError, match=field):
            ctor()
    op = te.ops.GroupedLinear(2, 8, 8)
    with pytest.raises(ValueError, match="in_features=8"):
        op(torch.randn(4, 6), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="integer tensor"):
        op(torch.randn(4, 8), torch.tensor([2.0, 2.0]))
