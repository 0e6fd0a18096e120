"""Where the host's training step goes, without a profiler: the GPT at width 128
(the GPU has almost nothing to do), its step timed whole and split by timers
around the calls into compiled code.

    python benchmarks/host_split.py [--recipes bf16 delayed current] [--rounds 7] [--steps 10] [--full-size]

cProfile charges every Python call a fixed cost, so it inflates a step of many
small calls and hides what the calls into C++ cost beside them. Here each
binding of the CUDA extension and each Triton launch (``kernels.triton._launch.launch``)
is wrapped in a timer (about half a microsecond a call), installed before the
first step so the prepared casts bind the wrapped entries. Per arm, medians over
``--rounds`` rounds of ``--steps`` steps, the arms taking turns: the step (ms),
the time inside the CUDA bindings and inside the Triton launches (ms a step,
calls a step), and the rest: te's and torch's Python, torch's own ops, the
autograd engine and the optimizer. The torch twin runs beside te as the yardstick.
On a machine without a GPU the same rows come from the CPU backends (no
bindings, no launches there).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_gpt import RECIPES, step_fn, text_batch  # noqa: E402

from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT, copy_weights  # noqa: E402

_SPENT: dict = defaultdict(float)  # bucket -> seconds
_CALLS: dict = defaultdict(int)


def _timed(bucket: str, fn):
    clock = time.perf_counter

    def call(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _SPENT[bucket] += clock() - t0
            _CALLS[bucket] += 1

    call.__wrapped__ = fn
    return call


def install_timers() -> list[str]:
    """Wrap the CUDA extension's entries and the Triton launches; the buckets made."""
    buckets = []
    try:
        from te_fuser.kernels import cuda
        from te_fuser.kernels.cuda._build import extension
    except ImportError:  # pragma: no cover - the package always has them
        cuda = None
    if cuda is not None and torch.cuda.is_available() and cuda.unavailable_reason() is None:
        module = extension()
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and not name.startswith("_") and not isinstance(fn, type):
                setattr(module, name, _timed("cuda bindings", fn))
        buckets.append("cuda bindings")
    from te_fuser.kernels import triton as triton_kernels
    from te_fuser.kernels.triton import _launch

    timed_launch = _timed("triton launches", _launch.launch)
    for name in dir(triton_kernels):
        module = getattr(triton_kernels, name)
        if getattr(module, "launch", None) is _launch.launch:
            module.launch = timed_launch
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("te_fuser.kernels.triton.") and \
                getattr(module, "launch", None) is _launch.launch:
            module.launch = timed_launch
    buckets.append("triton launches")
    return buckets


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["bf16", "delayed", "current"], choices=list(RECIPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--full-size", action="store_true", help="the GPT at its GPU size (a step bound by the GPU "
                   "shows the bindings waiting on a full launch queue)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    buckets = install_timers()
    base = GPTConfig.gpu() if cuda else GPTConfig.smoke()
    config = base if args.full_size else dataclasses.replace(base, d_model=128, n_head=2, d_ffn=512, seq_len=64,
                                                              batch_size=2)
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    if cuda:
        batch = text_batch(config)
    else:
        batch = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1))
    te_model = GPT(config, device=device)
    twin = TorchGPT(config, device=device)
    copy_weights(te_model, twin)
    arms = {"torch bf16": (twin, None)}
    arms.update({f"te {name}": (te_model, RECIPES[name]) for name in args.recipes})
    steps = {}
    for label, (model, recipe) in arms.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        steps[label] = step_fn(model, opt, recipe, batch, device_type=device, bf16_autocast=True, clip=args.clip)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = measure(steps, buckets, args.rounds, args.steps, sync)
    print(f"torch {torch.__version__}, {device}, width {config.d_model}, {args.rounds} rounds x {args.steps} steps "
          "(medians, ms a step; the arms take turns)")
    print_rows(rows, buckets)


def measure(steps: dict, buckets: list[str], rounds: int, count: int, sync) -> dict:
    """Per arm (``steps``: label -> a training step), per round its step's ms and
    each bucket's ms and calls a step, the arms taking turns (each warmed first)."""
    for step in steps.values():  # builds, compiles and warms every arm first
        for _ in range(3):
            step()
    rows: dict = {label: defaultdict(list) for label in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            sync()
            _SPENT.clear()
            _CALLS.clear()
            t0 = time.perf_counter()
            for _ in range(count):
                step()
            sync()
            wall = (time.perf_counter() - t0) * 1e3 / count
            row = rows[label]
            row["step"].append(wall)
            inside = 0.0
            for bucket in buckets:
                ms = _SPENT[bucket] * 1e3 / count
                inside += ms
                row[bucket].append(ms)
                row[bucket + " calls"].append(_CALLS[bucket] / count)
            row["rest"].append(wall - inside)
    return rows


def print_rows(rows: dict, buckets: list[str]) -> None:
    """The medians of :func:`measure`'s rows, each arm's step against the first arm's."""
    header = f"{'arm':<22} {'step':>7} " + " ".join(f"{b:>16} {'calls':>6}" for b in buckets) + f" {'rest':>7}"
    print(header)
    first = statistics.median(next(iter(rows.values()))["step"])
    for label, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        cells = " ".join(f"{med[b]:>16.2f} {med[b + ' calls']:>6.0f}" for b in buckets)
        print(f"{label:<22} {med['step']:>7.2f} {cells} {med['rest']:>7.2f}   ({med['step'] / first:.2f}x the first)")

if __name__ == "__main__":
    main()
