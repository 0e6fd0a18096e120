"""Activation checkpointing: each block's activations recomputed in the backward.

``te.checkpoint(block, x)`` keeps none of the block's activations (FP8 copies
included) and rebuilds them in the backward under the recipe and scales of the
forward. Training is the same bits as keeping them, through a recipe switch:
this trains a checkpointed model beside a twin that keeps its activations.
"""

import copy

import torch

import te_fuser as te

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
hidden = 128


class Model(torch.nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            te.ops.Sequential(te.ops.LayerNorm(hidden), te.ops.Linear(hidden, 4 * hidden), te.ops.GELU(),
                              te.ops.Linear(4 * hidden, hidden), te.ops.AddExtraInput())  # x + mlp(x), seq(x, x)
            for _ in range(4))
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = te.checkpoint(block, x, x) if self.checkpointed else block(x, x)
        return x


model = Model(checkpointed=True).to(device)
twin = copy.deepcopy(model)
twin.checkpointed = False
opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
x = torch.randn(256, hidden, device=device)
target = torch.randn(256, hidden, device=device)

for recipe in (te.recipe.DelayedScaling(amax_history_len=16), te.recipe.Float8CurrentScaling()):
    for _ in range(5):
        losses = []
        for m, opt in zip((model, twin), opts):
            with torch.autocast(device, dtype=torch.bfloat16), te.autocast(recipe=recipe):
                y = m(x)
            loss = torch.nn.functional.mse_loss(y.float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    print(f"{type(recipe).__name__}: loss {losses[0].item():.4f}, the twin's {losses[1].item():.4f}")

same = all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
print(f"weights identical to the twin's: {same}")
print(f"re-fusions: {model.blocks[0].fusion_stats().builds}")
