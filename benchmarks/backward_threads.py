"""Where a small Linear's backward spends its host time, with autograd's device
threads (torch's default) and with the backward on the calling thread.

    python benchmarks/backward_threads.py [--size 1024] [--steps 50] [--rounds 15]

A host-bound step (Linear 1024^3 in bf16 with a bias, as ``small_loop.py``'s):
with CUDA tensors, autograd runs the backward on a device thread and the
calling thread waits for it, so each step pays two thread hand-offs, and the
backward's Python runs on a thread of its own. Per arm (bf16 eager, te_fuser
under current scaling and delayed scaling with the default amax history of 1024 and
with one of 16) and per mode, medians over ``--rounds``
rounds of ``--steps`` steps, the arms and modes taking turns: the step, the
forward, and the backward split by timestamps into

- ``start``: ``backward()`` called until the first hook on the output's gradient runs;
- ``body``: from there until the last leaf's gradient is accumulated;
- ``end``: from there until ``backward()`` returns to the caller;
- for te_fuser, ``fuser``: the time inside the fuser's backward (``run_backward``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_split  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser.ops import fuser as fuser_module  # noqa: E402

RECIPES = {"current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling(),
           "delayed h16": te.recipe.DelayedScaling(amax_history_len=16)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    n = args.size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    base = torch.nn.Linear(n, n).to(device, torch.bfloat16)
    model = te.ops.Sequential(te.ops.Linear(n, n)).to(device, torch.bfloat16)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    clock = time.perf_counter
    marks: dict[str, float] = {}
    fuser_module.run_backward = host_split._timed("fuser", fuser_module.run_backward)

    def on_leaf(_t):
        marks["last_leaf"] = clock()

    for module in (base, model):
        for p_ in module.parameters():
            p_.register_post_accumulate_grad_hook(on_leaf)
    x.register_post_accumulate_grad_hook(on_leaf)

    def on_output_grad(g):
        marks.setdefault("first", clock())
        return g

    def arm(module, recipe):
        params = list(module.parameters())

        def step(split):
            for p_ in params:
                p_.grad = None
            x.grad = None
            t0 = clock()
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x)
            y.register_hook(on_output_grad)
            marks.clear()
            t1 = clock()
            y.backward(dy)
            t2 = clock()
            split["forward"] += t1 - t0
            split["start"] += marks["first"] - t1
            split["body"] += marks["last_leaf"] - marks["first"]
            split["end"] += t2 - marks["last_leaf"]

        return step

    arms = {"bf16 eager": arm(base, None)}
    for name, recipe in RECIPES.items():
        arms[f"te_fuser {name}"] = arm(model, recipe)
    keys = ("step", "forward", "start", "body", "end", "fuser")
    rows: dict[tuple[str, bool], dict[str, list[float]]] = {
        (name, threaded): {k: [] for k in keys} for name in arms for threaded in (True, False)}
    for name, step in arms.items():
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                for _ in range(20):
                    step({k: 0.0 for k in keys})
    for r in range(args.rounds):
        order = list(rows) if r % 2 == 0 else list(reversed(rows))
        for name, threaded in order:
            split = {k: 0.0 for k in keys}
            host_split._SPENT.clear()
            with torch.autograd.set_multithreading_enabled(threaded):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = clock()
                for _ in range(args.steps):
                    arms[name](split)
                if device == "cuda":
                    torch.cuda.synchronize()
                split["step"] = clock() - t0
            split["fuser"] = host_split._SPENT["fuser"]
            for k in keys:
                rows[(name, threaded)][k].append(split[k] * 1e6 / args.steps)
    print(f"{'arm':21s} {'backward on':13s} " + " ".join(f"{k:>8s}" for k in keys)
          + f"   (us a step, medians of {args.rounds} rounds of {args.steps} steps)")
    for (name, threaded), cols in rows.items():
        print(f"{name:21s} {'device thread' if threaded else 'caller':13s} "
              + " ".join(f"{statistics.median(cols[k]):8.1f}" for k in keys))


if __name__ == "__main__":
    main()
