"""What a recipe switch step costs, split by timers: the GPT warmed up under every
recipe of the schedule (``te.warmup``, as ``train_gpt.py`` warms its te arm), then
trained through the schedule; per phase its first step (the switch) and the median
of three steps alone, each between two syncs, and, inside the first step, the time
of the plan builds, of their quantizers, of ``place_states`` (delayed scaling's
states placed on the device) and of delayed scaling's seeding casts, with the
segments the CUDA allocator took from the driver.

    python benchmarks/switch_split.py [--schedule bf16,delayed,current,...] [--steps 6] [--host-only]

A switch into a recipe whose quantizers keep no scaling state (current scaling,
bf16) publishes the plans kept from the warm-up: its builds make no quantizers.
The target (DESIGN.md §6) is a switch step within 1.05x of a step. Timers cost about
half a microsecond a call (see ``host_split.py``); no profiler runs. On a machine
without a GPU the smoke GPT runs on the CPU backends.
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
from profile_gpt import RECIPES, host_only, step_fn, text_batch  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig  # noqa: E402

BUCKETS = ("builds", "quantizers", "place_states", "seeding casts")


def install_timers() -> None:
    """Timers around the plan builds, their quantizers, the states' placement and the
    seeding casts (the names the fuser and the quantizers call them by)."""
    from te_fuser.ops import fuser
    from te_fuser.quantization import delayed

    fuser.OperationFuser.build = host_split._timed("builds", fuser.OperationFuser.build)
    fuser.OperationFuser._build_quantizers = host_split._timed("quantizers", fuser.OperationFuser._build_quantizers)
    fuser.place_states = host_split._timed("place_states", fuser.place_states)
    delayed.DelayedScalingQuantizer._seeding_cast = host_split._timed(
        "seeding casts", delayed.DelayedScalingQuantizer._seeding_cast)


def _mallocs(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.type == "cuda" else 0


def timed_step(step, device: torch.device) -> tuple[float, int, dict]:
    """``(ms, cudaMallocs, {bucket: (ms, calls)})`` of one step between two syncs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    before = _mallocs(device)
    host_split._SPENT.clear()
    host_split._CALLS.clear()
    t0 = time.perf_counter()
    step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    buckets = {b: (host_split._SPENT[b] * 1e3, host_split._CALLS[b]) for b in BUCKETS if host_split._CALLS[b]}
    return ms, _mallocs(device) - before, buckets


def run(schedule: list[str], steps: int, host: bool = False) -> list[dict]:
    """The schedule's phases, each ``steps`` steps long: a record per phase."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = GPTConfig.gpu() if cuda else GPTConfig.smoke()
    if host:
        config = host_only(config)
    torch.manual_seed(0)
    batch = (text_batch(config) if cuda
             else torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1)))
    model = GPT(config, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    recipes = list(dict.fromkeys(schedule))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        te.warmup(model, [RECIPES[name] for name in recipes], batch[:, :-1])
    install_timers()
    records = []
    for name in schedule:
        step = step_fn(model, opt, RECIPES[name], batch, device_type=device.type, clip=1.0)
        first, mallocs, buckets = timed_step(step, device)
        for _ in range(max(0, steps - 4)):
            step()
        alone = statistics.median(timed_step(step, device)[0] for _ in range(3))
        records.append(dict(phase=name, first_ms=first, alone_ms=alone, mallocs=mallocs, buckets=buckets))
    return records


def print_records(records: list[dict]) -> None:
    print(f"{'phase':<10} {'first ms':>9} {'alone ms':>9} {'ratio':>6} {'mallocs':>7}  " +
          "  ".join(f"{b + ' ms (calls)':>24}" for b in BUCKETS))
    for r in records:
        cells = "  ".join(f"{r['buckets'][b][0]:>16.2f} ({r['buckets'][b][1]:>4})" if b in r["buckets"]
                          else f"{'-':>24}" for b in BUCKETS)
        print(f"{r['phase']:<10} {r['first_ms']:>9.2f} {r['alone_ms']:>9.2f} {r['first_ms'] / r['alone_ms']:>6.2f} "
              f"{r['mallocs']:>7}  {cells}")
    print("(first: the phase's first step, the switch; alone: the median of three steps, each between syncs; "
          "the target is 1.05x at most)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="bf16,delayed,current,bf16,delayed,current,delayed",
                   help="comma-separated recipe names of profile_gpt.RECIPES, a phase each")
    p.add_argument("--steps", type=int, default=6, help="steps a phase (at least 4: the switch and three alone)")
    p.add_argument("--host-only", action="store_true", help="the GPT at width 128 (profile_gpt.host_only): the "
                   "switch's host cost alone (default: the GPU size on a GPU, the smoke size on a CPU)")
    args = p.parse_args(argv)
    schedule = args.schedule.split(",")
    unknown = [name for name in schedule if name not in RECIPES]
    if unknown:
        p.error(f"--schedule: unknown recipe(s) {unknown}; known: {sorted(RECIPES)}")
    if args.steps < 4:
        p.error(f"--steps: at least 4 (the switch and three steps alone), got {args.steps}")
    records = run(schedule, args.steps, args.host_only)
    print(f"torch {torch.__version__}, {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print_records(records)


if __name__ == "__main__":
    main()
