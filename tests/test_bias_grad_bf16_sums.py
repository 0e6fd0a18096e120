"""The column-sums casts return a bf16 bias's gradient in bf16 (``sums_dtype``).

The sums accumulate in fp32 as before; with ``sums_dtype=torch.bfloat16`` each
total is rounded once to the nearest bf16 (ties to even) where the sums are added
up, so a bf16 bias needs no conversion after the cast (on the GPU: no launch and
no allocation for it). Checked for every backend that runs here (the reference;
Triton, interpreted without a GPU; the CUDA kernels on a GPU, one launch and
separate launches, the prepared casts and the cast with its state update):
every output bit for bit the fp32 call's, the sums bit for bit its fp32 sums
rounded as the GPU rounds. Then the quantizers, a bad ``sums_dtype`` named before
any state changes, and the layer: a bf16 Linear with a bias under each recipe,
fused against unfused, its bias gradient bf16 and the fp32 sums rounded once.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable
from te_fuser.kernels import cuda as ck
from te_fuser.kernels import reference as ref
from test_cast_through_bf16 import BACKENDS, E4M3, E5M2, KERNELS, _fn, awkward_fp32  # the backends that run here
from test_triton_cast import DEVICE, adversarial
from tolerances import assert_bitwise, assert_close

BF16 = torch.bfloat16


def _cast(module, kernel, x, columnwise, round_bf16, **sums):
    """Every output of ``kernel`` as a tuple (the sums last)."""
    fn = _fn(module, kernel)
    if kernel == "quantize_current_column_sums":
        return tuple(fn(x, E5M2, False, 0.0, True, columnwise, round_bf16, **sums))
    scale = torch.tensor(0.75, device=x.device)
    return tuple(fn(x, scale, E5M2, True, columnwise, None, round_bf16, **sums))


def _same(got: tuple, want: tuple, context: str) -> None:
    """Every output but the sums bit for bit; the sums are the fp32 call's rounded to bf16."""
    for i, (a, b) in enumerate(zip(got[:-1], want[:-1])):
        if b is None:
            assert a is None, f"{context}: output {i}"
        else:
            assert_bitwise(a, b, f"{context}: output {i}")
    assert got[-1].dtype == BF16 and got[-1].shape == want[-1].shape, context
    assert_bitwise(got[-1], ref.column_sums_as(want[-1], BF16), f"{context}: sums")


CASES = [  # (shape, x dtype, round_bf16, columnwise): row tiles of 128 rows, one and several, edges
    ((67, 96), BF16, False, True), ((300, 40), BF16, False, True), ((130, 264), torch.float32, True, True),
    ((33, 8), torch.float32, False, False), ((1, 16), BF16, False, True),
]


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,dtype,round_bf16,columnwise", CASES)
def test_bf16_sums_are_the_fp32_sums_rounded_once(backend_name, kernel, shape, dtype, round_bf16, columnwise):
    module = BACKENDS[backend_name]
    if dtype is torch.float32:
        x = awkward_fp32(*shape, seed=3)  # ties of the rounding, values past bf16's largest, inf, NaN of both signs
    else:
        x = adversarial(*shape, dtype=dtype).to(DEVICE)
    want = _cast(module, kernel, x, columnwise, round_bf16)
    got = _cast(module, kernel, x, columnwise, round_bf16, sums_dtype=BF16)
    _same(got, want, f"{backend_name} {kernel} {shape} {dtype}")
    assert want[-1].dtype == torch.float32  # fp32 stays the default


def test_a_total_rounds_to_the_nearest_bf16_ties_to_even():
    """Column totals on bf16's ties either way and just past them, through the reference rounding."""
    base = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, 3.4e38, -0.0])
    x = torch.zeros(2, base.numel())
    x[0] = base
    for name, module in BACKENDS.items():
        got = _cast(module, "quantize_current_column_sums", x.to(DEVICE), True, False, sums_dtype=BF16)[-1]
        want = torch.tensor([1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7, float("inf"), 0.0], dtype=BF16)
        assert_bitwise(got.cpu(), want, name)


@pytest.mark.skipif("cuda" not in BACKENDS, reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_cuda_launch_paths_and_prepared_casts(one_launch, kernel):
    """One cooperative launch and the separate launches (the sums added by their own
    kernel); the prepared casts and the delayed cast with its state update."""
    x = adversarial(1000, 1032, dtype=BF16).cuda()
    previous = ck.set_one_launch_casts(one_launch)
    try:
        want = _cast(ck, kernel, x, True, False)
        _same(_cast(ck, kernel, x, True, False, sums_dtype=BF16), want, f"{kernel} one_launch={one_launch}")
        if kernel == "quantize_current_column_sums":
            prepared = ck.quantize_current_column_sums.prepare(E5M2)
            a, b = prepared(x, True, True), prepared(x, True, True, False, BF16)
        else:
            prepared = ck.quantize_tensorwise_column_sums.prepare(E5M2)
            scale = torch.tensor(0.75, device="cuda")
            a, b = prepared(x, scale, True, True), prepared(x, scale, True, True, False, BF16)
            a, b = (a[0], a[1], a[3], a[2]), (b[0], b[1], b[3], b[2])  # the sums last
            history = torch.zeros(4, device="cuda")
            count = torch.zeros(1, dtype=torch.int64, device="cuda")
            u32 = prepared.with_update(x, scale, history, count, 0, True, True, True)
            u16 = prepared.with_update(x, scale, history, count, 0, True, True, True, False, BF16)
            order = (0, 1, 3, 4, 5, 6, 7, 2)  # the sums last
            _same(tuple(u16[i] for i in order), tuple(u32[i] for i in order), f"{kernel} with_update")
        _same(b, a, f"{kernel} prepared one_launch={one_launch}")
    finally:
        ck.set_one_launch_casts(previous)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_bad_sums_dtype_is_named(backend_name, kernel):
    x = adversarial(16, 32, dtype=BF16).to(DEVICE)
    for bad in (torch.float16, torch.float64, "bf16"):
        with pytest.raises(ValueError, match=f"{kernel}: sums_dtype must be torch.float32 or torch.bfloat16"):
            _cast(BACKENDS[backend_name], kernel, x, True, False, sums_dtype=bad)


@pytest.mark.skipif("cuda" not in BACKENDS, reason="the CUDA kernels need a GPU")
def test_a_cast_without_sums_does_not_take_sums_dtype():
    x = adversarial(16, 32, dtype=BF16).cuda()
    prepared = ck.quantize_current.prepare(E4M3)
    with pytest.raises(ValueError, match="round_bf16 and sums_dtype are arguments of the column-sums casts only"):
        prepared(x, True, True, False, BF16)


def _grad_quantizer(recipe_name: str):
    model = te.ops.Sequential(te.ops.Linear(64, 64)).to(DEVICE, BF16)
    x = representable(64, 64).to(DEVICE, BF16).requires_grad_(True)
    with te.autocast(recipe=RECIPES[recipe_name]):
        y = model(x)
    y.backward(torch.ones_like(y))
    return model[0].basic_ops[0]._quantizers["grad_output"]


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block", "mxfp8", "custom_identity"])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_every_quantizer_returns_the_sums_it_is_asked_for(recipe_name, backend_name):
    """``quantize_with_column_sums(..., sums_dtype=bf16)``: the copies and the scaling
    state after them those of the fp32 call, the sums its sums rounded to bf16."""
    x = adversarial(64, 96, dtype=BF16).to(DEVICE)
    with te.autocast(enabled=False, backend=backend_name):
        quantizer = _grad_quantizer(recipe_name)
        q32, q16 = copy.deepcopy(quantizer), copy.deepcopy(quantizer)
        a, sums32 = q32.quantize_with_column_sums(x, rowwise=True, columnwise=True)
        b, sums16 = q16.quantize_with_column_sums(x, rowwise=True, columnwise=True, sums_dtype=BF16)
    assert sums32.dtype == torch.float32 and sums16.dtype == BF16, recipe_name
    finite = torch.isfinite(sums32)
    assert_bitwise(sums16[finite], sums32[finite].to(BF16), f"{recipe_name} sums")
    if isinstance(a, torch.Tensor):  # high precision: the tensor itself
        assert_bitwise(a, b, recipe_name)
        return
    for which in ("rowwise", "columnwise"):
        assert_bitwise(getattr(a, which).data, getattr(b, which).data, f"{recipe_name} {which}")
    for key, value in q32.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert_bitwise(q16.state_dict()[key], value, f"{recipe_name} state {key}")


def test_a_bad_sums_dtype_is_named_before_any_state_changes():
    with te.autocast(enabled=False, backend="reference"):
        quantizer = _grad_quantizer("delayed")
    before = copy.deepcopy(quantizer.state_dict())
    with pytest.raises(ValueError, match="quantize_with_column_sums: sums_dtype must be torch.float32 or"):
        quantizer.quantize_with_column_sums(adversarial(8, 16, dtype=BF16).to(DEVICE), rowwise=True,
                                            columnwise=True, sums_dtype=torch.float16)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise(quantizer.state_dict()[key], value, key)
        else:
            assert quantizer.state_dict()[key] == value, key


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "block", "bf16"])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_a_bf16_linear_with_a_bias_fused_against_unfused(recipe_name, backend_name):
    """Two steps of a bf16 Linear with a bias (the weight changed between them):
    output, dx and dw bit for bit the unfused ops'; the bias gradient bf16, the
    fp32 sum of dy rounded once, within the column sums' order of the unfused sum."""
    gen = torch.Generator().manual_seed(11)
    fused = te.ops.Sequential(te.ops.Linear(96, 80)).to(DEVICE, BF16)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-3))
    unfused = copy.deepcopy(fused)
    recipe = None if recipe_name == "bf16" else RECIPES[recipe_name]
    for step in range(2):
        x0 = representable(130, 96, generator=gen, dtype=BF16, scale_exp=-2).to(DEVICE)
        dy = representable(130, 80, generator=gen, dtype=BF16, scale_exp=-4).to(DEVICE)
        grads = []
        for model, rules in ((fused, ()), (unfused, ("backward_linear_bias",))):
            x = x0.clone().requires_grad_(True)
            with te.ops.without_fusion_rules(*rules), te.autocast(enabled=recipe is not None, recipe=recipe,
                                                                  backend=backend_name):
                out = model(x)
            out.backward(dy)
            grads.append((out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}))
            if recipe is not None:
                used = model.fusion_plan().rules()
                assert ("backward_linear_bias" in used) == (model is fused), (recipe_name, used)
        (out_f, dx_f, g_f), (out_u, dx_u, g_u) = grads
        context = f"{recipe_name} {backend_name} step {step}"
        assert_bitwise(out_f, out_u, f"{context} output")
        assert_bitwise(dx_f, dx_u, f"{context} dx")
        for name, grad in g_u.items():
            if not name.endswith("bias"):
                assert_bitwise(g_f[name], grad, f"{context} {name}")
                continue
            assert g_f[name].dtype == BF16, context
            assert_close(g_f[name], grad, BF16, f"{context} bias", scaled=True)
            exact = dy.double().sum(dim=0)
            assert_close(g_f[name].double(), exact.to(BF16).double(), BF16, f"{context} bias vs float64", scaled=True)
        with torch.no_grad():
            for model in (fused, unfused):
                model[0].weight.mul_(0.5)
                for p in model.parameters():
                    p.grad = None
