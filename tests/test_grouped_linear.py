"""te.ops.GroupedLinear under every recipe against a float64 reference: outputs and
every gradient on representable inputs, odd and empty splits; TransformerEngine's
scale_bias (a bias scaled per token, its scales' gradient); the dispatch between
one grouped launch and a loop of dense GEMMs (its rule on the measured cases, and
both paths bit for bit on representable data); bad inputs."""

from __future__ import annotations

import os

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable
from te_fuser.kernels.operand import ScaledOperand
from te_fuser.ops.basic import grouped_linear as gl
from te_fuser.ops.gemm import gemm
from tolerances import assert_close

G, K, N = 4, 48, 40
SPLITS = [0, 7, 3, 11]  # an empty group, odd sizes
MX_SPLITS = [0, 64, 32, 32]  # MXFP8 scales 32 rows of each group's column-wise copies


def _module(dtype, gen, bias=True, k=K, n=N, scale_bias=False):
    op = te.ops.GroupedLinear(G, k, n, bias=bias, scale_bias=scale_bias).to(dtype)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else 0))
    return op


def run(op, x, sizes, recipe=None, dy=None, scales=None):
    """Forward under ``recipe`` with the split sizes (and the bias scales) as the
    extra inputs, backward with ``dy``; returns ((y,), grads by name) as
    op_testing.run does (the scales' gradient as "scales")."""
    x = x.detach().clone().requires_grad_(True)
    extras = (sizes,)
    if scales is not None:
        scales = scales.detach().clone().requires_grad_(True)
        extras += (scales,)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = op(x, *extras)
    y.backward(dy)
    grads = {"x": x.grad, **{name: p.grad for name, p in op.named_parameters()}}
    if scales is not None:
        grads["scales"] = scales.grad
    for p in op.parameters():
        p.grad = None
    return (y.detach(),), grads


def _reference(x, params, splits, scales=None):
    """float64 loop of linears over the row groups; params named like the op's; with
    ``scales`` each row's bias times its scale."""
    outs, start = [], 0
    for g, m in enumerate(splits):
        y = x[start:start + m] @ params[f"weight{g}"].t()
        if f"bias{g}" in params:
            b = params[f"bias{g}"]
            y = y + (b if scales is None else scales[start:start + m, None] * b)
        outs.append(y)
        start += m
    return torch.cat(outs)


def _probabilities(rows, generator, dtype=torch.float32):
    """Router-like scales in [0, 1) on a grid every dtype and product keeps exact."""
    return (torch.randint(0, 8, (rows,), generator=generator) / 8.0).to(dtype)


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


SCALE_BIAS_CASES = [(r, "auto") for r in RECIPES if r not in ("delayed_mha", "current_mha")] + [
    (r, "triton") for r in ("current", "rowwise")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name, backend", SCALE_BIAS_CASES)
def test_scale_bias_matches_float64_reference(recipe_name, backend, dtype):
    """TransformerEngine's scale_bias: y_g = x_g · w_gᵀ + scales[:, None] · b_g, and
    the scales' gradient dy · b_g, against float64 on representable inputs (the bias
    in the grouped kernel's epilogue, or added after the GEMM on the other paths)."""
    if backend == "triton" and torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the Triton kernels run on CPU tensors through the interpreter here")
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(11)
    mx = recipe_name == "mxfp8"
    splits, k, n = (MX_SPLITS, 64, 96) if mx else (SPLITS, K, N)
    op = _module(dtype, gen, k=k, n=n, scale_bias=True)
    x = representable(sum(splits), k, generator=gen, dtype=dtype)
    dy = representable(sum(splits), n, generator=gen, dtype=dtype)
    scales = _probabilities(sum(splits), gen, dtype)
    with te.backend.use_backend(backend):
        (y,), grads = run(op, x, torch.tensor(splits), recipe=recipe, dy=dy, scales=scales)

    x64, s64 = x.double().requires_grad_(True), scales.double().requires_grad_(True)
    params64 = {name: p.detach().double().requires_grad_(True) for name, p in op.named_parameters()}
    ref = _reference(x64, params64, splits, s64)
    ref.backward(dy.double())
    context = f"GroupedLinear(scale_bias=True) splits={splits} recipe={recipe_name} backend={backend} dtype={dtype}"
    assert y.dtype == dtype and y.shape == ref.shape, context
    assert_close(y, ref.detach(), dtype, f"{context} output")
    assert_close(grads["x"], x64.grad, dtype, f"{context} dx")
    assert grads["scales"].dtype == dtype and grads["scales"].shape == scales.shape, context
    assert_close(grads["scales"], s64.grad, dtype, f"{context} d scales")
    for name, p in params64.items():
        assert_close(grads[name], p.grad, dtype, f"{context} d{name}")


def test_scale_bias_in_transformer_engines_grouped_mlp():
    """TransformerEngine's grouped MLP test: GroupedLinear -> ScaledSwiGLU(probs) ->
    GroupedLinear(scale_bias=True) called as ``module(x, split_sizes, probs,
    split_sizes, probs)``, in float64 against a loop of torch linears."""
    gen = torch.Generator().manual_seed(3)
    splits, hidden, groups = [5, 0, 9, 2], 16, 4
    fc1 = te.ops.GroupedLinear(groups, hidden, 2 * hidden).double()
    fc2 = te.ops.GroupedLinear(groups, hidden, hidden, scale_bias=True).double()
    with torch.no_grad():
        for p in list(fc1.parameters()) + list(fc2.parameters()):
            p.uniform_(-0.5, 0.5, generator=gen)
    module = te.ops.Sequential(fc1, te.ops.ScaledSwiGLU(), fc2)
    x = torch.empty(sum(splits), hidden, dtype=torch.float64).uniform_(-0.25, 0.25, generator=gen).requires_grad_()
    probs = torch.rand(sum(splits), generator=gen, dtype=torch.float64).requires_grad_()
    dy = torch.empty(sum(splits), hidden, dtype=torch.float64).uniform_(-0.25, 0.25, generator=gen)
    sizes = torch.tensor(splits)
    y = module(x, sizes, probs, sizes, probs)
    y.backward(dy)

    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    w1 = [p.detach().clone().requires_grad_() for p in fc1.parameters()]
    w2 = [p.detach().clone().requires_grad_() for p in fc2.parameters()]
    outs, start = [], 0
    for g, m in enumerate(splits):
        h = torch.nn.functional.linear(xr[start:start + m], w1[g], w1[groups + g])
        gate, up = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up * pr[start:start + m, None]
        outs.append(torch.nn.functional.linear(act, w2[g]) + w2[groups + g] * pr[start:start + m, None])
        start += m
    ref = torch.cat(outs)
    ref.backward(dy)
    assert_close(y, ref, torch.float32, "grouped MLP output")
    assert_close(x.grad, xr.grad, torch.float32, "dx")
    assert_close(probs.grad, pr.grad, torch.float32, "d probs (both uses)")
    for (name, p), r in zip(list(fc1.named_parameters()) + list(fc2.named_parameters()), w1 + w2):
        assert_close(p.grad, r.grad, torch.float32, f"d {name}")


def test_scale_bias_follows_transformer_engine_without_a_bias_and_takes_leading_dims():
    op = te.ops.GroupedLinear(2, 8, 16, bias=False, scale_bias=True)
    assert not op.scale_bias and op.num_extra_inputs == 1  # nothing to scale: no scales input, as in TE
    assert op(torch.randn(4, 8), torch.tensor([1, 3])).shape == (4, 16)
    op = te.ops.GroupedLinear(2, 8, 16, scale_bias=True)
    assert op.scale_bias and op.num_extra_inputs == 2 and "scale_bias=True" in repr(op)
    x = torch.randn(2, 3, 8)
    scales = torch.rand(2, 3, requires_grad=True)  # the input's leading dims
    y = op(x, torch.tensor([4, 2]), scales)
    y.sum().backward()
    assert y.shape == (2, 3, 16) and scales.grad.shape == (2, 3)
    flat = torch.rand(6)  # no gradient asked for
    op(x, torch.tensor([4, 2]), flat).sum().backward()
    with pytest.raises(TypeError, match="scale_bias"):
        te.ops.GroupedLinear(2, 8, 16, scale_bias=1)


@pytest.mark.parametrize("scales, error, match", [
    (torch.rand(20, 1), ValueError, r"shape \(21,\)"),
    (torch.rand(7), ValueError, r"shape \(21,\)"),
    (torch.ones(21, dtype=torch.int64), TypeError, "floating"),
])
def test_bad_bias_scales_name_the_op_and_leave_the_scaling_state_alone(scales, error, match):
    op = te.ops.GroupedLinear(G, K, N, scale_bias=True, name="fc2")
    x = torch.randn(sum(SPLITS), K)
    recipe = te.recipe.DelayedScaling()
    with te.autocast(recipe=recipe):
        op(x, torch.tensor(SPLITS), torch.rand(sum(SPLITS)))
    before = {t: {k: v.clone() for k, v in q.state_dict().items() if isinstance(v, torch.Tensor)}
              for t, q in op.installed_quantizers.items()}
    with pytest.raises(error, match=match) as info:
        with te.autocast(recipe=recipe):
            op(x, torch.tensor(SPLITS), scales)
    assert "GroupedLinear('fc2')" in str(info.value)
    for t, q in op.installed_quantizers.items():
        for k, v in before[t].items():
            assert torch.equal(q.state_dict()[k], v), (t, k)
    with pytest.raises(ValueError, match="extra input"):
        op(x, torch.tensor(SPLITS))  # the scales left out
    with pytest.raises(TypeError, match="as a tensor"):
        op.bias_scales([0.5] * sum(SPLITS), x)


# --------------------------------------------------------------- dispatch


def _meta_operand(rows, cols, fp8_dtype=torch.float8_e4m3fn):
    return ScaledOperand(torch.empty(rows, cols, dtype=fp8_dtype, device="meta"), torch.ones((), device="meta"),
                         "tensor")


META_RULE = gl.LoopRule(devices=("meta",), dense_backends=("reference",))  # the default's numbers, on meta tensors


@pytest.mark.parametrize("splits, k, n, fprop, wgrad", [
    ([2048] * 8, 4096, 4096, "loop", "grouped"),  # 69 GFLOP per GEMM: the fprop loop measured 1.45x faster
    ([0, 3001, 1, 4095, 2048, 7000, 0, 239], 4096, 4096, "loop", "grouped"),  # 92 GFLOP; odd counts: no cuBLASLt wgrad
    ([2048] * 8, 4096, 14336, "loop", "loop"),  # 241 GFLOP: fprop 1.60x, wgrad 1.14x
    ([128] * 8, 1024, 1024, "grouped", "grouped"),  # 0.27 GFLOP: host-bound, the one launch wins
    ([1024] * 8, 4096, 4096, "loop", "grouped"),  # 34 GFLOP: fprop 1.36x; the grouped wgrad 1.09x the loop
    ([512] * 8, 4096, 4096, "loop", "grouped"),  # 2**34 FLOPs per GEMM: the fprop threshold
    ([256] * 8, 4096, 4096, "grouped", "grouped"),  # half of it
    ([2048] * 8, 4096, 4104, "grouped", "grouped"),  # N not a multiple of 16: cuBLASLt declines
    ([0] * 8, 4096, 4096, "grouped", "grouped"),  # nothing to loop over
])
def test_loop_rule_on_the_measured_cases(splits, k, n, fprop, wgrad):
    groups = gl.Groups([0, *torch.tensor(splits).cumsum(0).tolist()], "meta")
    m, g = sum(splits), len(splits)
    x = _meta_operand(m, k)
    w = gl.Experts([_meta_operand(n, k) for _ in range(g)])
    assert gl.fprop_path(x, w, groups, META_RULE) == fprop
    assert gl.wgrad_path(_meta_operand(n, m, torch.float8_e5m2), _meta_operand(k, m), groups, META_RULE) == wgrad
    dgrad_w = gl.Experts([_meta_operand(k, n) for _ in range(g)])
    assert gl.fprop_path(_meta_operand(m, n, torch.float8_e5m2), dgrad_w, groups, META_RULE) == fprop


def test_loop_rule_declines_off_cuda_off_cublaslt_and_for_two_e5m2_operands():
    groups = gl.Groups([0, 2048, 4096], "meta")
    x, w = _meta_operand(4096, 4096), gl.Experts([_meta_operand(4096, 4096)] * 2)
    assert gl.fprop_path(x, w, groups) == "grouped"  # the default rule: CUDA only
    assert gl.fprop_path(x, w, groups, gl.LoopRule(devices=("meta",))) == "grouped"  # the dense GEMM is not cuBLASLt
    e5m2 = gl.Experts([_meta_operand(4096, 4096, torch.float8_e5m2)] * 2)
    assert gl.fprop_path(_meta_operand(4096, 4096, torch.float8_e5m2), e5m2, groups, META_RULE) == "grouped"
    assert gl.fprop_path(x, w, groups, META_RULE) == "loop"


LOOP_EVERYWHERE = gl.LoopRule(min_flop_per_gemm=0, min_flop_per_wgrad_gemm=0, devices=("cpu", "cuda"), dense_backends=gl.LoopRule().dense_backends
                              + ("reference", "triton"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "rowwise"])
@pytest.mark.parametrize("splits", [[0, 7, 3, 22], [16, 0, 32, 16]], ids=["odd", "multiples_of_16"])
@pytest.mark.parametrize("scale_bias", [False, True], ids=["bias", "scale_bias"])
def test_loop_and_grouped_paths_agree_bit_for_bit(recipe_name, dtype, splits, scale_bias, monkeypatch):
    """The same FP8 operands through one grouped launch and through a loop of dense
    GEMMs: on representable data both sum exactly, so outputs and every gradient are
    equal bit for bit (the odd splits keep the wgrad grouped: cuBLASLt wants token
    counts that are multiples of 16). A scaled bias rounds once more in the loop, so
    there only in fp32."""
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(7)
    k, n = 48, 32
    op = _module(dtype, gen, k=k, n=n, scale_bias=scale_bias)
    x = representable(sum(splits), k, generator=gen, dtype=dtype)
    dy = representable(sum(splits), n, generator=gen, dtype=dtype)
    scales = _probabilities(sum(splits), gen, dtype) if scale_bias else None
    sizes = torch.tensor(splits)
    grouped = run(op, x, sizes, recipe=recipe, dy=dy, scales=scales)
    dense_calls = []
    monkeypatch.setattr(gl, "LOOP_RULE", LOOP_EVERYWHERE)
    monkeypatch.setattr(gl, "gemm", lambda *a, **kw: dense_calls.append(1) or gemm(*a, **kw))
    looped = run(op, x, sizes, recipe=recipe, dy=dy, scales=scales)
    nonempty = sum(1 for m in splits if m)
    wgrad_loops = all(m % 16 == 0 for m in splits)
    assert len(dense_calls) == nonempty * (3 if wgrad_loops else 2), dense_calls
    context = f"splits={splits} recipe={recipe_name} dtype={dtype} scale_bias={scale_bias}"
    exact = not (scale_bias and dtype is torch.bfloat16)
    for (a, b, what) in [(grouped[0][0], looped[0][0], "y")] + [(grouped[1][k], looped[1][k], k) for k in grouped[1]]:
        if exact:
            assert torch.equal(a, b), f"{context}: {what} differs"
        else:
            assert_close(b, a, dtype, f"{context}: {what}")


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scale_bias", [False, True], ids=["bias", "scale_bias"])
def test_dispatch_on_the_gpu_loop_and_grouped_agree(scale_bias, monkeypatch):
    """MoE sizes on CUDA: the rule loops over cuBLASLt GEMMs (fprop and dgrad by default;
    the wgrad too, token counts multiples of 16, with its threshold at 0); forced to the grouped kernels the
    results agree to the FP8 tensor cores' accumulation and the bf16 roundings,
    relative to each tensor's largest element."""
    splits, k, n = [1024, 0, 2048, 1024], 4096, 4096
    gen = torch.Generator().manual_seed(1)
    op = te.ops.GroupedLinear(G, k, n, scale_bias=scale_bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (k**-0.5 if p.dim() == 2 else 0.1))
    x = torch.randn(sum(splits), k, generator=gen).bfloat16().cuda()
    dy = torch.randn(sum(splits), n, generator=gen).bfloat16().cuda()
    scales = torch.rand(sum(splits), generator=gen).cuda() if scale_bias else None
    sizes = torch.tensor(splits)
    recipe = te.recipe.Float8CurrentScaling()
    dense_calls = []
    monkeypatch.setattr(gl, "gemm", lambda *a, **kw: dense_calls.append(1) or gemm(*a, **kw))
    run(op, x, sizes, recipe=recipe, dy=dy, scales=scales)
    assert len(dense_calls) == 6, "the default rule should loop over the 3 non-empty experts' fprop and dgrad"
    dense_calls.clear()
    monkeypatch.setattr(gl, "LOOP_RULE", gl.LoopRule(min_flop_per_wgrad_gemm=0))
    looped = run(op, x, sizes, recipe=recipe, dy=dy, scales=scales)
    assert len(dense_calls) == 9, "this rule should loop over the 3 non-empty experts' 3 GEMMs"
    monkeypatch.setattr(gl, "LOOP_RULE", gl.LoopRule(min_flop_per_gemm=float("inf"),
                                                     min_flop_per_wgrad_gemm=float("inf")))
    grouped = run(op, x, sizes, recipe=recipe, dy=dy, scales=scales)
    assert len(dense_calls) == 9
    for (a, b, what) in [(looped[0][0], grouped[0][0], "y")] + [(looped[1][key], grouped[1][key], key)
                                                                for key in grouped[1]]:
        assert_close(a, b, torch.bfloat16 if a.dtype is torch.bfloat16 else "fp8_gemm_tensor_core",
                     f"GroupedLinear loop vs grouped {what} scale_bias={scale_bias}", scaled=True)
