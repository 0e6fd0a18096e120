"""The small Linear's training-loop step, te_fuser eager beside bf16 eager, drift-resistant.

    python benchmarks/small_loop.py [--size 1024] [--steps 50] [--rounds 30] [--recipes current delayed] [--caller-backward]

A host-bound step (Linear 1024^3 in bf16 with a bias, forward + backward, fresh
gradients each step, as ``bench_layers.py``'s small case): its time is the host's,
and the GPU machine's host drifts in speed by tens of percent between and within
processes. So the arms take turns in short rounds of ``--steps`` steps, and each
round gives a ratio to the bf16 round beside it; the rows are the medians of the
per-round times and of the per-round ratios (bf16 eager's ms over the arm's: the
issue's "x of bf16 eager"), with their spread. Run the same command on two trees
with ``ab_gpu.sh`` to compare them. ``--caller-backward`` adds each arm again with
its backward on the calling thread (autograd's device thread off for that arm),
its ratio taken to bf16 eager's run the same way: what the hand-off between the
threads costs each arm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import te_fuser as te

RECIPES = {"current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--caller-backward", action="store_true",
                   help="also every arm with its backward on the calling thread (autograd's device thread off)")
    args = p.parse_args(argv)
    n = args.size
    torch.manual_seed(0)
    base = torch.nn.Linear(n, n).cuda().bfloat16()
    model = te.ops.Sequential(te.ops.Linear(n, n)).cuda().bfloat16()
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def step_of(module, recipe=None, threaded=True):
        params = list(module.parameters())

        def step():
            for p_ in params:
                p_.grad = None
            x.grad = None
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x)
            with torch.autograd.set_multithreading_enabled(threaded):
                y.backward(dy)

        return step

    arms, baseline = {}, {}  # each arm's step, and the bf16 arm its ratio is taken to
    modes = [(True, " eager")] + ([(False, ", caller bwd")] if args.caller_backward else [])
    for threaded, suffix in modes:
        bf16 = f"bf16{suffix}"
        arms[bf16], baseline[bf16] = step_of(base, threaded=threaded), bf16
        for name in args.recipes:
            arms[f"te_fuser {name}{suffix}"] = step_of(model, RECIPES[name], threaded)
            baseline[f"te_fuser {name}{suffix}"] = bf16
    times: dict[str, list[float]] = {name: [] for name in arms}
    for step in arms.values():
        for _ in range(20):
            step()
    for _ in range(args.rounds):
        for name, step in arms.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / args.steps)
    print(f"{'arm':30s} {'ms/step':>8s} {'x bf16':>7s}  (medians of {args.rounds} rounds of {args.steps} steps; "
          f"ratio range; caller bwd arms against bf16, caller bwd)")
    for name, ts in times.items():
        ratios = [b / t for b, t in zip(times[baseline[name]], ts)]
        print(f"{name:30s} {statistics.median(ts):8.4f} {statistics.median(ratios):7.3f}  "
              f"{min(ratios):.3f}..{max(ratios):.3f}")


if __name__ == "__main__":
    main()
