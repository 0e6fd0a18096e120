"""Extra-tensor channels: a pre-norm transformer layer as one Sequential.

``MakeExtraOutput(channel="res") ... AddExtraInput(channel="res")`` keeps the
residual inside the fuser (ops/basic/extra.py). The layer is checked against the
same computation in plain float64 torch (forward, the input's and every
parameter's gradient) under every recipe of op_testing.RECIPES, fused against
unfused, with the rules that fire across the channels listed in its plan; then
the routing's own cases (a returned channel, two readers, a name written again
after a read, public inputs beside channels), the errors of unresolved channels
(raised at plan build, nothing changed), a recipe switch against a fresh model,
and two layers trained as one Sequential."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from te_fuser import recipe as R
from te_fuser.ops import FusionRule, RuleTable
from tolerances import assert_close

D, HEADS, HEAD_DIM, FFN = 64, 2, 32, 128  # multiples of 32: MXFP8 and block scaling take them
B, T = 2, 16  # 32 tokens


def layer_ops(res: str = "res", res2: str = "res2") -> list:
    """A pre-norm transformer layer: attention and MLP sub-layers, each with its residual on a channel."""
    return [
        te.ops.MakeExtraOutput(channel=res), te.ops.RMSNorm(D), te.ops.Linear(D, 3 * D),
        te.ops.RotaryEmbedding(HEADS, HEAD_DIM), te.ops.DotProductAttention(HEADS, HEAD_DIM), te.ops.Linear(D, D),
        te.ops.AddExtraInput(channel=res),
        te.ops.MakeExtraOutput(channel=res2), te.ops.RMSNorm(D), te.ops.Linear(D, FFN), te.ops.GELU(),
        te.ops.Linear(FFN, D), te.ops.AddExtraInput(channel=res2),
    ]


def make_layer(gen: torch.Generator, **kw) -> te.ops.Sequential:
    model = te.ops.Sequential(*layer_ops(), **kw)
    with torch.no_grad():
        for p in model.parameters():
            # weights of |w| <= 7/32: the attention logits stay moderate, so the softmax is
            # not one-hot and FP8's roundings stay within its format's tolerance of float64
            p.copy_(representable(*p.shape, generator=gen, scale_exp=-2 if p.dim() == 1 else -5))
    return model


# -- the same layer in plain float64 torch ------------------------------------------

def _rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(t):  # (B, T, heads, D): the rotate-half form, positions 0..T-1
    half = HEAD_DIM // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
    ang = torch.arange(t.shape[1], dtype=torch.float64)[:, None] * inv  # (T, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-t[..., half:], t[..., :half]], -1)
    return t * cos + rot * sin


def _gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def torch_layer(x, m):
    """``m``'s parameters (float64 leaves) on ``x``: the pre-norm layer written out."""
    qkv = _rms_norm(x, m[1].weight) @ m[2].weight.T + m[2].bias
    q, k, v = qkv.reshape(B, T, 3 * HEADS, HEAD_DIM).split(HEADS, dim=2)
    q, k = _rope(q), _rope(k)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(HEAD_DIM)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v).reshape(B, T, D)
    h = x + o @ m[5].weight.T + m[5].bias
    f = _gelu(_rms_norm(h, m[8].weight) @ m[9].weight.T + m[9].bias)
    return h + f @ m[11].weight.T + m[11].bias


def torch_reference(model, x, dy):
    """Output and gradients (named as op_testing.run names them) of the float64 layer."""
    ref = copy.deepcopy(model).double()
    xr = x.detach().double().requires_grad_(True)
    y = torch_layer(xr, ref)
    y.backward(dy.double())
    return y.detach(), {"x": xr.grad, **{n: p.grad for n, p in ref.named_parameters()}}


def _inputs(gen):
    return (representable(B, T, D, generator=gen, scale_exp=-1),
            representable(B, T, D, generator=gen, scale_exp=-3))


# -- the layer under every recipe --------------------------------------------------------

# The rules that fire across the channels: the residual add in the projections'
# epilogues, the residual's gradient in the norm's backward, and under fp8_mha
# the attention hand-off that ends in the residual add.
ACROSS = {"forward_linear_bias_add", "backward_add_rmsnorm"}
ACROSS_MHA = {"forward_dpa_linear_bias_add", "backward_add_rmsnorm"}


def _tolerance_keys(recipe):
    """(forward, backward) keys of the tolerance table: an FP8 format's where the
    recipe casts, else high precision's (attention's fp32 bound: sums of a row in
    another order than float64's)."""
    if recipe is None or not hasattr(recipe, "fp8_format"):  # none, or the identity CustomRecipe
        return "attention_fp32", "attention_fp32"
    return recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_layer_is_one_sequential_against_float64_torch(recipe_name):
    recipe = RECIPES[recipe_name]
    gen = torch.Generator().manual_seed(3)
    fused = make_layer(gen)
    unfused = te.ops.Sequential(*copy.deepcopy(list(fused)), fuse=False)
    x, dy = _inputs(gen)
    assert fused._fast_fuser is not None  # one group, no public extra tensors: the guard's hot path
    out_f, g_f = run(fused, x, recipe=recipe, dy=dy)
    out_u, g_u = run(unfused, x, recipe=recipe, dy=dy)
    y_ref, g_ref = torch_reference(fused, x, dy)
    context = f"recipe={recipe_name}"

    plan = fused.fusion_plan()
    expected = ACROSS_MHA if recipe is not None and recipe.fp8_mha else ACROSS
    assert expected <= plan.rules(), plan
    assert "AddExtraInput[<-'res']" in plan and "MakeExtraOutput[->'res2']" in plan
    assert not unfused.fusion_plan().rules()
    assert len(out_f) == 1 and out_f[0].shape == (B, T, D)

    # fused against unfused: the tolerance table's (an FP8 format's where a value is re-quantized)
    out_key, grad_key = _tolerance_keys(recipe)
    assert_close(out_f[0], out_u[0], out_key, f"{context} fused vs unfused output", scaled=True)
    assert g_f.keys() == g_u.keys() == g_ref.keys()
    for name in g_u:
        assert_close(g_f[name], g_u[name], grad_key, f"{context} fused vs unfused grad {name}", scaled=True)
    # against float64 torch: each FP8 cast of the chain rounds by up to its format's step
    assert_close(out_f[0].double(), y_ref, out_key, f"{context} vs float64 torch: output", scaled=True)
    for name in g_ref:
        assert_close(g_f[name].double(), g_ref[name], grad_key, f"{context} vs float64 torch: grad {name}",
                     scaled=True)


def test_channels_route_as_the_public_extra_tensors_do():
    """The layer with channels is the layer with public residuals (``seq(x, x)``, as
    te_fuser.models.gpt calls its sub-layers), result for result and bit for bit."""
    gen = torch.Generator().manual_seed(5)
    model = make_layer(gen)
    ops = [copy.deepcopy(m) for m in model]
    ops[0], ops[6], ops[7], ops[12] = (te.ops.Identity(), te.ops.AddExtraInput(), te.ops.Identity(),
                                       te.ops.AddExtraInput())
    attn, mlp = te.ops.Sequential(*ops[:7]), te.ops.Sequential(*ops[7:])
    x, dy = _inputs(gen)
    for recipe in (None, RECIPES["delayed"], RECIPES["mxfp8"]):
        out, grads = run(model, x, recipe=recipe, dy=dy)
        xr = x.clone().requires_grad_(True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            h = attn(xr, xr)
            y = mlp(h, h)
        y.backward(dy)
        assert torch.equal(out[0], y.detach())
        assert torch.equal(grads["x"], xr.grad)
        for (name, p), q in zip(model.named_parameters(), [*attn.parameters(), *mlp.parameters()]):
            assert torch.equal(p.grad, q.grad), name
            p.grad = q.grad = None


# -- routing cases -------------------------------------------------------------------------

def _linear(n_in, n_out, gen):
    lin = te.ops.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.copy_(representable(n_out, n_in, generator=gen, scale_exp=-3))
        lin.bias.copy_(representable(n_out, generator=gen, scale_exp=-2))
    return lin


def _grads(model, x, *extras, dys):
    x = x.clone().requires_grad_(True)
    extras = [e.clone().requires_grad_(True) for e in extras]
    out = model(x, *extras)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(out), list(dys))
    return [o.detach() for o in out], [x.grad, *[e.grad for e in extras], *[p.grad for p in model.parameters()]]


def test_a_returned_channel_fan_out_rewrite_and_public_inputs():
    """One Sequential with: a channel also returned to the caller (its gradient from
    the caller summed with its reader's), a channel read twice, the name "a" written
    again after its read, and a public extra input beside them; against torch."""
    gen = torch.Generator().manual_seed(11)
    l1, l2, l3 = _linear(D, D, gen), _linear(D, D, gen), _linear(D, D, gen)
    model = te.ops.Sequential(
        te.ops.MakeExtraOutput().set_extra_output_channel(0, "a"),  # TE's default: also returned
        l1, te.ops.AddExtraInput(channel="a"),
        te.ops.MakeExtraOutput(channel="a"), te.ops.MakeExtraOutput(channel="b"),
        l2, te.ops.AddExtraInput(channel="b"), te.ops.AddExtraInput(channel="a"),
        te.ops.AddExtraInput(),  # public: the call's extra input
        l3, te.ops.AddExtraInput(channel="b"),
    )
    x, e = representable(T, D, generator=gen, scale_exp=-1), representable(T, D, generator=gen, scale_exp=-1)
    dy, dr = representable(T, D, generator=gen), representable(T, D, generator=gen)
    assert model.groups()[0].num_extra_inputs == 1 and model.groups()[0].num_extra_outputs == 1
    out, grads = _grads(model, x, e, dys=(dy, dr))
    assert len(out) == 2 and torch.equal(out[1], x)

    ref = [copy.deepcopy(m).double() for m in (l1, l2, l3)]
    xr, er = x.double().requires_grad_(True), e.double().requires_grad_(True)
    h = xr + ref[0](xr)
    g = h + ref[1](h) + h + er
    y = ref[2](g) + h
    torch.autograd.backward([y, xr], [dy.double(), dr.double()])
    expected = [xr.grad, er.grad, *[p.grad for m in ref for p in m.parameters()]]
    assert_close(out[0].double(), y.detach(), torch.float32, "output", scaled=True)
    for i, (a, b) in enumerate(zip(grads, expected)):
        assert_close(a.double(), b, torch.float32, f"gradient {i}", scaled=True)


def test_no_fused_step_holds_both_ends_of_a_channel():
    """A rule whose window would take a channel's writer and reader declines, with the
    reason in the plan (the reader's input exists only once the writer's step ran)."""
    def never_built(ops):
        raise AssertionError("a fused op over both ends of a channel was built")

    straddle = FusionRule("test_branch_add", "forward", ((te.ops.MakeExtraOutput,), (te.ops.AddExtraInput,)),
                          never_built)
    model = te.ops.Sequential(te.ops.MakeExtraOutput(channel="r"), te.ops.AddExtraInput(channel="r"),
                              rules=RuleTable((straddle,)))
    x = representable(4, D)
    out, grads = _grads(model, x, dys=(torch.ones(4, D),))
    assert torch.equal(out[0], 2 * x) and torch.equal(grads[0], torch.full((4, D), 2.0))
    plan = model.fusion_plan()
    assert "test_branch_add at ops 0..1: the window holds both the writer (op 0) and a reader (op 1)" in plan, plan


# -- errors ------------------------------------------------------------------------------

BAD = {
    "read, never written": (
        lambda: [te.ops.RMSNorm(D), te.ops.AddExtraInput(channel="res")],
        "channel 'res': AddExtraInput[<-'res'] (op 1) reads it, and no earlier op of its group writes it"),
    "written twice, unread": (
        lambda: [te.ops.MakeExtraOutput(channel="res"), te.ops.Linear(D, D), te.ops.MakeExtraOutput(channel="res"),
                 te.ops.AddExtraInput(channel="res")],
        "channel 'res': MakeExtraOutput[->'res'] (op 0) writes it and MakeExtraOutput[->'res'] (op 3) writes it "
        "again before any op reads it"),
    "written, never read": (
        lambda: [te.ops.MakeExtraOutput(channel="res"), te.ops.Linear(D, D)],
        "channel 'res': MakeExtraOutput[->'res'] (op 0) writes it, and no later op of its group reads it"),
    "mismatched shapes": (
        lambda: [te.ops.MakeExtraOutput(channel="res"), te.ops.Linear(D, FFN), te.ops.AddExtraInput(channel="res")],
        "channel 'res': MakeExtraOutput[->'res'] (op 0) writes a tensor of shape (4, 64), and "
        "AddExtraInput[<-'res'] (op 3) reads it for an input of shape (4, 128)"),
    "across a plain module": (
        lambda: [te.ops.MakeExtraOutput(channel="res"), te.ops.Linear(D, D), torch.nn.Tanh(),
                 te.ops.AddExtraInput(channel="res")],
        "channel 'res': MakeExtraOutput[->'res'] (group 0) writes it and AddExtraInput[<-'res'] (group 2) reads "
        "it, across the plain module(s) Tanh"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unresolved_channels_are_refused_at_plan_build(case):
    make, message = BAD[case]
    model = te.ops.Sequential(*make())  # made step by step (append) it would be incomplete on the way: no error yet
    recipe = R.DelayedScaling()
    with pytest.raises(ValueError) as info, te.autocast(recipe=recipe):
        model(representable(4, D))
    assert message in str(info.value), str(info.value)
    # raised before any state changed: no plan, no quantizers installed
    assert model.fusion_stats().builds == 0
    assert all(op.installed_quantizers == {} for g in model._fusers() for op in g.ops)
    with pytest.raises(ValueError, match="channel 'res'"):
        model.prepare(representable(4, D), recipe=recipe)


def test_mismatched_shapes_are_refused_for_a_new_input_shape_too():
    """A plan built for one input shape validates a channel against each new one."""
    model = te.ops.Sequential(te.ops.MakeExtraOutput(channel="r"), te.ops.Reshape((-1, D)),
                              te.ops.AddExtraInput(channel="r"))
    assert model(torch.ones(4, D)).shape == (4, D)
    with pytest.raises(ValueError, match=r"writes a tensor of shape \(2, 2, 64\).*input of shape \(4, 64\)"):
        model(torch.ones(2, 2, D))
    assert model.fusion_stats().builds == 1


def test_bindings_are_checked_and_locked_once_a_fuser_captures_them():
    add = te.ops.AddExtraInput()
    with pytest.raises(ValueError, match="non-empty string"):
        add.set_extra_input_channel(0, "")
    with pytest.raises(IndexError, match="index 1 out of range"):
        add.set_extra_input_channel(1, "r")
    with pytest.raises(TypeError, match="output_to_caller"):
        te.ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=1)
    with pytest.raises(ValueError, match="only with a channel"):
        te.ops.MakeExtraOutput(output_to_caller=True)
    make = te.ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
    add.set_extra_input_channel(0, "r")
    te.ops.Sequential(make, add)
    for op, setter in ((add, add.set_extra_input_channel), (make, make.set_extra_output_channel)):
        with pytest.raises(RuntimeError, match="has captured this op's channel bindings"):
            setter(0, None)


# -- training ------------------------------------------------------------------------------

def test_recipe_switch_mid_training_is_bit_identical_to_a_fresh_model():
    """Two steps under delayed scaling, then a switch to block scaling: the switched
    layer's step equals a fresh layer's with the same weights and state, bit for bit."""
    gen = torch.Generator().manual_seed(17)
    model = make_layer(gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, dy = _inputs(gen)
    for _ in range(2):
        opt.zero_grad()
        with te.autocast(recipe=RECIPES["delayed"]):
            y = model(x)
        y.backward(dy)
        opt.step()
    fresh = te.ops.Sequential(*layer_ops())
    fresh.load_state_dict(model.state_dict())
    model.zero_grad(set_to_none=True)
    for recipe in (RECIPES["block"], RECIPES["current_mha"]):
        outs = [run(m, x, recipe=recipe, dy=dy) for m in (model, fresh)]
        assert torch.equal(outs[0][0][0], outs[1][0][0])
        for name in outs[0][1]:
            assert torch.equal(outs[0][1][name], outs[1][1][name]), name
        model.zero_grad(), fresh.zero_grad()
        assert model.fusion_plan().rules() == fresh.fusion_plan().rules()


def test_two_layers_train_as_one_sequential():
    """Two layers in one Sequential, reusing the channel names (a name written again
    once read), train as the same layers chained as two Sequentials do, bit for bit;
    the loss falls."""
    gen = torch.Generator().manual_seed(23)
    one = te.ops.Sequential(*make_layer(gen), *make_layer(gen))
    two = torch.nn.Sequential(te.ops.Sequential(*copy.deepcopy(list(one)[:13])),
                              te.ops.Sequential(*copy.deepcopy(list(one)[13:])))
    x, _ = _inputs(gen)
    target = representable(B, T, D, generator=gen, scale_exp=-2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (one, two)]
    losses = {0: [], 1: []}
    for step in range(4):
        recipe = RECIPES["delayed"] if step < 3 else RECIPES["mxfp8"]
        for i, (m, opt) in enumerate(zip((one, two), opts)):
            opt.zero_grad()
            with te.autocast(recipe=recipe):
                loss = (m(x) - target).pow(2).mean()
            loss.backward()
            opt.step()
            losses[i].append(loss.item())
    assert losses[0] == losses[1]
    assert losses[0][2] < losses[0][0], losses
    assert {"forward_linear_bias_add", "backward_add_rmsnorm"} <= one.fusion_plan().rules()


def test_gpt_blocks_as_one_sequential_equal_the_two_sequential_blocks():
    """``GPTConfig(layer="one_sequential")``: each block one Sequential with its residuals
    on channels, the same model as the default blocks (``sub(x, x)``), bit for bit."""
    from te_fuser.models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=2, d_model=D, n_head=HEADS, d_ffn=FFN, seq_len=T, batch_size=B, attention="te")
    torch.manual_seed(29)
    two = GPT(config)
    one = GPT(config.replace(layer="one_sequential"))
    with torch.no_grad():
        for p, q in zip(two.parameters(), one.parameters(), strict=True):
            q.copy_(p)
    assert all(len(block.layer.groups()) == 1 for block in one.blocks)
    idx = torch.randint(256, (B, T), generator=torch.Generator().manual_seed(1))
    for recipe in (RECIPES["delayed"], RECIPES["current_mha"]):
        losses = []
        for model in (two, one):
            model.zero_grad(set_to_none=True)
            with te.autocast(recipe=recipe):
                loss = model(idx).float().logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (name, p), q in zip(two.named_parameters(), one.parameters()):
            assert torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="GPTConfig.layer"):
        config.replace(attention="sdpa", layer="one_sequential")


def test_channels_under_torch_compile():
    """A compiled graph's fake outputs are the public ones (a channel also returned,
    the internal one not), and the compiled group computes as the eager one."""
    gen = torch.Generator().manual_seed(31)
    model = te.ops.Sequential(te.ops.MakeExtraOutput(channel="r"), te.ops.RMSNorm(D), _linear(D, D, gen),
                              te.ops.AddExtraInput(channel="r"),
                              te.ops.MakeExtraOutput().set_extra_output_channel(0, "s"), _linear(D, D, gen),
                              te.ops.AddExtraInput(channel="s"))
    x, dy, dr = (representable(T, D, generator=gen, scale_exp=-2) for _ in range(3))
    eager = _grads(model, x, dys=(dy, dr))
    compiled = _grads(torch.compile(model, backend="aot_eager", fullgraph=True), x, dys=(dy, dr))
    for a, b in zip([*eager[0], *eager[1]], [*compiled[0], *compiled[1]], strict=True):
        assert torch.equal(a, b)
