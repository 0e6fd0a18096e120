"""Compose a model from fusible ops, train it under one recipe, switch to another."""

import torch

import te_fuser as te

torch.manual_seed(0)
model = te.ops.Sequential(
    te.ops.RMSNorm(128),
    te.ops.Linear(128, 256, name="fc1"),
    te.ops.GELU(),
    te.ops.Linear(256, 128, name="fc2"),
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, target = torch.randn(64, 128), torch.randn(64, 128)

for recipe in (te.recipe.DelayedScaling(), te.recipe.MXFP8BlockScaling()):
    for _ in range(3):
        with te.autocast(recipe=recipe):  # a changed recipe re-fuses; an equal one is a hot-path hit
            loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"{type(recipe).__name__}: loss {loss.item():.4f}")

stats = model.fusion_stats()
print(f"re-fusions: {stats.builds}, hot-path hits: {stats.hits}")
print(model.fusion_plan())
