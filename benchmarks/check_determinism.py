"""Run-to-run reproducibility of a training loop: the yardstick GPT trained twice.

Trains the te arm of ``examples/train_gpt.py`` (smoke size by default) through a
schedule ``--repeats`` times in one process, and with ``--graphed`` once more
with its steps replayed from CUDA graphs (the eager runs then use the graphed
run's capturable AdamW, so that the two differ only in the graphs). Every run
starts from the same weights and batches, so every loss must be the same bits.
Prints, for each run after the first, the first step whose loss differs (with
both values) or "identical"; exits 1 on any difference.

The default schedule puts a phase-end evaluation between two phases of one
recipe (``bf16:5,bf16:3``) and then switches recipe: the place where a kernel
that adds in arrival order (float atomics) shows up, since an evaluation moves
what runs before the next training step.

    python benchmarks/check_determinism.py [--schedule S] [--repeats N] [--graphed] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt  # noqa: E402

DEFAULT_SCHEDULE = "bf16:5,bf16:3,delayed:4,current:4"


def losses(argv: list[str]) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        return train_gpt.main(argv)["arms"]["te"]["losses"]


def first_difference(a: list[float], b: list[float]) -> tuple[int, float, float] | None:
    """(step, a's loss, b's loss) where the two first differ, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    return None if len(a) == len(b) else (min(len(a), len(b)), float("nan"), float("nan"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE)
    parser.add_argument("--repeats", type=int, default=2, help="eager runs (at least 2 without --graphed)")
    parser.add_argument("--graphed", action="store_true", help="also a run through te.make_graphed_step (CUDA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="smoke")
    args = parser.parse_args(argv)
    if args.repeats < (1 if args.graphed else 2):
        parser.error("--repeats: at least 2 eager runs to compare (1 with --graphed)")
    base = ["--size", args.size, "--device", args.device, "--schedule", args.schedule, "--arms", "te",
            "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100", "--adamw", "fused"]
    make_adamw = train_gpt.make_adamw
    if args.graphed:  # the eager runs on the graphed run's optimizer
        train_gpt.make_adamw = lambda *a, capturable=False: make_adamw(*a, capturable=True)
    try:
        runs = [(f"eager {i + 1}", losses(base)) for i in range(args.repeats)]
        if args.graphed:
            runs.append(("graphed", losses(base + ["--graphed"])))
    finally:
        train_gpt.make_adamw = make_adamw
    print(f"{args.size} GPT on {args.device}, schedule {args.schedule}: {len(runs[0][1])} steps, "
          f"torch {torch.__version__}")
    failed = False
    for name, run in runs[1:]:
        diff = first_difference(runs[0][1], run)
        if diff is None:
            print(f"  {name:<8} identical to eager 1")
        else:
            failed = True
            step, a, b = diff
            print(f"  {name:<8} differs from eager 1 from step {step}: {a!r} against {b!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
