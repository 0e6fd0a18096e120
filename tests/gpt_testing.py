"""A small GPT trained one step per auto-table entry of a kernel: the helper of the
GPU tests that compare a new kernel's entry with the one before it in a model."""

from __future__ import annotations

import torch

import te_fuser as te
from te_fuser import backend
from te_fuser.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=2, d_model=128, n_head=2, d_ffn=256, seq_len=64, batch_size=2)


def step_per_auto_entry(kernel: str, entries: list[str], lean_owner, monkeypatch, recipe=None) -> tuple[dict, list]:
    """``({entry: (loss, {parameter name: gradient})}, calls)``: for each of ``entries``
    in turn, ``kernel``'s auto entry set to it (the table's entry put back after), a
    fresh GPT of :data:`CONFIG` (seed 0) runs one forward under ``recipe`` (current
    scaling by default) and bf16 autocast and one backward on a fixed batch. ``lean_owner.lean`` (the new
    kernel's lean entry) is wrapped for the last entry's run: ``calls`` holds, per
    call, whether it answered (not None)."""
    calls: list = []
    entry = lean_owner.lean

    def counted(*args, **kwargs):  # the ops pass some lean arguments by keyword (in_place, params)
        out = entry(*args, **kwargs)
        calls.append(out is not None)
        return out

    batch = torch.randint(0, 256, (2, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for i, name in enumerate(entries):
        previous = backend.set_auto_entry(kernel, name)
        try:
            if i == len(entries) - 1:
                monkeypatch.setattr(lean_owner, "lean", counted)
            torch.manual_seed(0)
            model = GPT(CONFIG, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16), \
                    te.autocast(recipe=recipe or te.recipe.Float8CurrentScaling()):
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            runs[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        finally:
            backend.set_auto_entry(kernel, previous)
    return runs, calls
