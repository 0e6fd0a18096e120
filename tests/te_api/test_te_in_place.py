"""TransformerEngine's ``in_place=True``: ``AddExtraInput`` writes ``x + extra`` into
the extra tensor's buffer and returns it; ``MakeExtraOutput`` adds the main
gradient into its branch's gradient. Gradients stay those of the out-of-place
ops, a backward that saved the overwritten tensor raises, and on a channel both
stay out of place."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import representable
from tolerances import assert_close


def test_add_extra_input_in_place_writes_the_extra_buffer():
    gen = torch.Generator().manual_seed(2)
    x = representable(4, 32, generator=gen).requires_grad_()
    extra = representable(4, 32, generator=gen, dtype=torch.bfloat16).requires_grad_()
    before = extra.detach().double().clone()
    y = te.ops.AddExtraInput(in_place=True)(x, extra)
    assert y.data_ptr() == extra.data_ptr() and y.dtype is torch.bfloat16  # the extra tensor's dtype
    assert_close(y, before + x.detach().double(), torch.bfloat16, "in-place sum")
    dy = representable(4, 32, generator=gen, dtype=torch.bfloat16)
    y.backward(dy)
    assert torch.equal(x.grad, dy.float()) and torch.equal(extra.grad, dy)


def test_add_extra_input_in_place_of_a_saved_tensor_raises():
    x = torch.randn(4, 8, requires_grad=True)
    extra_src = torch.randn(4, 8, requires_grad=True)
    extra = extra_src.exp()  # exp saves its output for the backward
    y = te.ops.AddExtraInput(in_place=True)(x, extra)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_make_extra_output_in_place_gradients():
    gen = torch.Generator().manual_seed(4)
    x = representable(8, 32, generator=gen).requires_grad_()
    d1, d2 = representable(8, 32, generator=gen), representable(8, 32, generator=gen)
    y1, y2 = te.ops.MakeExtraOutput(in_place=True)(x)
    (y1 * d1 + y2 * d2).sum().backward()
    assert_close(x.grad, d1.double() + d2.double(), torch.float32, "dx")


def test_in_place_residual_block_fuses_and_matches_out_of_place():
    gen = torch.Generator().manual_seed(6)
    x = representable(16, 64, generator=gen)
    res = representable(16, 64, generator=gen)
    dy, dres = representable(16, 64, generator=gen), representable(16, 64, generator=gen)
    outs = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.MakeExtraOutput(in_place=in_place), te.ops.Linear(64, 64),
                                  te.ops.AddExtraInput(in_place=in_place))
        x_t, r_t = x.clone().requires_grad_(), res.clone().requires_grad_()
        y, branch = model(x_t, r_t)
        torch.autograd.backward([y, branch], [dy, dres])
        outs[in_place] = (y.detach(), x_t.grad, r_t.grad, model[1].weight.grad)
        if in_place:
            assert y.data_ptr() == r_t.data_ptr()
            assert "forward_linear_bias_add" in model.fusion_plan().rules()
            assert "backward_linear_add" in model.fusion_plan().rules()
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_on_a_channel_in_place_stays_out_of_place():
    torch.manual_seed(1)
    model = te.ops.Sequential(te.ops.MakeExtraOutput(channel="res", in_place=True), te.ops.RMSNorm(32),
                              te.ops.Linear(32, 32), te.ops.AddExtraInput(channel="res", in_place=True))
    ref = te.ops.Sequential(te.ops.MakeExtraOutput(channel="res"), te.ops.RMSNorm(32), te.ops.Linear(32, 32),
                            te.ops.AddExtraInput(channel="res"))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 32)
    x_a, x_b = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_a, y_b = model(x_a), ref(x_b)
    assert torch.equal(x_a.detach(), x)  # the channel's tensor (the input) is not overwritten
    y_a.square().sum().backward()
    y_b.square().sum().backward()
    assert torch.equal(y_a, y_b) and torch.equal(x_a.grad, x_b.grad)


def test_in_place_flag_is_checked():
    with pytest.raises(TypeError, match="in_place"):
        te.ops.AddExtraInput(in_place="yes")
    with pytest.raises(TypeError, match="in_place"):
        te.ops.MakeExtraOutput(in_place=1)
