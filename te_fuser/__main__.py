"""``python -m te_fuser``: train a small MLP through a schedule of recipes.

The model learns to imitate a fixed random teacher on synthetic data while the
recipe changes between phases (bf16 -> delayed -> current -> block -> MXFP8 ->
bf16). For each phase it prints the loss, the re-fusion events and what they cost.
Runs on the GPU when one is present, else on the CPU (under a minute).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import te_fuser as te

SCHEDULE = [
    ("bf16", None),
    ("delayed", te.recipe.DelayedScaling(amax_history_len=16)),
    ("current", te.recipe.Float8CurrentScaling()),
    ("block", te.recipe.Float8BlockScaling()),
    ("mxfp8", te.recipe.MXFP8BlockScaling()),
    ("bf16", None),
]


def build_model(hidden: int, ffn: int, device) -> te.ops.Sequential:
    return te.ops.Sequential(
        te.ops.RMSNorm(hidden, device=device),
        te.ops.Linear(hidden, ffn, device=device, name="fc1"),
        te.ops.GELU(),
        te.ops.Linear(ffn, hidden, device=device, name="fc2"),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m te_fuser", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per phase")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="also write the per-phase figures as JSON")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, args.hidden)
    ).to(device)
    model = build_model(args.hidden, args.ffn, device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    from .ops import hot_guard

    reason = hot_guard.unavailable_reason()
    print(f"te_fuser {te.__version__} on {device} (torch {torch.__version__}); compute dtype bfloat16; "
          f"hot path: {'compiled' if reason is None else f'Python ({reason})'}")
    print(f"{'phase':<8} {'recipe':<22} {'loss first->last':>18} {'re-fusions':>10} {'build ms':>9} {'step ms':>8}")
    rows = []
    for phase, recipe in SCHEDULE:
        before = model.fusion_stats()
        losses, t0 = [], time.perf_counter()
        for _ in range(args.steps):
            x = torch.randn(args.batch, args.hidden, device=device)
            with torch.no_grad():
                target = teacher(x)
            with torch.autocast(device.type, dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            loss = torch.nn.functional.mse_loss(y.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        after = model.fusion_stats()
        row = {
            "phase": phase,
            "recipe": type(recipe).__name__ if recipe is not None else "high precision",
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "refusions": after.builds - before.builds,
            "build_ms": 1e3 * (after.build_seconds - before.build_seconds),
            "step_ms": 1e3 * elapsed / args.steps,
        }
        rows.append(row)
        print(
            f"{phase:<8} {row['recipe']:<22} {row['loss_first']:>8.4f}->{row['loss_last']:<8.4f} "
            f"{row['refusions']:>10d} {row['build_ms']:>9.3f} {row['step_ms']:>8.2f}"
        )
    print("\nfusion plan now:\n" + model.fusion_plan())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
