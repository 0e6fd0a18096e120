"""Where the host time of one small fwd+bwd step goes (Linear 1024^3, GPU).

Prints the Python functions with the most own time (cProfile) and the torch ops
with the most CPU time (torch.profiler) for te_fuser under a recipe and for bf16
eager, so the CPU-bound case can be worked on from data.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import te_fuser as te

RECIPES = {"current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling(),
           "delayed16": te.recipe.DelayedScaling(amax_history_len=16)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="current", choices=list(RECIPES))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--graphed", action="store_true", help="run te_fuser through te.make_graphed")
    p.add_argument("--main-thread", action="store_true",
                   help="profile with the backward on the calling thread (autograd's device threads off), so that "
                        "cProfile sees the backward's Python too; also splits the host time into forward and backward")
    args = p.parse_args(argv)
    n = args.size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = te.ops.Sequential(te.ops.Linear(n, n)).to(device, torch.bfloat16)
    if args.graphed:
        model = te.make_graphed(model)
    base = torch.nn.Linear(n, n).to(device, torch.bfloat16)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    recipe = RECIPES[args.recipe]

    def te_step():
        with te.autocast(recipe=recipe):
            y = model(x)
        y.backward(dy)

    def bf16_step():
        base(x).backward(dy)

    te_name = f"te_fuser {args.recipe}" + (" graphed" if args.graphed else "")
    for name, step in (("bf16 eager", bf16_step), (te_name, te_step)):
        for _ in range(20):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        host = (time.perf_counter() - t0) / args.steps
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        print(f"{name}: host {host * 1e6:.1f} us/step, wall {wall * 1e6:.1f} us/step")
    if args.graphed and device == "cuda":
        replay_components(model, x, dy, base)
    if args.main_thread:
        split_forward_backward(lambda: base(x), dy, args.steps, "bf16 eager")
        split_forward_backward(lambda: model(x), dy, args.steps, te_name, recipe)
    with torch.autograd.set_multithreading_enabled(not args.main_thread):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            te_step()
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30 if args.main_thread else 14)
    if args.main_thread:
        stats.sort_stats("cumulative").print_stats("te_fuser|kernels", 40)
        print(f"calls per step ({args.steps} steps), the most called first:")
        stats.sort_stats("ncalls").print_stats(45)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(20):
            te_step()
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def split_forward_backward(forward, dy, steps: int, name: str, recipe=None) -> None:
    """Host microseconds of the forward and of the backward, each timed alone
    (median over ``steps``; the backward on the calling thread); ``recipe``: the
    forward runs under ``te.autocast(recipe=recipe)``."""
    fwd, bwd = [], []
    with torch.autograd.set_multithreading_enabled(False):
        for i in range(steps + 20):
            t0 = time.perf_counter()
            if recipe is None:
                y = forward()
            else:
                with te.autocast(recipe=recipe):
                    y = forward()
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            if i >= 20:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
    fwd.sort()
    bwd.sort()
    print(f"{name}: host per step, backward on the calling thread: forward {fwd[len(fwd) // 2] * 1e6:.1f} us, "
          f"backward {bwd[len(bwd) // 2] * 1e6:.1f} us (medians)")


def replay_components(graphed, x, dy, base, calls: int = 2000) -> None:
    """Host microseconds per call of each piece of a replayed step, issued back to
    back (the GPU keeps up: each piece is a few microseconds of GPU work)."""
    graphs = graphed._graphs
    pair = graphs.cached
    flat = pair.grad_packs[0][0]
    empty = torch.empty(0, device=x.device)

    def per_call(fn) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    with torch.no_grad():
        pieces = {
            "copy x into the graph's input": lambda: graphs.static_x.copy_(x),
            "forward graph replay": pair.fwd.replay,
            "clone of the output": pair.static_y.clone,
            "copy dy into the graph's input": lambda: pair.static_dy.copy_(dy),
            "backward graph replay": pair.bwd.replay,
            "clone of the packed gradients": flat.clone,
            "one tiny kernel (fill_)": lambda: empty.fill_(1.0),
            "bf16 x @ w.T (addmm)": lambda: torch.nn.functional.linear(x, base.weight, base.bias),
        }
        for name, fn in pieces.items():
            print(f"  {name:34s} {per_call(fn):7.2f} us")


if __name__ == "__main__":
    main()
