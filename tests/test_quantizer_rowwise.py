"""Float8RowwiseQuantizer and the Float8RowwiseScaling recipe: one scale per row
of each GEMM operand, by hand and against float64, and a linear layer trained
under the recipe against its float64 reference."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise, assert_close

import te_fuser as te
from te_fuser.quantization import Float8RowwiseQuantizer, QuantizerRole

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).float().item()


def test_scales_by_hand():
    """Row amaxes 3 and 2 (the zero row keeps scale 1); columns 2, 3, 0.5."""
    x = torch.tensor([[1.0, -3.0, 0.5], [2.0, 0.25, 0.0], [0.0, 0.0, 0.0]])
    exact = Float8RowwiseQuantizer(E4M3, power_2_scales=False)(x, rowwise=True, columnwise=True)
    assert exact.scaling == "row" and exact.rowwise.scale_inv.shape == (3, 1)
    row_scales = torch.tensor([[f32(448 / 3)], [f32(448 / 2)], [1.0]])
    assert_bitwise(exact.rowwise.scale_inv, torch.tensor([[f32(3 / 448)], [f32(2 / 448)], [1.0]]), "row scale_inv")
    assert_bitwise(exact.rowwise.data, (x * row_scales).to(E4M3), "row data")
    col_scales = torch.tensor([[f32(448 / 2)], [f32(448 / 3)], [f32(448 / 0.5)]])  # rows of x.T
    assert exact.columnwise.data.shape == (3, 3) and exact.columnwise.scale_inv.shape == (3, 1)
    assert_bitwise(exact.columnwise.data, (x.t() * col_scales).to(E4M3), "column data")
    pow2 = Float8RowwiseQuantizer(E4M3)(x, rowwise=True, columnwise=False)  # power-of-2 scales by default
    assert_bitwise(pow2.rowwise.scale_inv, torch.tensor([[1 / 128], [1 / 128], [1.0]]), "pow2 scale_inv")
    assert pow2.columnwise is None


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(67, 96), (3, 5, 40)])
def test_dequantized_copies_are_within_the_format(fp8_dtype, shape):
    """Both copies, dequantized, equal x within the format's rounding, row by row:
    one scale per row of each copy (a large row does not coarsen the others)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape[:-1], generator=gen)).unsqueeze(-1)
    q = Float8RowwiseQuantizer(fp8_dtype, power_2_scales=False)(x, rowwise=True, columnwise=True)
    x2d = x.reshape(-1, shape[-1]).double()
    assert_close(q.rowwise.data.double() * q.rowwise.scale_inv.double(), x2d, fp8_dtype, "row-wise copy",
                 scaled=True)
    assert_close((q.columnwise.data.double() * q.columnwise.scale_inv.double()).t(), x2d, fp8_dtype,
                 "column-wise copy", scaled=True)


def test_the_recipe_builds_row_quantizers_per_role():
    recipe = te.recipe.Float8RowwiseScaling(weight_amax_epsilon=1e-3, power_2_scales=False)
    w = recipe.make_quantizer(QuantizerRole("linear", "weight"))
    g = recipe.make_quantizer(QuantizerRole("linear", "grad_output"))
    assert isinstance(w, Float8RowwiseQuantizer) and w.fp8_dtype == E4M3 and w.amax_epsilon == 1e-3
    assert g.fp8_dtype == E5M2 and g.amax_epsilon == 0.0 and not g.power_2_scales
    assert recipe.float8_rowwise_scaling() and not recipe.float8_current_scaling()
    assert "scaling='row'" in str(recipe) and str(recipe) != str(te.recipe.Float8RowwiseScaling())


def test_a_linear_trains_under_the_recipe_like_its_reference():
    """Representable inputs and weights (every row scale a power of two): the FP8
    forward and all gradients equal the float64 computation exactly."""
    from op_testing import representable

    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 16))
    with torch.no_grad():
        model[0].weight.copy_(representable(16, 32))
        model[0].bias.copy_(representable(16))
    x = representable(24, 32).requires_grad_()
    dy = representable(24, 16)
    with te.autocast(recipe=te.recipe.Float8RowwiseScaling()):
        y = model(x)
    y.backward(dy)
    w, b = model[0].weight.detach().double(), model[0].bias.detach().double()
    xd = x.detach().double()
    assert_bitwise(y.double(), xd @ w.t() + b, "y")
    assert_bitwise(x.grad.double(), dy.double() @ w, "dx")
    assert_bitwise(model[0].weight.grad.double(), dy.double().t() @ xd, "dw")
    linear = model[0].basic_ops[0]
    assert isinstance(linear.quantizer("weight"), Float8RowwiseQuantizer)
    assert linear.quantizer("grad_output").fp8_dtype == E5M2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gelu_mlp_trains_under_the_recipe_on_the_gpu(dtype):
    """The GPU's kernels (row casts, row-scaled GEMMs with their epilogues, fp32
    weight gradients) against float64 on representable data, under torch.autocast
    for bf16 as a training loop runs it."""
    from op_testing import representable

    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(128, 256), te.ops.GELU(), te.ops.Linear(256, 64)).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(representable(*p.shape) / 8)
    x = representable(96, 128).cuda().requires_grad_()
    dy = representable(96, 64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with te.autocast(recipe=te.recipe.Float8RowwiseScaling()):
            y = model(x)
    y.float().backward(dy)
    ref = te.ops.Sequential(te.ops.Linear(128, 256), te.ops.GELU(), te.ops.Linear(256, 64)).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    xr = x.detach().double().cpu().requires_grad_()
    yr = ref(xr)
    yr.backward(dy.double().cpu())
    assert_close(y.double().cpu(), yr, E4M3, "y", scaled=True)
    assert_close(x.grad.double().cpu(), xr.grad, E5M2, "dx", scaled=True)
    for (name, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad.double().cpu(), pr.grad, E5M2, f"grad {name}", scaled=True)
