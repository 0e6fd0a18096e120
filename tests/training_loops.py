"""Training loops as users write them, shared by the tests that need a whole run as
evidence (not a unit of it)."""

from __future__ import annotations

import io

import torch

import te_fuser as te


def gpt_losses(steps: int = 6, device: str = "cpu") -> list[float]:
    """The smoke GPT through a recipe schedule as a user trains it: fused AdamW, an
    evaluation without FP8 after every step, a checkpoint saved mid-way and resumed
    into a fresh model and optimizer, recipe switches (bf16 -> delayed -> current ->
    bf16). Every training and evaluation loss, in order, as Python floats; on
    ``device`` (bf16 autocast there)."""
    from te_fuser.models.gpt import GPT, GPTConfig

    config = GPTConfig.smoke()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (config.batch_size, config.seq_len + 1), generator=gen).to(device)
               for _ in range(steps)]
    schedule = [None, te.recipe.DelayedScaling(), te.recipe.DelayedScaling(), te.recipe.Float8CurrentScaling(),
                te.recipe.Float8CurrentScaling(), None]

    def fresh():
        torch.manual_seed(0)
        model = GPT(config).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    model, opt = fresh()
    losses = []
    for step, batch in enumerate(batches):
        recipe = schedule[step % len(schedule)]
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device, dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            val = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        model.train()
        losses += [loss.item(), val.item()]
        if step == 2:  # a checkpoint, resumed into a new model and optimizer
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=False, map_location=device)
            model, opt = fresh()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    return losses
