"""Host (Python) time of one fwd+bwd step of small te_fuser models.

For a Linear and a 4-op MLP (RMSNorm, BasicLinear, GELU or SwiGLU, BasicLinear)
under current and delayed scaling, prints the host microseconds per fwd+bwd step
(time.perf_counter, no synchronisation inside the timed loop) and, from a
cProfile run, the share of that time spent in te_fuser's own Python (functions
defined in ``te_fuser/``, split into the ops and quantizers and the kernel
launchers) as opposed to torch ops and the rest. Runs on CPU (reference
kernels on tiny tensors) and on a GPU (the auto backend), where a bf16 eager
step of the same model is timed as the peer.

    python benchmarks/host_overhead.py [--device cpu|cuda] [--hidden 64] [--tokens 32] [--steps 300]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

import te_fuser as te

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"current": te.recipe.Float8CurrentScaling, "delayed": lambda: te.recipe.DelayedScaling(amax_history_len=16)}
MODELS = ("linear", "mlp_gelu", "mlp_swiglu")


def build(model: str, hidden: int, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(te_fuser model, the same model in plain bf16 torch)."""
    ffn = 2 * hidden
    if model == "linear":
        ours = te.ops.Sequential(te.ops.Linear(hidden, hidden))
        peer = torch.nn.Linear(hidden, hidden)
    elif model == "mlp_gelu":
        ours = te.ops.Sequential(te.ops.RMSNorm(hidden), te.ops.BasicLinear(hidden, ffn), te.ops.GELU(),
                                 te.ops.BasicLinear(ffn, hidden))
        peer = torch.nn.Sequential(torch.nn.RMSNorm(hidden), torch.nn.Linear(hidden, ffn, bias=False),
                                   torch.nn.GELU(approximate="tanh"), torch.nn.Linear(ffn, hidden, bias=False))
    elif model == "mlp_swiglu":
        ours = te.ops.Sequential(te.ops.RMSNorm(hidden), te.ops.BasicLinear(hidden, 2 * ffn), te.ops.SwiGLU(),
                                 te.ops.BasicLinear(ffn, hidden))
        peer = None
    else:
        raise ValueError(f"--models: unknown model {model!r}; choose from {list(MODELS)}")
    ours = ours.to(device, dtype)
    return ours, (peer.to(device, dtype) if peer is not None else None)


def _timed_us(step, steps: int, device: str, repeats: int = 5) -> float:
    """Best of ``repeats`` timed loops of host microseconds per step."""
    for _ in range(20):
        step()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - t0)  # host time: the GPU may still be running
    if device == "cuda":
        torch.cuda.synchronize()
    return best / steps * 1e6


def _where(filename: str) -> str:
    """Which part of the code base a profiled function lives in."""
    path = Path(filename).resolve()
    if ROOT / "te_fuser" in path.parents:
        return "ours"
    if ROOT / "kernels" / "reference" in path.parents or ROOT / "kernels" / "triton" in path.parents:
        return "kernel_bodies"  # torch reference kernels and Triton (interpreted on CPU)
    if ROOT / "kernels" in path.parents:
        return "launchers"  # operand checks and the CUDA launchers
    return "other"


def _own_python_us(step, steps: int) -> dict[str, float]:
    """cProfile own time per step, split by where the Python lives."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = {"ours": 0.0, "launchers": 0.0, "kernel_bodies": 0.0, "other": 0.0}
    for (filename, _line, _name), (_cc, _nc, tottime, _cum, _callers) in pstats.Stats(prof).stats.items():
        out[_where(filename)] += tottime
    out["total"] = sum(out.values())
    return {k: v / steps * 1e6 for k, v in out.items()}


def measure(model: str, recipe_name: str, args) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    ours, peer = build(model, args.hidden, args.device, dtype)
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype)
    recipe = RECIPES[recipe_name]()

    def step():
        with te.autocast(recipe=recipe):
            y = ours(x)
        y.backward(dy)

    row = {"model": model, "recipe": recipe_name, "us_per_step": _timed_us(step, args.steps, args.device)}
    row["peer_bf16_us_per_step"] = _timed_us(lambda: peer(x).backward(dy), args.steps, args.device) if peer else None
    profile = _own_python_us(step, args.steps)
    row.update({f"profiled_{k}_us": v for k, v in profile.items()})
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: 1024 on cuda, 64 on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="rows of x (default: 1024 on cuda, 32 on cpu)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    big = args.device == "cuda"
    args.hidden = args.hidden or (1024 if big else 64)
    args.tokens = args.tokens or (1024 if big else 32)
    print(f"device={args.device} backend={te.get_backend()} hidden={args.hidden} tokens={args.tokens} "
          f"steps={args.steps} torch={torch.__version__}")
    print(f"{'model':<11} {'recipe':<8} {'us/step':>9} {'bf16 us':>9} {'ours py':>9} {'launch py':>9} "
          f"{'profiled':>9}")
    rows = []
    for model in args.models:
        for recipe_name in args.recipes:
            r = measure(model, recipe_name, args)
            rows.append(r)
            peer = f"{r['peer_bf16_us_per_step']:9.1f}" if r["peer_bf16_us_per_step"] is not None else f"{'-':>9}"
            print(f"{model:<11} {recipe_name:<8} {r['us_per_step']:9.1f} {peer} {r['profiled_ours_us']:9.1f} "
                  f"{r['profiled_launchers_us']:9.1f} {r['profiled_total_us']:9.1f}")
    print("us/step: host time per fwd+bwd step (best of 5 loops); ours py: cProfile own time per step in "
          "te_fuser/; launch py: in kernels/ but the reference and Triton kernel bodies; profiled: the "
          "whole step under cProfile (its overhead included)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
