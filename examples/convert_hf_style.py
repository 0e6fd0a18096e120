"""Convert a PyTorch model you already have, then train it in FP8.

A Hugging Face-style decoder block (RMSNorm, attention with q/k/v/o projections,
a gated MLP), written in plain torch, converted by one call: its nn.Linear and
nn.RMSNorm become te_fuser ops sharing the same Parameters, its checkpoint keys
stay the same, and it trains under an FP8 recipe like its unconverted self.
"""

import copy

import torch
from torch import nn
from torch.nn import functional as F

import te_fuser as te


class MLP(nn.Module):  # the shape of LlamaMLP
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderLayer(nn.Module):  # the shape of LlamaDecoderLayer
    def __init__(self, hidden=64, intermediate=128, heads=4):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.self_attn = Attention(hidden, heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def train(model, recipe, steps=20):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16, 64, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = (model(x).float() - x.flip(-1)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


torch.manual_seed(0)
plain = DecoderLayer()
model, report = te.convert(copy.deepcopy(plain), report=True)
print(f"converted: {len(report.converted)} modules")  # 7 Linear + 2 RMSNorm
plain.load_state_dict(model.state_dict())  # the same keys, both ways
model.load_state_dict(plain.state_dict())

print(f"torch bf16 final loss:   {train(copy.deepcopy(plain), None):.4f}")
for recipe in (te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling()):
    print(f"{type(recipe).__name__:<22} {train(copy.deepcopy(model), recipe):.4f}")
