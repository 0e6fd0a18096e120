"""A small model whose training steps replay from CUDA graphs, through a recipe switch.

On a GPU the second step under each recipe captures the forward and backward and
later steps replay them; on the CPU every step runs eagerly, with the same results.
"""

import torch

import te_fuser as te

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = te.ops.Sequential(te.ops.Linear(256, 256, name="fc1"), te.ops.GELU(), te.ops.Linear(256, 256, name="fc2"))
model = model.to(device, torch.bfloat16)
graphed = te.make_graphed(model)
opt = torch.optim.AdamW(graphed.parameters(), lr=1e-3)
x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
target = torch.randn(128, 256, device=device, dtype=torch.bfloat16)

for recipe in (te.recipe.DelayedScaling(amax_history_len=16), te.recipe.Float8CurrentScaling()):
    for _ in range(5):
        with te.autocast(recipe=recipe):
            y = graphed(x)
        loss = torch.nn.functional.mse_loss(y.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"{type(recipe).__name__}: loss {loss.item():.4f}")

s = graphed.stats
print(f"captures: {s.captures}, replays: {s.replays}, eager steps: {s.eager_steps}")
print(f"re-fusions: {model.fusion_stats().builds}")
