"""Layers, fwd+bwd, side by side: bf16 eager, torchao float8 (compiled), te_fuser.

Cases (DESIGN.md section 6):
- Linear 16384 x 8192 -> 7168 (M x K -> N),
- MLP block: RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU, Linear 14336 -> 4096; 8192 tokens,
- a small, CPU-bound Linear 1024 x 1024 -> 1024.

Contenders: bf16 eager (torch.nn), torchao 0.18 float8 tensorwise with
torch.compile (when torchao imports), te_fuser under current, delayed and block
scaling. Each time is the median of a full forward + backward (parameter and
input gradients included, fresh every step). It also times a recipe switch:
torchao must re-convert and recompile (measured: the first step of a freshly
converted and compiled copy, minus a steady step); te_fuser's first step after a switch minus a steady step, with the
kernels warmed by ``te.warmup``. For the small Linear it also times te_fuser
through ``te.make_graphed`` (forward and backward replayed from CUDA graphs) and
what a recipe switch costs there (one eager step plus a capture), and as a
training loop: bf16 eager against te_fuser through ``make_graphed`` and through
``te.make_graphed_step`` (the whole fwd+bwd step as one graph; bf16 the same way
for reference).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import te_fuser as te  # noqa: E402

RECIPES = {
    "current": te.recipe.Float8CurrentScaling(),
    "delayed": te.recipe.DelayedScaling(amax_history_len=16),
    "block": te.recipe.Float8BlockScaling(),
}


class TorchMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.fc1 = nn.Linear(hidden, 2 * ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        gate, up = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return self.fc2(nn.functional.silu(gate) * up)


def torch_model(case: str, dims) -> nn.Module:
    if case == "mlp":
        return TorchMLP(dims["hidden"], dims["ffn"])
    return nn.Linear(dims["k"], dims["n"])


def te_model(case: str, dims) -> te.ops.Sequential:
    if case == "mlp":
        h, f = dims["hidden"], dims["ffn"]
        return te.ops.Sequential(te.ops.RMSNorm(h), te.ops.Linear(h, 2 * f), te.ops.SwiGLU(), te.ops.Linear(f, h))
    return te.ops.Sequential(te.ops.Linear(dims["k"], dims["n"]))


CASES = {
    "linear": dict(m=16384, k=8192, n=7168),
    "mlp": dict(m=8192, hidden=4096, ffn=14336),
    "small": dict(m=1024, k=1024, n=1024),
}


def flops(case: str, d) -> float:
    if case == "mlp":
        return 3 * 2 * d["m"] * (d["hidden"] * 2 * d["ffn"] + d["ffn"] * d["hidden"])
    return 3 * 2 * d["m"] * d["k"] * d["n"]


def in_features(case, d):
    return d["hidden"] if case == "mlp" else d["k"]


def fwd_bwd(model, x, dy, recipe=None):
    """One fwd+bwd step with fresh gradients: the parameters' and the input's (an
    input gradient left in place would add an accumulation kernel to every step of
    every contender: 0.18 ms at the big Linear's 16384x8192 input)."""

    def run():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        if recipe is None:
            y = model(x)
        else:
            with te.autocast(recipe=recipe):
                y = model(x)
        y.backward(dy)

    return run


def torchao_convert(model: nn.Module, recipe_name: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name(recipe_name))
    return torch.compile(converted)


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def bench_case(case: str, rows: list, switch_rows: list) -> None:
    d = CASES[case]
    torch.manual_seed(0)
    base = torch_model(case, d).cuda().bfloat16()
    x = torch.randn(d["m"], in_features(case, d), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    total = flops(case, d)
    shape = " ".join(f"{k}={v}" for k, v in d.items())
    bf16_ms = harness.time_ms(fwd_bwd(base, x, dy))
    rows.append(harness.Row("layers", case, "bf16 eager", shape, bf16_ms, total / bf16_ms / 1e9, "TFLOP/s"))
    # te before torchao: torch.compile leaves its compile workers busy for a while,
    # which slows a host-bound arm timed right after it
    model = te_model(case, d).cuda().bfloat16()
    te.warmup(model, list(RECIPES.values()), x.detach())
    te_rows = []
    for name, recipe in RECIPES.items():
        ms = harness.time_ms(fwd_bwd(model, x, dy, recipe))
        te_rows.append(harness.Row("layers", case, f"te_fuser {name}", shape, ms, total / ms / 1e9, "TFLOP/s",
                                   vs_peer=bf16_ms / ms, peer="bf16 eager"))
    if case != "linear":  # what casting the weights every step costs: the same steps reusing one cast
        for name in ("current", "delayed"):
            with te.reuse_quantized_weights():
                ms = harness.time_ms(fwd_bwd(model, x, dy, RECIPES[name]))
            te_rows.append(harness.Row("layers", case, f"te_fuser {name}, weights cast once", shape, ms,
                                       total / ms / 1e9, "TFLOP/s", vs_peer=bf16_ms / ms, peer="bf16 eager",
                                       note="inside te.reuse_quantized_weights(): a cast reused across steps"))
    ao_ms = None
    try:
        ao = torchao_convert(base, "tensorwise")
        ao_ms = harness.time_ms(fwd_bwd(ao, x, dy))
        rows.append(harness.Row("layers", case, "torchao tensorwise compiled", shape, ao_ms, total / ao_ms / 1e9,
                                "TFLOP/s", vs_peer=bf16_ms / ao_ms, peer="bf16 eager"))
        switch_ms = wall_ms(lambda: fwd_bwd(torchao_convert(base, "rowwise"), x, dy)()) - ao_ms
        switch_rows.append(harness.Row("layers", f"{case}: switch tensorwise->rowwise", "torchao", shape,
                                       switch_ms, 0.0, "ms", note="re-convert + recompile + first step - steady"))
    except Exception as err:  # torchao absent or failing: report and go on
        print(f"torchao unavailable for {case}: {type(err).__name__}: {err}")
    for row in te_rows:
        if ao_ms is not None and not row.note:
            row.note = f"vs torchao {ao_ms / row.ms:.2f}x"
        rows.append(row)
    if case == "linear":
        floor = gemm_floor_ms(d)
        rows.append(harness.Row("layers", case, "floor: its 3 FP8 GEMMs alone (cuBLASLt)", shape, floor,
                                total / floor / 1e9, "TFLOP/s", vs_peer=bf16_ms / floor, peer="bf16 eager",
                                note="no cast, amax or bias gradient"))
    if case == "small":
        bench_graphed(model, x, dy, shape, total, bf16_ms, ao_ms, rows, switch_rows)
        bench_loops(base, model, x, dy, shape, total, rows)
    steady = statistics.median(wall_ms(fwd_bwd(model, x, dy, RECIPES["block"])) for _ in range(3))
    first = wall_ms(fwd_bwd(model, x, dy, RECIPES["current"]))
    steady_current = statistics.median(wall_ms(fwd_bwd(model, x, dy, RECIPES["current"])) for _ in range(3))
    switch_rows.append(harness.Row("layers", f"{case}: switch block->current", "te_fuser", shape,
                                   first - steady_current, 0.0, "ms",
                                   note=f"first step - steady (steady block {steady:.3f} ms)"))


def gemm_floor_ms(d) -> float:
    """The Linear's three FP8 GEMMs alone, through cuBLASLt (``torch._scaled_mm``),
    on operands already quantized in the layouts the layer uses: fprop x·wᵀ
    (E4M3 x E4M3, fast accumulation as the recipes' default), dgrad dy·w and wgrad
    dyᵀ·x (E5M2 x E4M3, exact). No cast, amax or bias gradient: what the layer
    would take if every other kernel were free."""
    m, k, n = d["m"], d["k"], d["n"]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(m, k, device="cuda").to(e4)  # (M, K)
    w = torch.randn(n, k, device="cuda").to(e4)  # (N, K)
    dy = torch.randn(m, n, device="cuda").to(e5)  # (M, N)
    x_t, w_t, dy_t = x.t().contiguous(), w.t().contiguous(), dy.t().contiguous()  # column-wise copies
    one = torch.ones((), device="cuda")

    def gemms():
        torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(dy, w_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(dy_t, x_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return harness.time_ms(gemms)


def bench_graphed(model, x, dy, shape, total, bf16_ms, ao_ms, rows, switch_rows) -> None:
    """te_fuser replayed from CUDA graphs: steady steps, and a switch between recipes."""
    graphed = te.make_graphed(model)
    for name in ("current", "delayed"):
        run = fwd_bwd(graphed, x, dy, RECIPES[name])
        run()  # the first step under a recipe runs eagerly; the second captures
        run()
        ms = harness.time_ms(run)
        rows.append(harness.Row("layers", "small", f"te_fuser {name} graphed", shape, ms, total / ms / 1e9,
                                "TFLOP/s", vs_peer=bf16_ms / ms, peer="bf16 eager",
                                note="" if ao_ms is None else f"vs torchao {ao_ms / ms:.2f}x"))
    steady = statistics.median(wall_ms(fwd_bwd(graphed, x, dy, RECIPES["delayed"])) for _ in range(3))
    run = fwd_bwd(graphed, x, dy, RECIPES["current"])
    switch = wall_ms(run) + wall_ms(run) - 2 * steady  # the eager step, then the capture
    switch_rows.append(harness.Row("layers", "small: switch delayed->current, graphed", "te_fuser", shape,
                                   switch, 0.0, "ms",
                                   note=f"eager step + capture - 2 steady (capture {graphed.stats.capture_seconds * 1e3:.1f} ms)"))


def loop_ms(run, steps: int) -> float:
    """Milliseconds per step of ``steps`` back-to-back steps (host and GPU overlap, as in training)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def graphed_step(model, x, dy, recipe=None):
    """fwd+bwd as one step replayed from a CUDA graph (``te.make_graphed_step``)."""

    def fwd_bwd_step(x, dy):
        model(x).backward(dy)

    step = te.make_graphed_step(fwd_bwd_step, model)

    def run():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            step(x, dy)

    return run


def bench_loops(base, model, x, dy, shape, total, rows, steps: int = 100, rounds: int = 7) -> None:
    """Training-loop throughput of the host-bound small case: bf16 eager, te_fuser
    eager, through ``make_graphed`` and through ``make_graphed_step`` (bf16 too, for
    reference), in interleaved rounds (the host's speed drifts), median."""
    runs = {"bf16 eager": fwd_bwd(base, x, dy), "bf16 graphed step": graphed_step(copy.deepcopy(base), x, dy)}
    for name in ("current", "delayed"):
        runs[f"te_fuser {name} eager"] = fwd_bwd(copy.deepcopy(model), x, dy, RECIPES[name])
        runs[f"te_fuser {name} graphed"] = fwd_bwd(te.make_graphed(copy.deepcopy(model)), x, dy, RECIPES[name])
        runs[f"te_fuser {name} graphed step"] = graphed_step(copy.deepcopy(model), x, dy, RECIPES[name])
    for run in runs.values():
        for _ in range(4):  # eager steps, capture, first replay
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(loop_ms(run, steps))
    bf16 = statistics.median(times["bf16 eager"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append(harness.Row("layers", "small, loop", name, shape, ms, total / ms / 1e9, "TFLOP/s",
                                vs_peer=None if name == "bf16 eager" else bf16 / ms,
                                peer="" if name == "bf16 eager" else "bf16 eager",
                                note=f"{steps} steps x {rounds} rounds, min..max {min(ts):.3f}..{max(ts):.3f} ms"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=list(CASES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layers needs a GPU")
        return
    rows, switch_rows = [], []
    for case in args.cases:
        bench_case(case, rows, switch_rows)
    harness.print_table(rows, "layers fwd+bwd")
    harness.print_table(switch_rows, "recipe switch")
    harness.append_csv(rows + switch_rows)


if __name__ == "__main__":
    main()
