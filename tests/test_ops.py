"""Every op under every recipe (and none) against a float64 reference: outputs and
every gradient, on representable inputs, odd shapes where the scheme allows."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser.kernels.reference import activation_reference
from tolerances import assert_close

OPS = {
    # name: (constructor(in_features) -> module, extra inputs[, their shape from x's (default x's)])
    "BasicLinear": (lambda k: te.ops.BasicLinear(k, 96 if k % 32 == 0 else 40), 0),
    "Linear": (lambda k: te.ops.Linear(k, 96 if k % 32 == 0 else 40), 0),
    "Bias": (lambda k: te.ops.Bias(k), 0),
    "GELU": (lambda k: te.ops.GELU(), 0),
    "ReLU": (lambda k: te.ops.ReLU(), 0),
    "SiLU": (lambda k: te.ops.SiLU(), 0),
    "SwiGLU": (lambda k: te.ops.SwiGLU(), 0),
    "SwiGLU-interleaved": (lambda k: te.ops.SwiGLU(glu_interleave_size=8), 0),
    "GEGLU-interleaved": (lambda k: te.ops.GEGLU(glu_interleave_size=4), 0),
    "QGELU": (lambda k: te.ops.QGELU(), 0),
    "SReLU": (lambda k: te.ops.SReLU(), 0),
    "GLU": (lambda k: te.ops.GLU(), 0),
    "GEGLU": (lambda k: te.ops.GEGLU(), 0),
    "QGEGLU": (lambda k: te.ops.QGEGLU(), 0),
    "ReGLU": (lambda k: te.ops.ReGLU(), 0),
    "SReGLU": (lambda k: te.ops.SReGLU(), 0),
    # limit 0.75 and a small beta2: the clamps and the soft cap act on these inputs
    "ClampedSwiGLU": (lambda k: te.ops.ClampedSwiGLU(limit=0.75, glu_linear_offset=0.5), 0),
    "ClampedSwiGLU-interleaved": (lambda k: te.ops.ClampedSwiGLU(limit=0.75, glu_interleave_size=4), 0),
    "SiTUGLU": (lambda k: te.ops.SiTUGLU(beta1=3.0, beta2=0.75), 0),
    # the post-scaled kinds: one extra input, the per-row scales (x's shape less its last dim)
    "ScaledSwiGLU": (lambda k: te.ops.ScaledSwiGLU(), 1, lambda shape: shape[:-1]),
    "ScaledSiTUGLU": (lambda k: te.ops.ScaledSiTUGLU(glu_interleave_size=8, beta2=0.75), 1, lambda shape: shape[:-1]),
    "ScaledClampedQGeGLU": (lambda k: te.ops.ScaledClampedQGeGLU(limit=0.75, glu_linear_offset=0.0), 1,
                            lambda shape: shape[:-1]),
    "ScaledSReLU": (lambda k: te.ops.ScaledSReLU(), 1, lambda shape: shape[:-1]),
    "LayerNorm": (lambda k: te.ops.LayerNorm(k), 0),
    "RMSNorm": (lambda k: te.ops.RMSNorm(k), 0),
    "L2Normalization": (lambda k: te.ops.L2Normalization(eps=1e-3), 0),
    "Quantize": (lambda k: te.ops.Quantize(forward=True, backward=True), 0),
    "Identity": (lambda k: te.ops.Identity(), 0),
    "Reshape": (lambda k: te.ops.Reshape((-1, k)), 0),
    "Dropout": (lambda k: te.ops.Dropout(0.25).eval(), 0),
    "ConstantScale": (lambda k: te.ops.ConstantScale(0.5), 0),
    "AddExtraInput": (lambda k: te.ops.AddExtraInput(), 1),
    "MakeExtraOutput": (lambda k: te.ops.MakeExtraOutput(), 0),
}


def _reference(name, module, x, params, extras):
    """The op in float64; ``params`` are float64 leaves named like the module's."""
    if name in ("BasicLinear", "Linear"):
        y = x @ params["linear.weight" if name == "Linear" else "weight"].t()
        return (y + params["bias_op.bias"],) if name == "Linear" else (y,)
    if name == "Bias":
        return (x + params["bias"],)
    if name in ("GELU", "ReLU", "SiLU", "SwiGLU", "QGELU", "SReLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU"):
        return (activation_reference(x, name.lower()),)
    if name in ("ClampedSwiGLU", "SiTUGLU"):
        return (activation_reference(x, module.kind, params=module.params),)
    if name.startswith("Scaled"):
        size, n = module.glu_interleave_size, x.shape[-1]
        if size is not None:
            x = x.reshape(*x.shape[:-1], n // (2 * size), 2, size).transpose(-3, -2).reshape(x.shape)
        return (extras[0].unsqueeze(-1) * activation_reference(x, module.kind, params=module.params),)
    if name.endswith("-interleaved"):  # blocks [g0, u0, g1, u1, ...] -> halves [g | u]
        size, n = module.glu_interleave_size, x.shape[-1]
        halves = x.reshape(*x.shape[:-1], n // (2 * size), 2, size).transpose(-3, -2).reshape(x.shape)
        return (activation_reference(halves, module.kind, params=getattr(module, "params", ())),)
    if name == "LayerNorm":
        return (torch.nn.functional.layer_norm(x, (x.shape[-1],), params["weight"], params["bias"], module.eps),)
    if name == "RMSNorm":
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * params["weight"],)
    if name == "L2Normalization":
        return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + module.eps),)
    if name == "Reshape":
        return (x.reshape(module.shape),)
    if name == "ConstantScale":
        return (x * module.scale,)
    if name == "AddExtraInput":
        return (x + extras[0],)
    if name == "MakeExtraOutput":
        return (x, x)
    return (x,)  # Quantize on representable values, Identity, Dropout in eval


def _make_representable_params(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("op_name", list(OPS))
def test_op_matches_float64_reference(op_name, recipe_name, dtype):
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(hash((op_name, recipe_name)) % 2**31)
    # MXFP8 needs every quantized dim to be a multiple of 32; others get odd shapes.
    shape = (2, 16, 64) if recipe_name == "mxfp8" else (3, 7, 48)
    ctor, n_extra, *extra_shape = OPS[op_name]
    module = ctor(shape[-1]).to(dtype)
    _make_representable_params(module, gen)
    x = representable(*shape, generator=gen, dtype=dtype)
    eshape = extra_shape[0](shape) if extra_shape else shape
    extras = [representable(*eshape, generator=gen, dtype=dtype) for _ in range(n_extra)]
    with torch.no_grad():
        probe = module(x, *extras)
    probe = probe if isinstance(probe, tuple) else (probe,)
    dy = representable(*probe[0].shape, generator=gen, dtype=dtype)
    dextras = [representable(*p.shape, generator=gen, dtype=dtype) for p in probe[1:]]
    outs, grads = run(module, x, *extras, recipe=recipe, dy=dy, dextras=dextras)

    x64 = x.double().requires_grad_(True)
    extras64 = [e.double().requires_grad_(True) for e in extras]
    params64 = {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}
    ref = _reference(op_name, module, x64, params64, extras64)
    torch.autograd.backward(list(ref), [dy.double(), *[d.double() for d in dextras]])
    context = f"{op_name} recipe={recipe_name} dtype={dtype}"
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.dtype == dtype, f"{context}: output {i} dtype {o.dtype}"
        assert_close(o, r.detach(), dtype, f"{context} output {i}")
    assert_close(grads["x"], x64.grad, dtype, f"{context} dx")
    for i, e in enumerate(extras64):
        if op_name.startswith("Scaled"):  # d scales: row sums of dy * act(x), in fp32 in another order
            assert_close(grads[f"extra{i}"], e.grad, "column_sums_fp32" if dtype is torch.float32 else dtype,
                         f"{context} d scales", scaled=True)
        else:
            assert_close(grads[f"extra{i}"], e.grad, dtype, f"{context} d extra {i}")
    for name, p in params64.items():
        assert grads[name] is not None, f"{context}: no gradient for {name}"
        assert_close(grads[name], p.grad, dtype, f"{context} d{name}")


def test_dropout_in_training_zeroes_and_rescales_consistently():
    torch.manual_seed(0)
    op = te.ops.Dropout(0.5)
    x = torch.randn(64, 32).abs() + 1.0
    outs, grads = run(op, x, dy=torch.ones(64, 32))
    y = outs[0]
    kept = y != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(y[kept], x[kept] * 2.0)
    torch.testing.assert_close(grads["x"], kept.float() * 2.0)


def test_mxfp8_rejects_dims_that_are_not_multiples_of_32():
    op = te.ops.BasicLinear(48, 64)
    x = torch.randn(32, 48)
    with pytest.raises(ValueError, match="32"):
        with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
            op(x)


def test_bad_constructor_arguments_name_the_field():
    for ctor, field in (
        (lambda: te.ops.BasicLinear(0, 4), "in_features"),
        (lambda: te.ops.Bias(-1), "size"),
        (lambda: te.ops.Dropout(1.5), "p"),
        (lambda: te.ops.Reshape((2, 0)), "shape"),
        (lambda: te.ops.ConstantScale(float("inf")), "scale"),
        (lambda: te.ops.LayerNorm(8, eps=0), "eps"),
    ):
        with pytest.raises(ValueError, match=field):
            ctor()


def test_parameters_live_on_the_given_device_and_dtype_and_init_like_torch():
    lin = te.ops.Linear(64, 32, dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.bfloat16
    bound = 1 / 64**0.5
    assert lin.weight.abs().max() <= bound + 1e-3 and lin.bias.abs().max() <= bound + 1e-3
    assert torch.equal(te.ops.RMSNorm(8).weight, torch.ones(8))


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "block", "delayed"])
def test_backward_override_runs_the_backward_gemms_in_high_precision(recipe_name):
    """'high_precision': dgrad/wgrad use the saved high-precision x and w with the
    unquantized dy; 'dequantized': they use the forward's FP8 x and w, dequantized."""
    from te_fuser.quantization import QuantizerRole, quantizer_for

    base = RECIPES[recipe_name]
    torch.manual_seed(0)
    lin = te.ops.BasicLinear(64, 32)
    x = torch.randn(32, 64) * 3
    dy = torch.randn(32, 32)
    for override in ("high_precision", "dequantized"):
        recipe = base.replace(backward_override=override)
        _, grads = run(lin, x, recipe=recipe, dy=dy)
        w, xx = lin.weight.detach(), x
        if override == "dequantized":
            w_role, x_role = QuantizerRole("linear", "weight"), QuantizerRole("linear", "input")
            w = quantizer_for(recipe, w_role)(w).dequantize()
            xx = quantizer_for(recipe, x_role)(x).dequantize()
        assert torch.equal(grads["x"], torch.nn.functional.linear(dy, w.t())), (recipe_name, override)
        assert torch.equal(grads["weight"], torch.nn.functional.linear(dy.t(), xx.t())), (recipe_name, override)
        lin.weight.grad = None


@pytest.mark.parametrize("flags", [(True, False, False), (False, True, True)])
def test_each_linear_gemm_gets_its_recipes_accumulation_mode(monkeypatch, flags):
    """fprop / dgrad / wgrad each pass their recipe field to the FP8 GEMM kernel."""
    import te_fuser.ops.basic.linear as linear_module

    calls = []
    real_gemm = linear_module.gemm

    def recording_gemm(a, b, out_dtype, **kwargs):
        calls.append(kwargs["fast_accum"])
        return real_gemm(a, b, out_dtype, **kwargs)

    monkeypatch.setattr(linear_module, "gemm", recording_gemm)
    recipe = te.recipe.Float8CurrentScaling(
        fprop_fast_accum=flags[0], dgrad_fast_accum=flags[1], wgrad_fast_accum=flags[2])
    x = torch.randn(16, 32, requires_grad=True)
    run(te.ops.BasicLinear(32, 48), x, recipe=recipe, dy=torch.randn(16, 48))
    assert calls == list(flags)  # fprop, then dgrad, then wgrad
