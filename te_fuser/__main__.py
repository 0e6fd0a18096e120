"""``python -m te_fuser``: train a small MLP through a schedule of recipes, beside torch in bf16.

The model learns to imitate a fixed random teacher on synthetic data while the
recipe changes between phases (bf16 -> delayed -> current -> block -> MXFP8 ->
bf16); the same network in plain torch, from the same initial weights on the same
batches, trains in bf16 beside it as the baseline. For each phase it prints both
losses, the re-fusion events and what they cost, and the fusion plan each FP8
phase ran; it writes a JSON report and the loss curves (SVG, and PNG when
matplotlib is installed) into ``--out``. Runs on the GPU when one is present, else
on the CPU (under a minute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

import te_fuser as te

from .plot import line_chart

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


def build_baseline(model: te.ops.Sequential) -> torch.nn.Sequential:
    """The same network in plain torch, with ``model``'s weights (te's keys are torch's)."""
    norm, fc1, _, fc2 = model
    torch_model = torch.nn.Sequential(
        torch.nn.RMSNorm(norm.size, eps=norm.eps), torch.nn.Linear(fc1.linear.in_features, fc1.linear.out_features),
        torch.nn.GELU(approximate="tanh"), torch.nn.Linear(fc2.linear.in_features, fc2.linear.out_features),
    ).to(norm.weight.device)
    torch_model.load_state_dict(model.state_dict())
    return torch_model


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m te_fuser", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=_positive, default=40, help="optimizer steps per phase")
    p.add_argument("--batch", type=_positive, default=256)
    p.add_argument("--hidden", type=_positive, default=256)
    p.add_argument("--ffn", type=_positive, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", metavar="DIR", default="te_fuser_report",
                   help="where report.json and the loss curves go (default: ./te_fuser_report)")
    p.add_argument("--json", metavar="PATH", help="also write the per-phase figures as JSON here")
    args = p.parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError as err:
        p.error(f"--device {args.device}: {err}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is available")
    _check_shapes(p, args)
    return args


def _check_shapes(parser: argparse.ArgumentParser, args) -> None:
    """Every FP8 phase's plan is built (not published) for the batch: a size a recipe
    cannot take is a one-line error before anything runs."""
    model = build_model(args.hidden, args.ffn, "meta")
    x = torch.empty(args.batch, args.hidden, device="meta")
    for name, recipe in SCHEDULE:
        for fuser in (g for g in model.groups() if isinstance(g, te.ops.OperationFuser)):
            try:
                fuser.candidate(recipe, False, x.shape, torch.bfloat16, args.device, True, True)
            except (ValueError, RuntimeError) as err:
                parser.error(f"--batch {args.batch} --hidden {args.hidden} --ffn {args.ffn}: the {name} phase "
                             f"cannot run: {err}")


def _train_phase(model, baseline, opts, teacher, recipe, args) -> tuple[list[float], list[float], float]:
    losses, base_losses = [], []
    device = args.device
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.hidden, device=device)
        with torch.no_grad():
            target = teacher(x)
        for net, opt, out in ((model, opts[0], losses), (baseline, opts[1], base_losses)):
            fp8 = recipe is not None and net is model
            with torch.autocast(device.type, dtype=torch.bfloat16), te.autocast(enabled=fp8, recipe=recipe):
                y = net(x)
            loss = torch.nn.functional.mse_loss(y.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(loss.item())
    return losses, base_losses, time.perf_counter() - t0


def _header(device: torch.device) -> dict:
    from .ops import hot_guard

    reason = hot_guard.unavailable_reason()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"te_fuser": te.__version__, "device": name, "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "hot_path": "compiled" if reason is None else f"Python ({reason})"}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = args.device
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, args.hidden)
    ).to(device)
    model = build_model(args.hidden, args.ffn, device)
    baseline = build_baseline(model)
    opts = (torch.optim.AdamW(model.parameters(), lr=2e-3), torch.optim.AdamW(baseline.parameters(), lr=2e-3))
    info = _header(device)
    print(f"te_fuser {info['te_fuser']} on {device} ({info['device']}; torch {info['torch']}); compute dtype "
          f"bfloat16; hot path: {info['hot_path']}; baseline: the same MLP in plain torch, bf16")
    print(f"{'phase':<8} {'recipe':<22} {'loss first->last':>18} {'torch bf16':>10} {'re-fusions':>10} "
          f"{'build ms':>9} {'step ms':>8}")
    rows, curves, plans = [], {"te_fuser": [], "torch bf16": []}, []
    for phase, recipe in SCHEDULE:
        before = model.fusion_stats()
        losses, base_losses, elapsed = _train_phase(model, baseline, opts, teacher, recipe, args)
        after = model.fusion_stats()
        row = {
            "phase": phase,
            "recipe": type(recipe).__name__ if recipe is not None else "high precision",
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "torch_bf16_loss_last": base_losses[-1],
            "refusions": after.builds - before.builds,
            "build_ms": 1e3 * (after.build_seconds - before.build_seconds),
            "step_ms": 1e3 * elapsed / args.steps,
        }
        rows.append(row)
        curves["te_fuser"] += losses
        curves["torch bf16"] += base_losses
        print(f"{phase:<8} {row['recipe']:<22} {row['loss_first']:>8.4f}->{row['loss_last']:<8.4f} "
              f"{row['torch_bf16_loss_last']:>10.4f} {row['refusions']:>10d} {row['build_ms']:>9.3f} "
              f"{row['step_ms']:>8.2f}")
        if recipe is not None:
            plans.append((phase, model.fusion_plan()))
    for phase, text in plans:
        print(f"\nfusion plan of the {phase} phase:\n{text}")
    _write_report(args, info, rows, curves, plans)
    return rows


def _write_report(args, info: dict, rows: list, curves: dict, plans: list) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items()}
    report = {"config": config, **info, "phases": rows, "losses": curves, "plans": dict(plans)}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    steps = list(range(1, len(curves["te_fuser"]) + 1))
    markers = [(1 + i * args.steps, phase) for i, (phase, _) in enumerate(SCHEDULE)]
    written = line_chart(
        out / "loss.svg", {name: (steps, ys) for name, ys in curves.items()},
        title=f"te_fuser main job: MLP {args.hidden}->{args.ffn}->{args.hidden}, batch {args.batch}, "
              f"{args.steps} steps per phase",
        subtitle=f"{info['device']}, torch {info['torch']}, te_fuser {info['te_fuser']}, {info['date']}",
        xlabel="step", ylabel="MSE loss", markers=markers, png=True)
    print(f"\nwritten: {out / 'report.json'}, " + ", ".join(written))


if __name__ == "__main__":
    main()
