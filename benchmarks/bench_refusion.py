"""What re-fusion costs, as a function of the number of ops.

For Sequential models of 2, 8, 32 and 128 ops (RMSNorm / Linear / Bias / GELU
mixes) it measures:

(a) the unchanged-recipe hot path per call: the work ``Sequential.forward`` does
    to decide that the published plan still applies, with the same recipe object
    and with a new-but-equal one (the plan's execution is replaced by a C no-op, and
    the costs of entering ``te.autocast`` with the same object and of fetching the
    next object are measured apart and subtracted; what ``te.autocast`` spends on
    recognising an equal object stays in);
(b) a warm switch (kernels compiled) between two recipes, split into its phases:
    key check, quantizers, fusion passes, validation, publish;
(c) the weight re-quantization after a switch, against its bandwidth floor;
(d) a cold switch: the first step under a recipe whose kernels never compiled,
    minus a steady step (GPU; on CPU the reference backend compiles nothing);
(e) the same after ``te.warmup``.

Prints a table, appends CSV rows (benchmarks/out/results.csv, untracked), with
``--plot PATH.svg`` draws the hot path and the warm switch against the op count
(the measured sizes on the x axis; device, versions and date in the subtitle),
and with ``--json PATH`` writes the figures.
``--quick`` finishes in well under 30 s on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser.ops import fuser as fuser_module  # noqa: E402
from te_fuser.ops import hot_guard  # noqa: E402
from te_fuser.ops import fusers_of  # noqa: E402

OP_COUNTS = (2, 8, 32, 128)
RECIPE_A = te.recipe.Float8CurrentScaling()
RECIPE_B = te.recipe.DelayedScaling(amax_history_len=16)


def make_model(n_ops: int, hidden: int, device) -> te.ops.Sequential:
    """``n_ops`` basic ops: Linear(+Bias) for 2, else blocks of RMSNorm, BasicLinear, Bias, GELU."""
    if n_ops == 2:
        return te.ops.Sequential(te.ops.Linear(hidden, hidden, device=device))
    ops = []
    for _ in range(n_ops // 4):
        ops += [te.ops.RMSNorm(hidden, device=device), te.ops.BasicLinear(hidden, hidden, device=device),
                te.ops.Bias(hidden, device=device), te.ops.GELU()]
    return te.ops.Sequential(*ops)


def _null_plan():
    """A plan that returns its input: the compiled hot path's C no-op when it loads
    (a Python lambda would add its own frame to every timed call)."""
    module = hot_guard.guard_module()
    return module.null_plan if module is not None else (lambda x, fuser_and_plan, *tensors: x)


@contextlib.contextmanager
def plans_not_executed(model):
    """Make the fuser return its input instead of running the plan (isolates the decision).
    The model's fusers forget any armed decision on entry and on exit, so neither the
    real call nor the no-op outlives its context."""
    def disarm():
        for f in fusers_of(model):
            if f._guard is not None:
                f._guard.disarm()

    original = fuser_module._FuserFunction.apply
    fuser_module._FuserFunction.apply = staticmethod(_null_plan())
    disarm()
    try:
        yield
    finally:
        fuser_module._FuserFunction.apply = original
        disarm()


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Best of ``repeats`` means over ``calls`` calls, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def hot_path(model, x, calls, repeats) -> dict:
    equal = [te.recipe.Float8CurrentScaling() for _ in range(calls)]
    with plans_not_executed(model), torch.no_grad():
        with te.autocast(recipe=RECIPE_A):
            model.forward(x)  # publish the plan
        it = iter(())

        def same():
            with te.autocast(recipe=RECIPE_A):
                model.forward(x)

        def new_equal():
            with te.autocast(recipe=next(it)):
                model.forward(x)

        def context_only():
            with te.autocast(recipe=RECIPE_A):
                pass

        def next_only():  # the loop's own cost of fetching the next recipe object
            next(it)

        t_same = per_call_us(same, calls, repeats)
        t_ctx = per_call_us(context_only, calls, repeats)
        best_equal = best_next = float("inf")
        for _ in range(repeats):
            it = iter(equal)
            best_equal = min(best_equal, per_call_us(new_equal, calls, 1))
            it = iter(equal)
            best_next = min(best_next, per_call_us(next_only, calls, 1))
    builds = model.fusion_stats().builds
    assert builds == 1, f"the hot path rebuilt ({builds} builds)"
    return {"same": max(t_same - t_ctx, 0.0), "equal": max(best_equal - best_next - t_ctx, 0.0),
            "autocast_enter_exit": t_ctx}


def warm_switch(model, x, switches) -> dict:
    with torch.no_grad():
        for r in (RECIPE_A, RECIPE_B):  # compile / warm everything once, for real
            with te.autocast(recipe=r):
                model(x)
    totals, phases = [], {}
    with plans_not_executed(model), torch.no_grad():
        for i in range(switches):
            recipe = (RECIPE_B, RECIPE_A)[i % 2]
            t0 = time.perf_counter()
            with te.autocast(recipe=recipe):
                model.forward(x)
            totals.append(time.perf_counter() - t0)
            for name, secs in model.fusion_stats().last_build_phases.items():
                phases.setdefault(name, []).append(secs)
    result = {name: statistics.median(v) * 1e6 for name, v in phases.items()}
    result["total"] = statistics.median(totals) * 1e6
    result["key"] = max(result["total"] - sum(result[n] for n in phases), 0.0)
    return result


def weight_requant(model, device, weights=None) -> dict:
    """Quantize every weight as a switch to RECIPE_A does, vs copying the same bytes."""
    if weights is None:
        weights = [op.weight for op in model.modules() if isinstance(op, te.ops.BasicLinear)]
    quantizers = [te.quantization.quantizer_for(RECIPE_A, te.quantization.QuantizerRole("linear", "weight"))
                  for _ in weights]

    def requant():
        for q, w in zip(quantizers, weights):
            q(w, rowwise=True, columnwise=True)

    moved = sum(w.numel() * (w.element_size() + 2) for w in weights)  # read hp, write row + column FP8
    if device.type == "cuda":
        ms = harness.time_ms(requant)
        ceiling = harness.copy_ceiling_tbs()
    else:
        ms = per_call_us(requant, 3, 3) / 1e3
        src = torch.empty(moved // 2, dtype=torch.uint8)
        dst = torch.empty_like(src)
        ceiling = 2 * src.numel() / (per_call_us(lambda: dst.copy_(src), 3, 3) * 1e-6) / 1e12
    floor_ms = moved / (ceiling * 1e12) * 1e3
    # Current scaling cannot cast before it knows the amax: it reads each weight twice.
    two_pass_ms = (moved + sum(w.numel() * w.element_size() for w in weights)) / (ceiling * 1e12) * 1e3
    return {"ms": ms, "floor_ms": floor_ms, "ratio": ms / floor_ms, "bytes": moved,
            "two_pass_floor_ms": two_pass_ms, "ratio_two_pass": ms / two_pass_ms}


def first_step_cost(model, x, recipe, steady_recipe) -> float:
    """First training step under ``recipe`` minus a steady step under it, in ms."""
    def step(r):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with te.autocast(recipe=r):
            y = model(x)
        y.float().sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step(steady_recipe)
    first = step(recipe)
    steady = statistics.median(step(recipe) for _ in range(3))
    return max(first - steady, 0.0) * 1e3


def cold_and_warmed_switch(n_ops, hidden, device) -> dict:
    x = torch.randn(256, hidden, device=device)
    cold_recipe = te.recipe.Float8BlockScaling()
    model = make_model(n_ops, hidden, device)
    cold = first_step_cost(model, x, cold_recipe, RECIPE_A)
    model = make_model(n_ops, hidden, device)
    warm_recipe = te.recipe.MXFP8BlockScaling()
    te.warmup(model, [warm_recipe], x)
    warmed = first_step_cost(model, x, warm_recipe, RECIPE_A)
    return {"cold_ms": cold, "after_warmup_ms": warmed}


def plot(results: dict, path: Path, device) -> list[str]:
    """Two SVG charts: the hot path (µs per call) and the warm switch's phases (µs),
    against the op counts measured; ``path`` and ``path``-switch."""
    from te_fuser.plot import line_chart

    counts = sorted(results)
    env = harness.environment()
    subtitle = (f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}; "
                f"measured at {', '.join(map(str, counts))} ops")
    hot = {label: (counts, [results[n][key] for n in counts])
           for label, key in (("same recipe object", "hot_same"), ("new equal recipe", "hot_equal"))}
    written = line_chart(path, hot, title="te_fuser unchanged-recipe hot path, µs per Sequential call",
                         subtitle=subtitle, xlabel="ops in the Sequential", ylabel="µs per call")
    phases = {phase: (counts, [results[n]["switch"][phase] for n in counts])
              for phase in ("key", "quantizers", "fusion", "validation", "publish", "total")}
    written += line_chart(path.with_name(path.stem + "-switch" + path.suffix), phases,
                          title="te_fuser warm recipe switch by phase, µs", subtitle=subtitle,
                          xlabel="ops in the Sequential", ylabel="µs")
    return written


APPLY_COUNTS = (1, 4, 16)


def apply_cost(n_seq: int, hidden: int, device, rounds: int) -> dict:
    """``te.apply_recipe`` on a model of ``n_seq`` Sequentials (8 ops each), warm:
    switching A <-> B model-wide from the last call's shapes and with an example
    probe, against ``n_seq`` warm switches of one Sequential; and the hot path of
    one applied Sequential called with no te.autocast (its own recipe)."""
    model = torch.nn.Sequential(*[make_model(8, hidden, device) for _ in range(n_seq)])
    x = torch.randn(64, hidden, device=device)
    with torch.no_grad():
        for r in (RECIPE_A, RECIPE_B):
            te.apply_recipe(model, r, example_inputs=x)
            model(x)
    one = warm_switch(make_model(8, hidden, device), x, 2 * rounds)["total"]
    times = {"from the last call": [], "example probe": []}
    with torch.no_grad():
        for i in range(rounds):
            for name, kwargs in (("from the last call", {}), ("example probe", {"example_inputs": x})):
                recipe = (RECIPE_B, RECIPE_A)[i % 2]
                t0 = time.perf_counter()
                te.apply_recipe(model, recipe, **kwargs)
                times[name].append(time.perf_counter() - t0)
        first = model[0]
        with plans_not_executed(first):
            hot = per_call_us(lambda: first.forward(x), 3000, 5)
    out = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    out.update({"warm_switches_us": one * n_seq, "hot_path_us_per_sequential": hot})
    return out


def apply_only(device, hidden: int, args) -> dict:
    rows, summary = [], {}
    print(f"te.apply_recipe, model-wide, on {device} (torch {torch.__version__})")
    print(f"{'Sequentials':>11} {'apply µs':>9} {'with probe µs':>14} {'N warm switches µs':>19} {'hot µs/seq':>11}")
    for n in APPLY_COUNTS:
        r = apply_cost(n, hidden, device, 5 if args.quick else 21)
        summary[n] = r
        print(f"{n:>11} {r['from the last call']:>9.0f} {r['example probe']:>14.0f} "
              f"{r['warm_switches_us']:>19.0f} {r['hot_path_us_per_sequential']:>11.2f}")
        shape = f"{n} Sequentials x 8 ops, h={hidden}"
        rows += [harness.Row("refusion", "apply_recipe, model-wide", "shapes from the last call", shape,
                             r["from the last call"] / 1e3, 0.0, "us", note=f"{n} warm switches: "
                             f"{r['warm_switches_us']:.0f} us"),
                 harness.Row("refusion", "apply_recipe, model-wide", "example probe", shape,
                             r["example probe"] / 1e3, 0.0, "us"),
                 harness.Row("refusion", "hot path, applied recipe (no te.autocast)", "-", shape,
                             r["hot_path_us_per_sequential"] / 1e3, 0.0, "us/call")]
    if not args.no_csv:
        harness.append_csv(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


def hot_only(device, hidden: int, args) -> dict:
    path = "compiled guard" if hot_guard.unavailable_reason() is None else "Python guard"
    summary = {"device": str(device), "path": path, "hot_path_us_same_object": {}, "hot_path_us_equal_object": {}}
    rows = []
    print(f"te_fuser hot path on {device}, {path} (torch {torch.__version__})")
    print(f"{'ops':>5} {'same µs':>8} {'equal µs':>9} {'autocast µs':>12}")
    for n in OP_COUNTS:
        hot = hot_path(make_model(n, hidden, device), torch.randn(64, hidden, device=device), 3000, 15)
        summary["hot_path_us_same_object"][n] = hot["same"]
        summary["hot_path_us_equal_object"][n] = hot["equal"]
        print(f"{n:>5} {hot['same']:>8.2f} {hot['equal']:>9.2f} {hot['autocast_enter_exit']:>12.2f}")
        shape = f"{n} ops, h={hidden}"
        rows += [harness.Row("refusion", "hot path, same object", path, shape, hot["same"] / 1e3, 0.0, "us/call",
                             note="best of 15 x 3000 calls"),
                 harness.Row("refusion", "hot path, new equal object", path, shape, hot["equal"] / 1e3, 0.0,
                             "us/call", note="best of 15 x 3000 calls")]
    if not args.no_csv:
        harness.append_csv(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (CPU: well under 30 s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="SVG", help="draw the hot path and the warm switch here (and PATH-switch.svg)")
    p.add_argument("--no-csv", action="store_true")
    p.add_argument("--mlp-weights", action="store_true",
                   help="also time the re-quantization of the MLP block's weights (4096x28672, 14336x4096; GPU)")
    p.add_argument("--apply-only", action="store_true",
                   help="only te.apply_recipe's model-wide switch against the warm switches it replaces")
    p.add_argument("--hot-only", action="store_true",
                   help="only the hot path, best of 15 rounds of 3000 calls (a noisy host needs many rounds)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    hidden = args.hidden or (1024 if device.type == "cuda" else 64)
    if args.hot_only:
        return hot_only(device, hidden, args)
    if args.apply_only:
        return apply_only(device, hidden, args)
    calls, repeats, switches = (300, 3, 20) if args.quick else (3000, 5, 100)
    results, rows = {}, []
    for n in OP_COUNTS:
        x = torch.randn(64, hidden, device=device)
        hot = hot_path(make_model(n, hidden, device), x, calls, repeats)
        switch = warm_switch(make_model(n, hidden, device), x, switches)
        requant = weight_requant(make_model(n, hidden, device), device)
        results[n] = {"hot_same": hot["same"], "hot_equal": hot["equal"], "switch": switch, "requant": requant,
                      "autocast_enter_exit_us": hot["autocast_enter_exit"]}
        if n == 8 and device.type == "cuda":  # compiled kernels are shared process-wide: measure once
            results[n].update(cold_and_warmed_switch(n, hidden, device))
        shape = f"{n} ops, h={hidden}"
        rows += [
            harness.Row("refusion", "hot path, same object", "-", shape, hot["same"] / 1e3, 0.0, "us/call",
                        note="Sequential.forward decision; autocast enter/exit subtracted"),
            harness.Row("refusion", "hot path, new equal object", "-", shape, hot["equal"] / 1e3, 0.0, "us/call"),
            harness.Row("refusion", "warm switch", "-", shape, switch["total"] / 1e3, 0.0, "us",
                        extra={k: round(v, 2) for k, v in switch.items()}),
            harness.Row("refusion", "weight re-quantization", "-", shape, requant["ms"], 0.0, "ms",
                        of_ceiling=1 / requant["ratio"], note=f"floor {requant['floor_ms']:.4f} ms"),
        ]
        if "cold_ms" in results[n]:
            rows += [harness.Row("refusion", "cold switch (first step - steady)", "-", shape, results[n]["cold_ms"],
                                 0.0, "ms"),
                     harness.Row("refusion", "switch after te.warmup", "-", shape, results[n]["after_warmup_ms"],
                                 0.0, "ms")]
    mlp_requant = None
    if args.mlp_weights:
        weights = [torch.randn(2 * 14336, 4096, device=device, dtype=torch.bfloat16),
                   torch.randn(4096, 14336, device=device, dtype=torch.bfloat16)]
        mlp = weight_requant(None, device, weights)
        mlp_requant = mlp
        rows.append(harness.Row("refusion", "weight re-quantization, MLP block weights", "-",
                                "4096x28672 + 14336x4096 bf16", mlp["ms"], 0.0, "ms", of_ceiling=1 / mlp["ratio"],
                                note=f"floor {mlp['floor_ms']:.4f} ms"))
        print(f"MLP weights re-quantization: {mlp['ms']:.3f} ms, {mlp['ratio']:.2f}x the one-pass floor, "
              f"{mlp['ratio_two_pass']:.2f}x the two-pass floor of current scaling")
    print(f"te_fuser re-fusion cost on {device} (torch {torch.__version__})")
    print(f"{'ops':>5} {'hot same µs':>11} {'hot equal µs':>12} {'switch µs':>10} "
          f"{'key/quant/fuse/valid/publish µs':>34} {'requant x floor':>15} {'cold ms':>8} {'warmed ms':>9}")
    for n in OP_COUNTS:
        r = results[n]
        s = r["switch"]
        split = "/".join(f"{s[k]:.0f}" for k in ("key", "quantizers", "fusion", "validation", "publish"))
        print(f"{n:>5} {r['hot_same']:>11.2f} {r['hot_equal']:>12.2f} {s['total']:>10.1f} {split:>34} "
              f"{r['requant']['ratio']:>15.2f} {r.get('cold_ms', float('nan')):>8.2f} "
              f"{r.get('after_warmup_ms', float('nan')):>9.2f}")
    if not args.no_csv:
        harness.append_csv(rows)
    if args.plot:
        print("plots: " + ", ".join(plot(results, Path(args.plot), device)))
    summary = {
        "device": str(device),
        "hot_path_us_same_object": {n: results[n]["hot_same"] for n in OP_COUNTS},
        "hot_path_us_equal_object": {n: results[n]["hot_equal"] for n in OP_COUNTS},
        "warm_switch_us": {n: results[n]["switch"]["total"] for n in OP_COUNTS},
        "warm_switch_phases_us": {n: results[n]["switch"] for n in OP_COUNTS},
        "weight_requant": {n: results[n]["requant"] for n in OP_COUNTS},
        "cold_switch_ms": {n: results[n].get("cold_ms") for n in OP_COUNTS},
        "switch_after_warmup_ms": {n: results[n].get("after_warmup_ms") for n in OP_COUNTS},
        "mlp_weights_requant": mlp_requant,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    if "--cold-cache" in sys.argv:  # a fresh Triton cache, so that a "cold" switch really compiles
        sys.argv.remove("--cold-cache")
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="te_fuser_triton_cache_")
    main()
