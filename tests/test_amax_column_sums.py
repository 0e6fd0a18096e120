"""``amax_column_sums``: the amax of current scaling and a bias gradient from one read;
``quantize_current_column_sums``, the cast that takes them.

The kernel against the reference (the amax bit for bit, the sums against float64
within the fp32 tolerance), a current-scaling cast that takes the amax given
(bit for bit the cast that computes it), every quantizer's
``quantize_with_column_sums``, and the ``backward_linear_bias`` rule running it
under the Triton backend (interpreted without a GPU). Without a GPU these run
through Triton's interpreter; with one, the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser import backend
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from test_triton_cast import DEVICE, adversarial, with_specials
from tolerances import assert_bitwise, assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _check(x: torch.Tensor, context: str) -> tuple[torch.Tensor, torch.Tensor]:
    amax, sums = tk.amax_column_sums(x)
    amax_ref, sums_ref = ref.amax_column_sums_reference(x)
    assert amax.shape == () and amax.dtype == torch.float32, context
    assert sums.shape == (x.shape[1],) and sums.dtype == torch.float32, context
    if torch.isnan(amax_ref):
        assert torch.isnan(amax), f"{context}: amax {amax.item()} for a NaN input"
    else:
        assert_bitwise(amax, amax_ref, f"{context} amax")
    exact = x.double().sum(dim=0)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(sums)), f"{context}: sums not finite where float64's are"
    assert_close(sums[finite], exact[finite], "column_sums_fp32", f"{context} sums shape={tuple(x.shape)}", scaled=True)
    return amax, sums


@pytest.mark.parametrize("shape", [(67, 1408), (13, 200), (256, 96), (1, 33), (130, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_the_reference(shape, dtype):
    _check(adversarial(*shape, dtype=dtype), f"{dtype} {shape}")


def test_zeros_specials_strides_and_empty():
    _check(torch.zeros(40, 70, dtype=torch.bfloat16, device=DEVICE), "all zero")
    x = adversarial(48, 64)
    for specials in ([float("nan")], [float("inf")], [float("-inf"), float("inf")]):
        _check(with_specials(x, specials), f"specials {specials}")
    _check(adversarial(64, 48).t(), "a transposed view, read in place")
    amax, sums = tk.amax_column_sums(torch.zeros(0, 5, device=DEVICE))
    assert amax.item() == 0.0 and torch.equal(sums, torch.zeros(5, device=DEVICE))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="amax_column_sums: x must be 2-D"):
        tk.amax_column_sums(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="amax_column_sums: x must be a 2-D tensor"):
        ref.amax_column_sums_reference(torch.zeros(4, device=DEVICE))
    x = adversarial(16, 32)
    for fn in (tk.quantize_current, ref.quantize_current_reference):
        with pytest.raises(ValueError, match="quantize_current: amax must be None or a one-element float32"):
            fn(x, E4M3, amax=torch.zeros(2, device=DEVICE))
        with pytest.raises(ValueError, match="quantize_current: amax must be None or a one-element float32"):
            fn(x, E4M3, amax=torch.zeros((), dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("columnwise", [False, True])
def test_current_cast_with_the_given_amax_is_the_cast(fp8_dtype, columnwise):
    x = with_specials(adversarial(67, 96, fp8_dtype), [float("inf")] if fp8_dtype is E5M2 else [])
    amax, _ = tk.amax_column_sums(x)
    for name, cast in (("triton", tk.quantize_current), ("reference", ref.quantize_current_reference)):
        given = cast(x, fp8_dtype, True, 0.0, True, columnwise, amax)
        computed = cast(x, fp8_dtype, True, 0.0, True, columnwise)
        for i, (g, c) in enumerate(zip(given, computed)):
            if c is not None:
                assert_bitwise(g, c, f"{name} output {i}")


def _grad_quantizer(recipe_name: str):
    model = te.ops.Sequential(te.ops.Linear(64, 64)).to(DEVICE, torch.bfloat16)
    run(model, representable(64, 64).to(DEVICE, torch.bfloat16), recipe=RECIPES[recipe_name])
    return model[0].basic_ops[0]._quantizers["grad_output"]


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block", "mxfp8", "custom_identity"])
def test_every_quantizer_returns_its_cast_and_the_column_sums(recipe_name):
    x = adversarial(64, 96)
    with te.autocast(enabled=False, backend="reference"):
        quantizer = _grad_quantizer(recipe_name)
        q_with, sums = copy.deepcopy(quantizer).quantize_with_column_sums(x, rowwise=True, columnwise=True)
        q_plain = copy.deepcopy(quantizer).cast(x, rowwise=True, columnwise=True)
    assert torch.equal(sums, x.sum(dim=0, dtype=torch.float32)), recipe_name  # the reference sums as torch does
    if isinstance(q_plain, torch.Tensor):
        assert q_with is x and q_plain is x
        return
    for which in ("rowwise", "columnwise"):
        a, b = getattr(q_with, which), getattr(q_plain, which)
        assert_bitwise(a.data, b.data, f"{recipe_name} {which} data")
        assert_bitwise(a.scale_inv, b.scale_inv, f"{recipe_name} {which} scale_inv")


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_the_rule_under_the_triton_backend_equals_unfused(recipe_name):
    gen = torch.Generator().manual_seed(3)
    fused = te.ops.Sequential(te.ops.Linear(64, 96)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-3))
    unfused = copy.deepcopy(fused)  # the same plan but for this one rule
    x = representable(48, 64, generator=gen, dtype=torch.bfloat16, scale_exp=-3).to(DEVICE)
    dy = (-2.3 + 0.5 * torch.randn(48, 96, generator=gen)).bfloat16().to(DEVICE)
    recipe = RECIPES[recipe_name]
    with te.autocast(enabled=False, backend="triton"):
        out_f, g_f = run(fused, x, recipe=recipe, dy=dy)
        with te.ops.without_fusion_rules("backward_linear_bias"):
            out_u, g_u = run(unfused, x, recipe=recipe, dy=dy)
    assert "backward_linear_bias" in fused.fusion_plan().rules()
    assert "backward_linear_bias" not in unfused.fusion_plan().rules()
    kernel = "amax_column_sums" if recipe_name == "current" else "quantize_tensorwise_column_sums"
    assert backend.resolve(kernel, DEVICE, backend="triton").backend == "triton"
    assert_bitwise(out_f[0], out_u[0], "output")
    for name in g_u:  # the bias sums in another order; everything else is the same computation
        if name.endswith("bias"):
            assert_close(g_f[name], g_u[name], torch.bfloat16, f"{recipe_name} grad {name}", scaled=True)
        else:
            assert_bitwise(g_f[name], g_u[name], f"{recipe_name} grad {name}")


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("shape", [(67, 96), (1, 33)])
def test_quantize_current_column_sums_is_the_cast_and_the_sums(columnwise, shape):
    """The Triton kernel and the reference: the cast bit for bit the plain
    current-scaling cast, the sums those of ``amax_column_sums``."""
    x = adversarial(*shape, dtype=torch.bfloat16)
    plain = ref.quantize_current_reference(x, E4M3, False, 0.0, True, columnwise)
    _, sums_ref = ref.amax_column_sums_reference(x)
    for name, fn in (("triton", tk.quantize_current_column_sums), ("reference", ref.quantize_current_column_sums_reference)):
        *got, sums = fn(x, E4M3, False, 0.0, True, columnwise)
        for part, g, p in zip(("data", "data_t", "scale", "scale_inv", "amax"), got, plain):
            assert (g is None) == (p is None), f"{name} {part}"
            if p is not None:
                assert_bitwise(g, p, f"{name} {part}")
        assert_close(sums, x.double().sum(dim=0), "column_sums_fp32", f"{name} sums", scaled=True)
        assert_close(sums, sums_ref.double(), "column_sums_fp32", f"{name} sums against the reference's", scaled=True)
