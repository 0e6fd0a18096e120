"""The yardstick GPT's eager step with its FP8 GEMMs planned under cuBLASLt's full
workspace and under none (``kernels.cuda.gemm.set_workspace_limit``), in one
process, the two taking turns (GPU only).

    python benchmarks/gemm_workspace_ab.py [--recipes current delayed] [--rounds 5] [--steps 20] [--tiny]

Whether the GPT's memsets (about 65 a step, one before each fprop and dgrad GEMM)
go with algorithms that ask for no workspace: with a limit of 0 the heuristic picks
among those (run 166: they do not go, and the GEMMs ran 1.5% slower). Each round times
``--steps`` steps back to back under each limit (``harness.interleaved_ms``; each step
sets its limit first, one binding call), after a step under each limit is traced for
its launches, memsets and GEMM kernel time. ``--tiny``: the GPT at width 128 (the GPU
has almost nothing to do: the host's cost per step). The algorithms differ, so the
two limits' losses may differ in their last bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved_ms  # noqa: E402
from profile_gpt import RECIPES, host_only, step_fn, text_batch  # noqa: E402

from te_fuser.kernels.cuda.gemm import WORKSPACE_BYTES, set_workspace_limit  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig  # noqa: E402

LIMITS = (WORKSPACE_BYTES, 0)


def traced(step) -> tuple[int, int, float]:
    """(kernels, memsets, GEMM kernel ms) of one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = memsets = 0
    gemm_us = 0.0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if ev.name.startswith("Memset"):
            memsets += 1
        elif not ev.name.startswith("Memcpy"):
            kernels += 1
            if "gemm" in ev.name.lower() or "nvjet" in ev.name or "sm90_xmma" in ev.name:
                gemm_us += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return kernels, memsets, gemm_us / 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=["current", "delayed"], choices=[r for r in RECIPES if r != "bf16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="width 128: the host's cost per step")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_workspace_ab needs a GPU")
        return
    config = GPTConfig.gpu()
    if args.tiny:
        config = host_only(config)
    batch = text_batch(config)
    rows = []
    for name in args.recipes:
        torch.manual_seed(0)
        model = GPT(config, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = step_fn(model, opt, RECIPES[name], batch, clip=1.0)

        def under(limit: int):
            def run():
                set_workspace_limit(limit)  # the GEMMs a step plans and finds are this limit's
                step()
            return run

        arms = {limit: under(limit) for limit in LIMITS}
        counts = {}
        for limit, run in arms.items():
            run()
            run()  # the GEMMs planned under this limit
            counts[limit] = traced(run)
        ms = interleaved_ms(arms, args.rounds, args.steps, torch.cuda.synchronize)
        set_workspace_limit(WORKSPACE_BYTES)
        for limit in LIMITS:
            rows.append((name, limit, ms[limit], ms[limit] / ms[WORKSPACE_BYTES], *counts[limit]))
    size = "tiny (width 128)" if args.tiny else "gpu"
    print(f"GPT {size}, {args.rounds} rounds of {args.steps} steps a limit, the limits taking turns; ms a step")
    print(f"{'recipe':<9} {'workspace':>10} {'median ms':>10} {'vs full':>8} {'kernels':>8} {'memsets':>8} "
          f"{'GEMM ms':>8}")
    for name, limit, ms, ratio, kernels, memsets, gemm_ms in rows:
        print(f"{name:<9} {limit:>10d} {ms:10.2f} {ratio:8.3f} {kernels:8d} {memsets:8d} {gemm_ms:8.2f}")


if __name__ == "__main__":
    main()
