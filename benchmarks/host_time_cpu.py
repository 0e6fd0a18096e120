"""Host time per training step at tiny shapes on the CPU: the te arms beside plain torch.

    python benchmarks/host_time_cpu.py [--models linear gpt] [--stub-kernels] [--dtype bf16|fp32]
                                       [--steps 30] [--repeats 7] [--profile gpt:current] [--top 25]

At these shapes the kernels cost microseconds, so a step's time is what the
layers above them cost: ``Sequential.forward``, the fuser's guard and plan, the
``autograd.Function`` of each fused group, the ops' forward and backward bodies,
the quantizers' and weight caches' bookkeeping and the backend's dispatch. Those
layers are the same on a GPU, where they decide the step time of a host-bound
model. Two models, in plain torch and in te_fuser with no recipe ("bf16"),
current scaling and delayed scaling:

- ``linear``: one Linear (64 -> 256, 32 tokens, fp32 weights), forward + backward;
- ``gpt``: the yardstick GPT (``te_fuser.models.gpt``, 8 layers, SDPA attention
  between the fused groups, as ``profile_gpt.py``) at d 64, seq 32, batch 1,
  forward + backward + a fused AdamW step.

Each forward runs under ``torch.autocast(cpu, bfloat16)``, as the GPU runs do, or
with ``--dtype fp32`` without it. Rows: ms (µs for the Linear) per step, the
process's CPU time (``time.process_time``: other work on a shared machine does
not count), best of ``--repeats`` rounds of ``--steps`` steps with the arms taking
turns, and the ratio to torch.

What costs the CPU only: the FP8 kernels run on the reference backend (casts and
GEMMs as several torch ops each, where a GPU launches one kernel), and a bf16
GEMM costs the CPU tens of microseconds at any size, in every arm alike.
``--stub-kernels`` takes the first out: every kernel the backend resolves becomes
a stand-in that returns fresh empty tensors shaped as the kernel's outputs for
those arguments (one allocation per output, about what a launch costs the host
beside its launcher), so the rows show the layers above the kernels; the numbers
computed are then meaningless. ``--stub-kernels --dtype fp32`` is the layers'
cost alone. ``--update-in-call`` gives the tensor-scaled casts' stand-ins the cuda
backend's ``with_update`` entry, so delayed scaling's casts take the path they take
on a GPU (the cast and the state update in one call) rather than the CPU backends'
deferred update. On a busy machine the times still move by 10-20%; a count of the
instructions per step (e.g. under ``valgrind --tool=callgrind``, instrumentation
switched on after the warm-up steps) does not. ``--profile MODEL:RECIPE`` prints
that arm's cProfile own time per step, the backward on the calling thread.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from profile_gpt import step_fn  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser import backend  # noqa: E402
from te_fuser.kernels.operand import ScaledOperand  # noqa: E402
from te_fuser.quantization.delayed import _generic_tensorwise  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT, copy_weights  # noqa: E402

RECIPES = {"bf16": None, "current": te.recipe.Float8CurrentScaling(), "delayed": te.recipe.DelayedScaling()}
GPT_CONFIG = GPTConfig(n_layer=8, d_model=64, n_head=4, d_ffn=256, seq_len=32, batch_size=1, attention="sdpa")


AUTOCAST = {"bf16": True}  # --dtype: torch.autocast(cpu, bfloat16) around each forward, or fp32 throughout


def linear_step(recipe, te_arm: bool):
    torch.manual_seed(0)
    mod = (te.ops.Sequential(te.ops.Linear(64, 256)) if te_arm else torch.nn.Linear(64, 256))
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 256, dtype=torch.bfloat16 if AUTOCAST["bf16"] else torch.float32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST["bf16"]), \
                te.autocast(enabled=recipe is not None, recipe=recipe):
            y = mod(x)
        y.backward(dy)

    return step


def gpt_step(recipe, te_arm: bool):
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    if not te_arm:
        twin = TorchGPT(GPT_CONFIG)
        copy_weights(model, twin)
        model = twin
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the GPU run (CPU has a fused AdamW too)
    batch = torch.randint(0, 256, (GPT_CONFIG.batch_size, GPT_CONFIG.seq_len + 1))
    return step_fn(model, opt, recipe, batch, "cpu", AUTOCAST["bf16"])


MODELS = {"linear": linear_step, "gpt": gpt_step}


def _signature(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, ScaledOperand):
        return ("operand", _signature(value.data), _signature(value.scale_inv), value.scaling)
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    return type(value).__name__


def _fresh(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, ScaledOperand):
        return ScaledOperand(torch.empty_like(value.data), torch.empty_like(value.scale_inv), value.scaling)
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


def _update_in_call(kernel, sums: bool):
    """A ``prepare`` entry for the stand-in of a tensor-scaled cast whose prepared cast
    also has ``with_update`` (the cuda backend's signature: the cast and delayed
    scaling's state update in one call), returning fresh outputs of its shapes: so
    delayed scaling's casts take the path they take on a GPU."""
    def prepare(fp8_dtype):
        cast = _generic_tensorwise(kernel, fp8_dtype)  # the cast alone, as for a kernel without a prepare entry

        def with_update(x, scale, history, count, margin, algo_max, rowwise, columnwise, round_bf16=False,
                        sums_dtype=torch.float32):
            rows, cols = x.numel() // x.shape[-1], x.shape[-1]
            return (torch.empty(rows, cols, dtype=fp8_dtype) if rowwise else None,
                    torch.empty(cols, rows, dtype=fp8_dtype) if columnwise else None,
                    torch.empty(cols, dtype=sums_dtype) if sums else None, torch.empty(1),
                    torch.empty_like(history), torch.empty_like(scale), torch.empty_like(scale), torch.empty_like(count))

        cast.with_update = with_update
        return cast

    return prepare


def stub_kernels(update_in_call: bool = False) -> None:
    """Make every kernel ``backend.resolve`` hands out a stand-in (see ``--stub-kernels``;
    ``update_in_call``: see ``--update-in-call``)."""
    real_resolve, stubs = backend.resolve, {}

    def stub(choice):
        seen, fn = {}, choice.fn

        def kernel(*args, **kwargs):
            key = (_signature(args), _signature(tuple(sorted(kwargs.items()))))
            out = seen.get(key)
            if out is None:
                out = seen[key] = fn(*args, **kwargs)
            return _fresh(out)

        if update_in_call and choice.kernel in ("quantize_tensorwise", "quantize_tensorwise_column_sums"):
            kernel.prepare = _update_in_call(kernel, choice.kernel.endswith("sums"))
        return backend.KernelChoice(choice.kernel, choice.backend, kernel, choice.note)

    def resolve(kernel, device, backend=None):
        choice = real_resolve(kernel, device, backend)  # kept by the backend: its id stands for it
        hit = stubs.get(id(choice))
        if hit is None:
            hit = stubs[id(choice)] = (stub(choice), choice)
        return hit[0]

    backend.resolve = resolve


def best_ms(steps: dict, n: int, repeats: int) -> dict:
    """Per arm, the best of ``repeats`` loops of ``n`` steps (ms per step, CPU time);
    the arms take turns in every round, so a drift of the machine's speed touches all."""
    for step in steps.values():
        for _ in range(5):
            step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for label, step in steps.items():
            t0 = time.process_time()  # CPU time: a shared machine's other work does not count
            for _ in range(n):
                step()
            best[label] = min(best[label], time.process_time() - t0)
    return {label: t / n * 1e3 for label, t in best.items()}


def profile(step, steps: int, top: int) -> None:
    torch.autograd.set_multithreading_enabled(False)
    try:
        step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    harness.print_own_times(prof, steps, top)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", nargs="*", default=[], help="arms to profile, as MODEL:RECIPE (e.g. gpt:current)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: each forward under torch.autocast(cpu, bfloat16), as the GPU runs; fp32: no autocast "
                        "(the CPU's bf16 GEMMs cost tens of microseconds at any size, which hides the host layers)")
    p.add_argument("--stub-kernels", action="store_true",
                   help="the backend's kernels as stand-ins that only allocate their outputs (the layers above alone)")
    p.add_argument("--update-in-call", action="store_true",
                   help="with --stub-kernels: the tensor-scaled casts' stand-ins also update delayed scaling's state "
                        "in the call, as the cuda backend's do, so its casts take their GPU path")
    args = p.parse_args(argv)
    if args.update_in_call and not args.stub_kernels:
        p.error("--update-in-call: only with --stub-kernels")
    if args.stub_kernels:
        stub_kernels(args.update_in_call)
    AUTOCAST["bf16"] = args.dtype == "bf16"
    torch.set_num_threads(1)  # the host's own time, without intra-op threads taking turns
    print(f"torch {torch.__version__}, backend {te.get_backend()}{' (stubbed kernels)' if args.stub_kernels else ''}, "
          f"{args.dtype}, CPU, 1 thread; best of {args.repeats} x {args.steps} steps")
    for model in args.models:
        unit, scale, n = ("us", 1e3, 10 * args.steps) if model == "linear" else ("ms", 1.0, args.steps)
        arms = {"torch": MODELS[model](None, False)}
        arms.update({f"te {name}": MODELS[model](RECIPES[name], True) for name in args.recipes})
        times = best_ms(arms, n, args.repeats)
        for label, t in times.items():
            print(f"{model:<7} {label:<12} {t * scale:9.2f} {unit}/step {t / times['torch']:6.2f}x")
        for name in args.recipes:
            if f"{model}:{name}" in args.profile:
                print(f"{model} te {name}:")
                profile(arms[f"te {name}"], args.steps, args.top)

if __name__ == "__main__":
    main()
