"""Where the GPU time of one fwd+bwd step goes, kernel by kernel (GPU only).

For a case of bench_layers.py (default: the MLP block) it profiles a few steps of
bf16 eager, torchao float8 tensorwise compiled (when torchao imports) and
te_fuser under a recipe, and prints, for each, the GPU time per step and the
kernels that take most of it, so the gap to a peer can be read off by kernel.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_layers as bl  # noqa: E402

import te_fuser as te  # noqa: E402


def kernel_times(step, steps: int) -> dict[str, float]:
    """Microseconds of GPU time per step, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name] += evt.device_time / steps
    return dict(times)


def report(name: str, times: dict[str, float], top: int) -> None:
    total = sum(times.values())
    print(f"\n== {name}: {total:.0f} us of GPU time per step")
    for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} us {100 * us / total:5.1f}%  {kernel[:110]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="mlp", choices=list(bl.CASES))
    p.add_argument("--recipe", default="current", choices=list(bl.RECIPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--graphed", action="store_true", help="run te_fuser through te.make_graphed")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels needs a GPU")
        return
    d = bl.CASES[args.case]
    torch.manual_seed(0)
    base = bl.torch_model(args.case, d).cuda().bfloat16()
    x = torch.randn(d["m"], bl.in_features(args.case, d), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    report("bf16 eager", kernel_times(bl.fwd_bwd(base, x, dy), args.steps), args.top)
    try:
        ao = bl.torchao_convert(base, "tensorwise")
        report("torchao tensorwise compiled", kernel_times(bl.fwd_bwd(ao, x, dy), args.steps), args.top)
    except Exception as err:  # torchao absent or failing: report and go on
        print(f"torchao unavailable: {type(err).__name__}: {err}")
    model = bl.te_model(args.case, d).cuda().bfloat16()
    if args.graphed:
        model = te.make_graphed(model)
    recipe = bl.RECIPES[args.recipe]
    report(f"te_fuser {args.recipe}" + (" graphed" if args.graphed else ""), kernel_times(bl.fwd_bwd(model, x, dy, recipe), args.steps), args.top)


if __name__ == "__main__":
    main()
