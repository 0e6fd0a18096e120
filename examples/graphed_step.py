"""A whole training step (forward, loss, backward, optimizer) replayed from one CUDA graph.

On a GPU the first two steps under each recipe run eagerly, the third captures
and later steps replay; on the CPU every step runs eagerly, with the same results.
"""

import torch

import te_fuser as te

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = te.ops.Sequential(te.ops.Linear(256, 256, name="fc1"), te.ops.GELU(), te.ops.Linear(256, 256, name="fc2"))
model = model.to(device, torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=device == "cuda")  # its state on the GPU


def train_step(x, target):
    loss = torch.nn.functional.mse_loss(model(x).float(), target)
    loss.backward()  # each call starts without gradients: no zero_grad needed
    opt.step()
    return loss


step = te.make_graphed_step(train_step, model)
x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
target = torch.randn(128, 256, device=device)

for recipe in (te.recipe.DelayedScaling(amax_history_len=16), te.recipe.Float8CurrentScaling()):
    for _ in range(5):
        with te.autocast(recipe=recipe):  # the recipe is read here, around the call
            loss = step(x, target)
    print(f"{type(recipe).__name__}: loss {loss.item():.4f}")

s = step.stats
print(f"captures: {s.captures}, replays: {s.replays}, eager steps: {s.eager_steps}")
print(f"re-fusions: {model.fusion_stats().builds}")
