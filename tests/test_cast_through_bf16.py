"""The column-sums casts of an fp32 gradient read through bf16 (``round_bf16``).

A residual stream kept in fp32 hands the projection before it an fp32 gradient,
which the bias sums as it came while the GEMMs take it in bf16. The casts with
``round_bf16`` read fp32 and round each value to bf16 in registers: their copies,
scale and amax must be bit for bit those of the same cast of ``x.to(bfloat16)``
(a NaN made positive, as CUDA's conversion makes it), their sums bit for bit their
own sums of ``x`` without the rounding. Checked for
every backend that runs here (the reference; Triton, interpreted without a GPU;
the CUDA kernels on a GPU), on fp32 values chosen to be awkward for the rounding:
bf16 ties either way, values past the largest bf16, inf, NaN of either sign,
subnormals and signed zeros. Then the quantizers (``as_dtype``) and the
``backward_linear_bias`` rule fed an fp32 gradient, fused against unfused.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser.kernels import cuda as ck
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from test_triton_cast import DEVICE
from tolerances import assert_bitwise, assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BACKENDS = {"reference": ref, "triton": tk}
if DEVICE == "cuda" and ck.unavailable_reason() is None:
    BACKENDS["cuda"] = ck
KERNELS = ("quantize_current_column_sums", "quantize_tensorwise_column_sums")


def _fn(module, kernel: str):
    return getattr(module, f"{kernel}_reference" if module is ref else kernel)


def awkward_fp32(rows: int, cols: int, seed: int = 0, specials: bool = True) -> torch.Tensor:
    """fp32 values off the bf16 grid over many binades, with ties of the rounding
    to bf16 (both parities of the kept mantissa), values that round past the
    largest bf16 to inf, and (``specials``) inf, NaN of both signs, subnormals and
    signed zeros scattered over a (rows, cols) matrix."""
    gen = torch.Generator().manual_seed(seed)
    x = (-2.3 + 0.5 * torch.randn(rows, cols, generator=gen)) * torch.exp2(
        torch.randint(-20, 20, (rows, cols), generator=gen).float())
    bits = x.view(torch.int32)
    ties = (bits & -65536) | 0x8000  # exactly halfway between two bf16 values
    tie_at = torch.rand(rows, cols, generator=gen) < 0.1
    x = torch.where(tie_at, ties.view(torch.float32), x)
    if specials:
        values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3961e38, -3.4e38, 1e-40, -1e-42,
                               2.0**-126, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
        nan_neg = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # 0xFFFFFFFF: a NaN, sign set
        nan_pos = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
        values = torch.cat([values, nan_neg, nan_pos])
        flat = x.view(-1)
        where = torch.randperm(flat.numel(), generator=gen)[: min(flat.numel(), values.numel())]
        flat[where] = values[: where.numel()]
    return x.to(DEVICE)


def _cast(module, kernel, x, fp8_dtype, columnwise, round_bf16):
    """(data, data_t, scale or None, scale_inv or None, amax, sums) of ``kernel``."""
    fn = _fn(module, kernel)
    if kernel == "quantize_current_column_sums":
        return tuple(fn(x, fp8_dtype, False, 0.0, True, columnwise, round_bf16))
    scale = torch.tensor(0.75 if fp8_dtype is E4M3 else 2.0**-100, device=x.device)
    data, data_t, amax, sums = fn(x, scale, fp8_dtype, True, columnwise, None, round_bf16)
    return data, data_t, None, None, amax, sums


PARTS = ("data", "data_t", "scale", "scale_inv", "amax")


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape,columnwise,specials", [((67, 96), True, True), ((130, 40), True, False),
                                                       ((33, 8), False, True), ((1, 16), True, False)])
def test_the_cast_is_that_of_the_bf16_tensor_and_the_sums_those_of_x(backend_name, kernel, fp8_dtype, shape,
                                                                     columnwise, specials):
    module = BACKENDS[backend_name]
    x = awkward_fp32(*shape, specials=specials)
    through = _cast(module, kernel, x, fp8_dtype, columnwise, True)
    of_bf16 = _cast(module, kernel, ref.bf16_copy_reference(x), fp8_dtype, columnwise, False)
    of_fp32 = _cast(module, kernel, x, fp8_dtype, columnwise, False)
    context = f"{backend_name} {kernel} {fp8_dtype} {shape}"
    for part, got, want in zip(PARTS, through[:5], of_bf16[:5]):
        assert (got is None) == (want is None), f"{context} {part}"
        if want is not None:
            assert_bitwise(got, want, f"{context} {part}")
    assert_bitwise(through[5], of_fp32[5], f"{context} sums (of x as given)")
    if not specials:  # the sums against float64 (inf and NaN have no finite sum to compare)
        assert_close(through[5], x.double().sum(dim=0), "column_sums_fp32", f"{context} sums", scaled=True)
    if module is not ref:  # and the backend against the reference, bit for bit but the sums' order
        expected = _cast(ref, kernel, x, fp8_dtype, columnwise, True)
        for part, got, want in zip(PARTS, through[:5], expected[:5]):
            if part == "amax" and torch.isnan(want):  # torch's own amax picks a NaN's bits of its own
                assert torch.isnan(got), f"{context}: amax {got.item()} where the reference's is NaN"
            elif want is not None:
                assert_bitwise(got, want, f"{context} {part} against the reference")


def test_a_nan_of_either_sign_is_read_as_the_nan_of_a_gpu_bf16_copy():
    """bf16 0x7FFF, a positive NaN: its byte 0x7F (inf is 0x7F too, 1.0 is 0x3C)."""
    x = torch.tensor([[-1, 0x7FC00001, 0x3F800000, 0x7F800000]], dtype=torch.int32).view(torch.float32)
    x = x.expand(16, 4).contiguous().to(DEVICE)
    for name, module in BACKENDS.items():
        scale = torch.tensor(1.0, device=DEVICE)
        data, data_t, _, _ = _fn(module, "quantize_tensorwise_column_sums")(x, scale, E5M2, True, True, None, True)
        assert data.view(torch.uint8)[0].tolist() == [0x7F, 0x7F, 0x3C, 0x7F], name
        assert_bitwise(data_t.t(), data, f"{name} data_t")


@pytest.mark.parametrize("backend_name", [b for b in BACKENDS if b != "reference"])
def test_a_cast_that_is_not_a_column_sums_cast_does_not_take_round_bf16(backend_name):
    x = awkward_fp32(16, 32, specials=False)
    if backend_name == "cuda":
        prepared = ck.quantize_current.prepare(E4M3)
        with pytest.raises(ValueError, match="round_bf16 and sums_dtype are arguments of the column-sums casts only"):
            prepared(x, True, True, True)
    with pytest.raises(TypeError):
        BACKENDS[backend_name].quantize_current(x, E4M3, False, 0.0, True, True, None, True)


def _grad_quantizer(recipe_name: str):
    model = te.ops.Sequential(te.ops.Linear(64, 64)).to(DEVICE, torch.bfloat16)
    run(model, representable(64, 64).to(DEVICE, torch.bfloat16), recipe=RECIPES[recipe_name])
    return model[0].basic_ops[0]._quantizers["grad_output"]


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block", "mxfp8", "custom_identity"])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_every_quantizer_casts_as_bf16_and_sums_as_given(recipe_name, backend_name):
    """``quantize_with_column_sums(x_fp32, as_dtype=bf16)``: the copies (and the
    scaling state after them) those of ``x.to(bf16)``, the sums those of x."""
    x = awkward_fp32(64, 96, seed=1, specials=False)
    with te.autocast(enabled=False, backend=backend_name):
        quantizer = _grad_quantizer(recipe_name)
        through = copy.deepcopy(quantizer)
        of_bf16 = copy.deepcopy(quantizer)
        q_t, sums_t = through.quantize_with_column_sums(x, rowwise=True, columnwise=True, as_dtype=torch.bfloat16)
        q_b, _ = of_bf16.quantize_with_column_sums(x.to(torch.bfloat16), rowwise=True, columnwise=True)
        _, sums_x = copy.deepcopy(quantizer).quantize_with_column_sums(x, rowwise=True, columnwise=True)
        state_t, state_b = through.state_dict(), of_bf16.state_dict()
    assert_bitwise(sums_t, sums_x, f"{recipe_name} sums")
    if isinstance(q_b, torch.Tensor):  # high precision: the converted tensor itself
        assert_bitwise(q_t, q_b, recipe_name)
        return
    assert q_t.dtype == torch.bfloat16, recipe_name
    for which in ("rowwise", "columnwise"):
        a, b = getattr(q_t, which), getattr(q_b, which)
        assert_bitwise(a.data, b.data, f"{recipe_name} {which} data")
        assert_bitwise(a.scale_inv, b.scale_inv, f"{recipe_name} {which} scale_inv")
    assert state_t.keys() == state_b.keys()
    for key, value in state_b.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise(state_t[key], value, f"{recipe_name} state {key}")
        else:
            assert state_t[key] == value, f"{recipe_name} state {key}"


def test_as_dtype_is_checked_before_any_state_changes():
    with te.autocast(enabled=False, backend="reference"):
        quantizer = _grad_quantizer("delayed")
    before = quantizer.state_dict()
    with pytest.raises(TypeError, match="as_dtype must be None or one of"):
        quantizer.quantize_with_column_sums(torch.ones(4, 8, device=DEVICE), as_dtype=torch.int32)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise(quantizer.state_dict()[key], value, key)


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "mxfp8"])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_the_rule_fed_an_fp32_gradient_equals_unfused(recipe_name, backend_name):
    """``backward_linear_bias`` with dy in fp32 (from the fp32 sum with a residual)
    and bf16 GEMMs: dgrad and wgrad bit for bit the unfused ones (which cast
    ``dy.to(bf16)``), the bias gradient the fp32 sum of dy within the column sums'
    tolerance."""
    gen = torch.Generator().manual_seed(5)
    fused = te.ops.Sequential(te.ops.Linear(64, 96), te.ops.AddExtraInput()).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-3))
    unfused = copy.deepcopy(fused)
    x0 = representable(64, 64, generator=gen, dtype=torch.bfloat16, scale_exp=-3).to(DEVICE)
    residual = awkward_fp32(64, 96, seed=6, specials=False)  # an fp32 residual stream: the sum and its dy are fp32
    dy = awkward_fp32(64, 96, seed=7, specials=False) * 2.0**-6

    def grads(model):
        x = x0.clone().requires_grad_(True)
        out = model(x, residual)
        assert out.dtype == torch.float32
        out.backward(dy)
        return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}

    with te.autocast(enabled=True, recipe=RECIPES[recipe_name], backend=backend_name):
        out_f, dx_f, g_f = grads(fused)
        with te.ops.without_fusion_rules("backward_linear_bias"):
            out_u, dx_u, g_u = grads(unfused)
    assert "backward_linear_bias" in fused.fusion_plan().rules()
    assert "backward_linear_bias" not in unfused.fusion_plan().rules()
    assert_bitwise(out_f, out_u, "output")
    assert_bitwise(dx_f, dx_u, f"{recipe_name} dx")
    for name in g_u:
        if name.endswith("bias"):
            assert_close(g_f[name].double(), dy.double().sum(dim=0).to(g_f[name].dtype).double(),
                         torch.bfloat16, f"{recipe_name} grad {name} against float64", scaled=True)
            assert_close(g_f[name], g_u[name], torch.bfloat16, f"{recipe_name} grad {name}", scaled=True)
        else:
            assert_bitwise(g_f[name], g_u[name], f"{recipe_name} grad {name}")
