"""A recipe for the whole model at once: te.apply_recipe, with a pinned head.

The model's own recipe runs when no te.autocast names one; a te.autocast region
that names a recipe (or disables FP8) overrides it, except in the pinned head;
a recipe one module cannot take is refused before any module changes.
"""

import torch
from torch import nn

import te_fuser as te


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(),
                                      te.ops.Linear(128, 64))
        self.head = te.ops.Linear(64, 48)  # 48 outputs: no MXFP8 (it needs multiples of 32)

    def forward(self, x):
        return self.head(self.body(x))


torch.manual_seed(0)
model = Net()
x = torch.randn(32, 64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

te.apply_recipe(model, te.recipe.DelayedScaling(), example_inputs=x, overrides={"head": None})
for _ in range(3):  # no te.autocast: the model's own recipe, the head in high precision
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()

with te.autocast(enabled=False):  # an evaluation in high precision: the head is pinned anyway
    print(f"loss in high precision: {model(x).square().mean().item():.4f}")

try:
    te.apply_recipe(model, te.recipe.MXFP8BlockScaling(), example_inputs=x)  # the head cannot take it
except ValueError as err:
    print(f"refused, nothing changed: {str(err)[:60]}...")

te.apply_recipe(model, te.recipe.MXFP8BlockScaling(), example_inputs=x, overrides={"head": None})
model(x).square().mean().backward()
print(te.fusion_plan(model).splitlines()[0])
# the body's plans: the two applied recipes, and the evaluation's high-precision one
print(f"re-fusions: {te.fusion_stats(model).by_path['body'].builds}")
