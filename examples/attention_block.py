"""An attention sub-layer from te_fuser ops, trained in high-precision attention, then in FP8 attention."""

import torch

import te_fuser as te

torch.manual_seed(0)
d, heads = 64, 2
block = te.ops.Sequential(
    te.ops.LayerNorm(d),
    te.ops.Linear(d, 3 * d, name="qkv"),  # the fused (B, T, 3d) tensor: query, key, value heads
    te.ops.RotaryEmbedding(heads, d // heads),
    te.ops.DotProductAttention(heads, d // heads, causal=True),
    te.ops.Linear(d, d, name="proj"),
    te.ops.AddExtraInput(),  # + the residual, given as the block's second input
)
opt = torch.optim.AdamW(block.parameters(), lr=1e-3)
x, target = torch.randn(2, 32, d), torch.randn(2, 32, d)

# the first recipe runs attention in high precision (fp8_dpa off, as in TransformerEngine),
# the second runs its core in FP8 and hands FP8 across its boundaries (fp8_mha)
for recipe in (te.recipe.DelayedScaling(), te.recipe.DelayedScaling(fp8_mha=True)):
    for _ in range(3):
        with te.autocast(recipe=recipe):
            loss = torch.nn.functional.mse_loss(block(x, x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"DelayedScaling(fp8_mha={recipe.fp8_mha}): loss {loss.item():.4f}")

print(f"re-fusions: {block.fusion_stats().builds}")
print(block.fusion_plan())
