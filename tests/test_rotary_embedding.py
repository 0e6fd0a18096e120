"""te.ops.RotaryEmbedding against a float64 rotation: q and k rotated, v untouched,
positions with an offset, the backward the inverse rotation; bad shapes named."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from op_testing import RECIPES, representable, run
from tolerances import assert_close

H, HKV, D, T, B = 8, 2, 32, 67, 2
W = (H + 2 * HKV) * D


def rope64(x, offset=0, base=10000.0):
    """Float64 RoPE (rotate half) of the q and k heads of the fused (B, T, W) ``x``."""
    batch, seq, _ = x.shape
    heads = x.reshape(batch, seq, H + 2 * HKV, D)
    pos = torch.arange(offset, offset + seq, dtype=torch.float64)
    freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * freq[None, :]  # (T, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    qk, v = heads[:, :, :H + HKV], heads[:, :, H + HKV:]
    a, b = qk[..., :D // 2], qk[..., D // 2:]
    rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([rotated, v], dim=2).reshape(x.shape)


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_rotary_matches_float64(recipe_name, dtype, offset):
    gen = torch.Generator().manual_seed(1)
    op = te.ops.RotaryEmbedding(H, D, HKV, position_offset=offset)
    x = representable(B, T, W, generator=gen, dtype=dtype)
    dy = representable(B, T, W, generator=gen, dtype=dtype)
    outs, grads = run(op, x, recipe=RECIPES[recipe_name], dy=dy)
    x64 = x.double().requires_grad_(True)
    ref = rope64(x64, offset)
    ref.backward(dy.double())
    key = dtype if dtype is torch.bfloat16 else "attention_fp32"
    context = f"rope recipe={recipe_name} dtype={dtype} offset={offset}"
    assert outs[0].dtype == dtype
    assert_close(outs[0], ref.detach(), key, f"{context} output")
    assert_close(grads["x"], x64.grad, key, f"{context} dx")
    v = slice((H + HKV) * D, W)
    assert torch.equal(outs[0][..., v], x[..., v]) and torch.equal(grads["x"][..., v], dy[..., v])


def test_the_backward_is_the_inverse_rotation_and_two_dimensional_input_is_one_sequence():
    op = te.ops.RotaryEmbedding(H, D, HKV)
    x = torch.randn(T, W, dtype=torch.float64)
    y, _ = run(op, x, dy=x)
    assert torch.equal(y[0], run(op, x[None])[0][0][0])
    rotated = y[0]
    _, g = run(op, x, dy=rotated)
    torch.testing.assert_close(g["x"], x, rtol=1e-6, atol=1e-6)  # the rotation's transpose undoes it


def test_bad_arguments_and_shapes_name_the_op_and_the_constraint():
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.head_dim: must be even"):
        te.ops.RotaryEmbedding(4, 33)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.num_kv_heads: must divide"):
        te.ops.RotaryEmbedding(8, 32, 3)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.base"):
        te.ops.RotaryEmbedding(8, 32, base=1.0)
    op = te.ops.RotaryEmbedding(8, 32, 2)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.position_offset"):
        op.position_offset = -1
    with pytest.raises(ValueError, match=r"RotaryEmbedding: input's last dim is 320; .* = 384 wide"):
        op(torch.zeros(2, 3, 320))


@pytest.mark.parametrize("backend,recipe_name", [("reference", "none"), ("reference", "current"),
                                                 ("reference", "delayed"), ("reference", "current_mha"),
                                                 ("triton", "current")])
def test_the_rotations_in_place_give_the_copys_bits(recipe_name, backend):
    """Linear(+bias) -> RotaryEmbedding fused (``forward_linear_bias_rotary``: the
    rotation written back into the GEMM's output) and RotaryEmbedding ->
    DotProductAttention's backward (``backward_rotary_dpa``: the inverse rotation
    written back into attention's dqkv), against the same attention sub-layer with
    those rules left out (the rotation's copies): outputs and every gradient bit for
    bit, over one training step (two under delayed scaling: its second's scales). On the Triton
    backend (the interpreter on a CPU) without the attention, which the interpreter
    takes long to run."""
    import copy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    hidden = 64
    core = [te.ops.DotProductAttention(H, D, HKV, causal=True), te.ops.Linear(H * D, hidden)] \
        if backend == "reference" else [te.ops.Linear(W, hidden)]
    model = te.ops.Sequential(te.ops.LayerNorm(hidden), te.ops.Linear(hidden, W), te.ops.RotaryEmbedding(H, D, HKV),
                              *core)
    model = model.to(device, torch.bfloat16)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    recipe = RECIPES[recipe_name]
    rules = ["forward_linear_bias_rotary"] + (["backward_rotary_dpa"] if backend == "reference" else [])
    for _ in range(2 if recipe_name == "delayed" else 1):  # a stateless recipe's second step repeats its first
        x = representable(B, 32, hidden, generator=gen, dtype=torch.bfloat16, scale_exp=-3).to(device)
        dy = representable(B, 32, hidden, generator=gen, dtype=torch.bfloat16).to(device)
        with te.autocast(enabled=False, backend=backend):
            out_fused, g_fused = run(model, x, recipe=recipe, dy=dy)
            with te.ops.without_fusion_rules(*rules):
                out_copy, g_copy = run(twin, x, recipe=recipe, dy=dy)
    for rule in rules:
        assert rule in model.fusion_plan().rules() and rule not in twin.fusion_plan().rules(), rule
    assert torch.equal(out_fused[0], out_copy[0])
    for name in g_copy:
        assert torch.equal(g_fused[name], g_copy[name]), name
