"""Where the host's training step goes, without a profiler: the GPT at width 128
(the GPU has almost nothing to do), its step timed whole and split by timers
around the calls into compiled code.

    python benchmarks/host_split.py [--recipes bf16 delayed current] [--rounds 7] [--steps 10] [--full-size]

cProfile charges every Python call a fixed cost, so it inflates a step of many
small calls and hides what the calls into C++ cost beside them. Here each
binding of the CUDA extension and each Triton launch (``kernels.triton._launch.launch``)
is wrapped in a timer (about half a microsecond a call), installed before the
first step so the prepared casts bind the wrapped entries. Per arm, medians over
``--rounds`` rounds of ``--steps`` steps, the arms taking turns (the order
reversed every other round): the step (ms),
the time inside the CUDA bindings and inside the Triton launches (ms a step,
calls a step), and the rest: te's and torch's Python, torch's own ops, the
autograd engine and the optimizer. The torch twin runs beside te as the yardstick.
On a machine without a GPU the same rows come from the CPU backends (no
bindings, no launches there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_gpt import RECIPES, host_only, step_fn, text_batch  # noqa: E402

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
    import importlib
    import pkgutil

    buckets = []
    from te_fuser.kernels import cuda
    from te_fuser.kernels.cuda._build import extension

    if torch.cuda.is_available() and cuda.unavailable_reason() is None:
        module = extension()
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and not name.startswith("_") and not isinstance(fn, type):
                setattr(module, name, _timed("cuda bindings", fn))
        buckets.append("cuda bindings")
    from te_fuser.kernels import triton as triton_kernels
    from te_fuser.kernels.triton import _launch

    for info in pkgutil.iter_modules(triton_kernels.__path__):  # every kernel module, before any binds launch
        importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
    _everywhere(_launch.launch, _timed("triton launches", _launch.launch))
    buckets.append("triton launches")
    return buckets


def _everywhere(fn, wrapped) -> None:
    """``wrapped`` in place of ``fn`` in every loaded module that holds it by name."""
    for module in list(sys.modules.values()):
        space = getattr(module, "__dict__", None)
        if not space:
            continue
        for name, value in list(space.items()):
            if value is fn:
                setattr(module, name, wrapped)


def _method(cls, name: str, bucket: str) -> None:
    """``cls.name`` timed into ``bucket`` (a static method stays one)."""
    raw = cls.__dict__[name] if name in cls.__dict__ else getattr(cls, name)  # an inherited one: set on cls
    if isinstance(raw, staticmethod):
        setattr(cls, name, staticmethod(_timed(bucket, raw.__func__)))
    else:
        setattr(cls, name, _timed(bucket, raw))


def install_layer_timers() -> list[str]:
    """Timers around the layers above the kernels (inclusive: a bucket holds what
    it calls, so buckets nest and do not add up to the step): the model's forward,
    the autograd backward, te's fused groups forward and backward (the autograd
    function's) and their plans' steps (``run_forward``, ``run_backward``: what the
    groups spend outside them is the entry's and autograd's), the linear layers'
    forward and backward, their casts, GEMMs and weight copies, the attention core,
    LayerNorm, the rotations, the activation's backward with its bias, the
    optimizer and gradient clipping."""
    from te_fuser.models import gpt
    from te_fuser.ops import fuser, gemm
    from te_fuser.ops.basic import activation, attention, linear, norm, rotary
    from te_fuser.quantization.base import Quantizer

    _method(gpt.GPT, "forward", "model forward")
    _method(gpt.TorchGPT, "forward", "model forward")
    torch.autograd.backward = _timed("autograd backward", torch.autograd.backward)
    torch.nn.utils.clip_grad_norm_ = _timed("clip grad norm", torch.nn.utils.clip_grad_norm_)
    _method(torch.optim.AdamW, "step", "optimizer step")
    _method(fuser._FuserFunction, "forward", "te groups forward")
    _method(fuser._FuserFunction, "backward", "te groups backward")
    _everywhere(fuser.run_forward, _timed("plans' forward", fuser.run_forward))
    _everywhere(fuser.run_backward, _timed("plans' backward", fuser.run_backward))
    _method(norm.LayerNorm, "op_forward", "norm forward")
    _method(norm.LayerNorm, "op_backward_adding", "norm backward")  # op_backward's too
    _method(rotary.RotaryEmbedding, "rotate_fresh", "rotary")
    _everywhere(activation.activation_bias_backward,
                _timed("activation backward", activation.activation_bias_backward))
    _everywhere(linear.linear_forward, _timed("linear forward", linear.linear_forward))
    _everywhere(linear.linear_backward_with_column_sums,
                _timed("linear backward", linear.linear_backward_with_column_sums))
    _everywhere(gemm.gemm, _timed("gemm calls", gemm.gemm))
    _method(linear.BasicLinear, "quantized_weight", "weight copies")
    _everywhere(attention.attention_forward, _timed("attention forward", attention.attention_forward))
    _everywhere(attention.attention_backward, _timed("attention backward", attention.attention_backward))
    pending, seen = [Quantizer], set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        for name in ("cast", "quantize_with_column_sums"):
            if name in cls.__dict__:
                _method(cls, name, "casts")
    return ["model forward", "te groups forward", "plans' forward", "autograd backward", "te groups backward",
            "plans' backward", "linear forward", "linear backward", "casts", "gemm calls", "weight copies",
            "attention forward", "attention backward", "norm forward", "norm backward", "rotary",
            "activation backward", "optimizer step", "clip grad norm"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["bf16", "delayed", "current"], choices=list(RECIPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--layers", action="store_true", help="also time the layers above the kernels (inclusive "
                   "buckets: the model's forward, autograd's backward, te's groups, linear layers, casts, GEMMs, "
                   "weight copies, attention, optimizer, clipping)")
    p.add_argument("--full-size", action="store_true", help="the GPT at its GPU size (a step bound by the GPU "
                   "shows the bindings waiting on a full launch queue)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    buckets = install_timers()
    layers = install_layer_timers() if args.layers else []
    base = GPTConfig.gpu() if cuda else GPTConfig.smoke()
    config = base if args.full_size else host_only(base)
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
    rows = measure(steps, buckets, args.rounds, args.steps, sync, layers)
    print(f"torch {torch.__version__}, {device}, width {config.d_model}, {args.rounds} rounds x {args.steps} steps "
          "(medians, ms a step; the arms take turns)")
    print_rows(rows, buckets, layers)


def measure(steps: dict, buckets: list[str], rounds: int, count: int, sync, layers: list[str] = ()) -> dict:
    """Per arm (``steps``: label -> a training step), per round its step's ms and
    each bucket's ms and calls a step, the arms taking turns (each warmed first), in
    reverse order every other round (an arm that follows a GPU-bound one starts on
    an idle host: the order's effect falls on every arm alike)."""
    for step in steps.values():  # builds, compiles and warms every arm first
        for _ in range(3):
            step()
    rows: dict = {label: defaultdict(list) for label in steps}
    order = list(steps.items())
    for r in range(rounds):
        for label, step in (order if r % 2 == 0 else order[::-1]):
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
            for bucket in layers:
                row[bucket].append(_SPENT[bucket] * 1e3 / count)
                row[bucket + " calls"].append(_CALLS[bucket] / count)
    return rows


def print_rows(rows: dict, buckets: list[str], layers: list[str] = ()) -> None:
    """The medians of :func:`measure`'s rows, each arm's step against the first arm's;
    then the layers' buckets, an arm a column (ms a step, calls a step)."""
    header = f"{'arm':<22} {'step':>7} " + " ".join(f"{b:>16} {'calls':>6}" for b in buckets) + f" {'rest':>7}"
    print(header)
    first = statistics.median(next(iter(rows.values()))["step"])
    for label, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        cells = " ".join(f"{med[b]:>16.2f} {med[b + ' calls']:>6.0f}" for b in buckets)
        print(f"{label:<22} {med['step']:>7.2f} {cells} {med['rest']:>7.2f}   ({med['step'] / first:.2f}x the first)")
    if not layers:
        return
    print(f"\n{'layer (inclusive)':<20} " + " ".join(f"{label:>22}" for label in rows))
    for bucket in layers:
        cells = []
        for row in rows.values():
            ms, calls = statistics.median(row[bucket]), statistics.median(row[bucket + " calls"])
            cells.append(f"{ms:>13.2f} ms {calls:>4.0f}x")
        print(f"{bucket:<20} " + " ".join(cells))

if __name__ == "__main__":
    main()
