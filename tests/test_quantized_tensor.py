"""Float8Tensor, the torch.Tensor subclass over FP8 copies: through torch functions,
autograd and the ops (te.ops.Quantize's output into Identity, Reshape, Dropout,
Bias, Linear and the extra inputs and outputs)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import te_fuser as te
from op_testing import FP8_RECIPES, representable
from te_fuser.quantization import Float8CurrentScalingQuantizer, MXFP8Quantizer
from te_fuser.quantization.float8_tensor import Float8Tensor
from tolerances import assert_bitwise

_CURRENT = FP8_RECIPES["current"]


def _f8(x, quantizer=None):
    quantizer = quantizer or Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    return Float8Tensor.from_quantized(quantizer.cast(x, rowwise=True, columnwise=False), quantizer)


def _offcentre(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return -2.3 + 0.5 * torch.randn(*shape, generator=gen)


def test_reports_the_nominal_dtype_and_holds_fp8_bytes():
    x = _offcentre(67, 96)
    f = _f8(x)
    assert (f.dtype, f.shape, f.device) == (torch.float32, x.shape, x.device)
    assert f.fp8_nbytes == 67 * 96 + 4  # E4M3 data and one fp32 scale
    assert f.dequantize().dtype is torch.float32 and f.dequantize(torch.bfloat16).dtype is torch.bfloat16


def test_torch_functions_dequantize_and_return_plain_tensors():
    x = _offcentre(13, 64, seed=1)
    f = _f8(x)
    deq = f.dequantize()
    for fn in (lambda t: t + 1.0, lambda t: t * t, torch.exp, lambda t: t.sum(0), lambda t: t @ t.t(),
               lambda t: t.to(torch.bfloat16), lambda t: t[3:7]):
        out = fn(f)
        assert type(out) is torch.Tensor
        assert_bitwise(out, fn(deq), "a torch function of a Float8Tensor")
    assert (deq - x).abs().max() <= x.abs().max() * 2.0**-4  # the cast's rounding, E4M3


@pytest.mark.parametrize("shape", [(3, 4, 64), (12, 64), (-1, 64)])
def test_views_that_keep_the_last_dim_keep_fp8_and_share_the_values(shape):
    x = _offcentre(12, 64, seed=2)
    f = _f8(x)
    v = f.reshape(shape)
    assert type(v) is Float8Tensor and v.fp8_storage is f.fp8_storage
    assert_bitwise(v.dequantize(), f.dequantize().reshape(shape), "a view")
    d = f.detach()
    assert type(d) is Float8Tensor and d.fp8_storage is f.fp8_storage
    other = f.reshape(24, 32)  # a new last dim: the scales' grid changes, so it dequantizes
    assert type(other) is torch.Tensor


def test_in_place_writes_cast_back_with_the_tensors_quantizer_and_reach_its_aliases():
    x = _offcentre(16, 32, seed=3)
    f = _f8(x)
    alias = f.detach()
    before = f.fp8_storage.writes
    f.mul_(2.0)
    assert f.fp8_storage.writes == before + 1
    assert_bitwise(alias.dequantize(), _f8(_f8(x).dequantize() * 2.0).dequantize(), "mul_")
    alias.copy_(torch.zeros(16, 32))
    assert f.dequantize().abs().max() == 0


def test_an_fp8_activation_without_a_quantizer_refuses_writes():
    x = _offcentre(8, 32, seed=4)
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).cast(x)
    f = Float8Tensor.from_quantized(q)  # no quantizer: read-only
    with pytest.raises(RuntimeError, match="no quantizer"):
        f.add_(1.0)


def test_checkpoints_and_deep_copies_keep_the_exact_bytes():
    x = _offcentre(32, 64, seed=5)
    f = _f8(x, MXFP8Quantizer(torch.float8_e4m3fn))
    buf = io.BytesIO()
    torch.save({"w": f}, buf)
    buf.seek(0)
    g = torch.load(buf, weights_only=False)["w"]
    assert type(g) is Float8Tensor and g.fp8_storage.q.scaling == f.fp8_storage.q.scaling
    assert torch.equal(g.fp8_storage.q.rowwise.data.view(torch.uint8), f.fp8_storage.q.rowwise.data.view(torch.uint8))
    h = copy.deepcopy(f)
    assert h.fp8_storage is not f.fp8_storage
    assert_bitwise(h.dequantize(), f.dequantize(), "deepcopy")


def test_autograd_through_a_leaf_float8_tensor():
    x = _offcentre(8, 16, seed=6)
    leaf = _f8(x).requires_grad_(True)
    w = torch.randn(16, 4, dtype=torch.float64)
    (leaf.double() @ w).sum().backward()
    assert type(leaf.grad) is torch.Tensor and leaf.grad.dtype is torch.float32
    assert_bitwise(leaf.grad, w.sum(1).float().expand(8, 16), "the gradient of a Float8Tensor leaf")


# -- te.ops.Quantize's output through the ops --------------------------------------------
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "block", "delayed"])
def test_quantize_returns_a_float8_tensor_of_the_rounded_values(recipe_name):
    x = _offcentre(32, 128, seed=7)
    with te.autocast(recipe=FP8_RECIPES[recipe_name]):
        y = te.ops.Sequential(te.ops.Quantize())(x)
    assert type(y) is Float8Tensor and y.dtype is torch.float32
    q = y.fp8_storage.q
    assert q.fp8_dtype is torch.float8_e4m3fn
    err = (y.dequantize() - x).abs().max().item()
    assert 0 < err <= x.abs().max().item() * 2.0**-3, f"recipe={recipe_name}: the cast's error {err}"


_FOLLOWERS = {
    "Identity": (lambda: te.ops.Identity(), lambda x: x),
    "Reshape": (lambda: te.ops.Reshape((4, 8, 64)), lambda x: x.reshape(4, 8, 64)),
    "Dropout_eval": (lambda: te.ops.Dropout(0.3).eval(), lambda x: x),
    "ConstantScale": (lambda: te.ops.ConstantScale(0.5), lambda x: 0.5 * x),
}


@pytest.mark.parametrize("name", sorted(_FOLLOWERS))
def test_quantize_then_a_passing_op_matches_float64(name):
    make, ref = _FOLLOWERS[name]
    x = _offcentre(32, 64, seed=8).requires_grad_(True)
    model = te.ops.Sequential(te.ops.Quantize(), make())
    with te.autocast(recipe=_CURRENT):
        y = model(x)
    x_q = te.ops.Sequential(te.ops.Quantize())
    with te.autocast(recipe=_CURRENT):
        x_fp8 = x_q(x.detach()).dequantize().double()
    assert_bitwise(y.double() if type(y) is torch.Tensor else y.dequantize().double(), ref(x_fp8), name)
    if name in ("Identity", "Reshape", "Dropout_eval"):
        assert type(y) is Float8Tensor, f"{name} passes FP8 on"
    dy = torch.randn(y.shape)
    y.backward(dy)
    expected = 0.5 * dy if name == "ConstantScale" else dy.reshape(32, 64)
    assert_bitwise(x.grad, expected.reshape(32, 64), f"{name}: the gradient through Quantize(forward only)")


def test_quantize_then_dropout_in_training_and_bias_dequantize():
    x = _offcentre(16, 64, seed=9).requires_grad_(True)
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Quantize(), te.ops.Dropout(0.25), te.ops.Bias(64))
    with torch.no_grad():
        model[2].bias.copy_(torch.linspace(-1, 1, 64))
    with te.autocast(recipe=_CURRENT):
        y = model(x)
    assert type(y) is torch.Tensor
    with te.autocast(recipe=_CURRENT):
        x_fp8 = te.ops.Sequential(te.ops.Quantize())(x.detach()).dequantize()
    kept = (y - model[2].bias.detach()) != 0
    assert_bitwise(y[kept], (x_fp8 * (torch.ones(()) / 0.75) + model[2].bias.detach())[kept], "dropout + bias of FP8 values")
    y.sum().backward()
    assert_bitwise(x.grad, kept.float() * (torch.ones(()) / 0.75), "dropout's gradient")


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_quantize_then_linear_takes_the_fp8_input_and_matches_float64(recipe_name):
    gen = torch.Generator().manual_seed(10)
    x = representable(4, 8, 64, generator=gen).requires_grad_(True)
    w = representable(32, 64, generator=gen)
    model = te.ops.Sequential(te.ops.Quantize(), te.ops.BasicLinear(64, 32))
    with torch.no_grad():
        model[1].weight.copy_(w)
    with te.autocast(recipe=FP8_RECIPES[recipe_name]):
        y = model(x)
    assert_bitwise(y.double(), x.detach().double() @ w.double().t(), f"Quantize -> Linear recipe={recipe_name}")
    y.backward(torch.ones_like(y))
    assert model[1].weight.grad is not None and x.grad is not None
    assert_bitwise(x.grad.double(), torch.ones(4, 8, 32, dtype=torch.float64) @ w.double(), "dgrad")


def test_a_float8_tensor_flows_into_a_second_sequential_and_its_extra_outputs():
    x = _offcentre(16, 64, seed=11).requires_grad_(True)
    first = te.ops.Sequential(te.ops.Quantize())
    second = te.ops.Sequential(te.ops.MakeExtraOutput(), te.ops.Identity())
    with te.autocast(recipe=_CURRENT):
        x_fp8 = first(x)
        y, branch = second(x_fp8)
    assert type(x_fp8) is Float8Tensor and x_fp8.grad_fn is not None  # a non-leaf
    assert type(y) is Float8Tensor and type(branch) is Float8Tensor
    assert_bitwise(branch.dequantize(), x_fp8.dequantize(), "the extra output")
    (y.sum() + 2 * branch.sum()).backward()
    assert_bitwise(x.grad, torch.full_like(x, 3.0), "the gradient through both outputs")


def test_add_extra_input_of_fp8_values_dequantizes():
    x, r = _offcentre(8, 32, seed=12), _offcentre(8, 32, seed=13)
    with te.autocast(recipe=_CURRENT):
        x_fp8 = te.ops.Sequential(te.ops.Quantize())(x)
        y = te.ops.Sequential(te.ops.AddExtraInput())(x_fp8, r)
    assert type(y) is torch.Tensor
    assert_bitwise(y, x_fp8.dequantize() + r, "FP8 input + extra input")


@pytest.mark.parametrize("after", ["gelu", "rmsnorm"])
def test_an_op_whose_kernels_read_plain_tensors_gets_the_fp8_input_dequantized(after):
    """Quantize -> GELU / RMSNorm on the Triton backend (its kernels read raw storage):
    the fuser hands them the Float8Tensor's values, as the same op given them plainly."""
    from te_fuser import backend

    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU
    torch.manual_seed(0)
    second = (te.ops.GELU() if after == "gelu" else te.ops.RMSNorm(64)).to(device)
    x = (-1.3 + torch.randn(32, 64)).to(device)
    recipe = te.recipe.Float8CurrentScaling()
    with backend.use_backend("triton"), te.autocast(recipe=recipe):
        got = te.ops.Sequential(te.ops.Quantize(), second)(x)
        q = te.ops.Quantize()(x)
        assert type(q) is Float8Tensor
        want = te.ops.Sequential(second)(q.dequantize())
    assert type(got) is torch.Tensor
    assert torch.equal(got, want), after
