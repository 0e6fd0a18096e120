"""Where a training step of the yardstick GPT spends its GPU time, te_fuser beside torch.

    python benchmarks/profile_gpt.py [--recipes bf16 delayed current] [--steps 3] [--top 15] [--host]

The GPU-size GPT (8 layers, d 1024, seq 1024, batch 16; ``te_fuser.models.gpt``)
trains under ``torch.autocast(bfloat16)`` with fused AdamW on one batch of the
standard library's source (as ``train_gpt.py``: real text's skewed bytes reach the
embedding's backward as training's do); its plain-torch twin the same. For each
arm: the step time (median of timed steps, host and GPU overlapping as in
training), then a ``torch.profiler`` trace of a few steps
summarised as the kernels with the most GPU time, grouped by name, and the GPU
time of the optimizer step. ``--host`` adds, per arm, the Python functions with
the most own time over a few steps (cProfile, with autograd's device threads off so
that the backward's Python runs on the calling thread and is seen). ``--interleave N``
then times every arm again, each on a model of its own, the arms taking turns step
by step for N rounds: the host of the GPU machine drifts in speed faster than one
arm's timing, and taking turns makes the drift touch every arm alike. ``--host-only``
builds every arm at a tiny width with the same layers and ops, so that the GPU's
work is negligible and the step time is what the host spends launching it.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser.models.gpt import (  # noqa: E402
    GPT, GPTConfig, TorchGPT, compile_blocks, copy_weights, load_stdlib_corpus, sample_windows, torchao_float8)

RECIPES = {"bf16": None, "delayed": te.recipe.DelayedScaling(), "current": te.recipe.Float8CurrentScaling(),
           "block": te.recipe.Float8BlockScaling(), "mxfp8": te.recipe.MXFP8BlockScaling(),
           # FP8 attention (the te attention ops only): the core alone, and with its FP8 hand-offs
           "current_dpa": te.recipe.Float8CurrentScaling(fp8_dpa=True), "delayed_dpa": te.recipe.DelayedScaling(fp8_dpa=True),
           "delayed_mha": te.recipe.DelayedScaling(fp8_mha=True)}


def host_only(config: GPTConfig) -> GPTConfig:
    """``config`` at width 128 (seq 64, batch 2): the GPT's layers and ops with almost
    no GPU work, so a step's time is its host's."""
    return dataclasses.replace(config, d_model=128, n_head=2, d_ffn=512, seq_len=64, batch_size=2)


def text_batch(config: GPTConfig, seed: int = 0) -> torch.Tensor:
    """A (B, T+1) batch of the standard library's source on the GPU, as train_gpt.py
    trains: real text reads a few bytes (the space, about 30%) thousands of times a
    batch, which uniform random bytes would hide from the embedding's backward."""
    data = load_stdlib_corpus(max(1_000_000, 4 * config.batch_size * (config.seq_len + 1))).cuda()
    return sample_windows(data, config.batch_size, config.seq_len, torch.Generator().manual_seed(seed))


def _loss_backward_step(model, opt, logits, y, clip: float) -> torch.Tensor:
    """Cross-entropy of ``logits`` against ``y``, its backward (gradient norm
    clipping at ``clip`` when positive) and ``opt``'s step; the loss."""
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss


def step_fn(model, opt, recipe, batch, device_type: str = "cuda", bf16_autocast: bool = True, clip: float = 0.0):
    """One training step of ``model`` on ``batch`` (B, T+1): forward under bf16
    autocast (``bf16_autocast``) and ``recipe``, cross-entropy, backward (gradient
    norm clipping at ``clip`` when positive), ``opt``."""
    x, y = batch[:, :-1], batch[:, 1:]

    def step():
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16_autocast), \
                te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(x)
        _loss_backward_step(model, opt, logits, y, clip)
        opt.zero_grad(set_to_none=True)

    return step


def phase_ms(model, opt, recipe, batch, steps: int, bf16_autocast: bool = True) -> dict[str, tuple[float, float]]:
    """Per phase of a training step (forward with the loss, backward, optimizer step),
    ``(host ms, GPU ms)``, medians over ``steps`` steps, each step started on an idle
    GPU as the timed steps are: the host's time to issue the phase and the time from
    the GPU's start of the phase (an event recorded as the host reaches it) to its
    end. A phase whose GPU time is close to its host time kept the GPU waiting on the
    host; one whose GPU time is longer had work queued ahead of the host."""
    x, y = batch[:, :-1], batch[:, 1:]
    names = ("forward", "backward", "optimizer")
    host: dict[str, list[float]] = {n: [] for n in names}
    gpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        stamps = [time.perf_counter()]
        events[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16_autocast), \
                te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        stamps.append(time.perf_counter())
        events[1].record()
        loss.backward()
        stamps.append(time.perf_counter())
        events[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
        events[3].record()
        torch.cuda.synchronize()
        for i, name in enumerate(names):
            host[name].append((stamps[i + 1] - stamps[i]) * 1e3)
            gpu[name].append(events[i].elapsed_time(events[i + 1]))
    return {n: (statistics.median(host[n]), statistics.median(gpu[n])) for n in names}


def step_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_table(step, steps: int, top: int):
    """(name, GPU ms per step, calls per step) of the ``top`` kernels, the total GPU
    ms per step, the kernels launched per step (memsets and copies included: the
    launch count does not move with the host's speed, as its time does), and the
    GPU's idle gaps (:func:`idle_gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(ev.name[:90], [0.0, 0])
            entry[0] += ev.device_time_total / 1e3
            entry[1] += 1
            spans.append((ev.time_range.start, ev.time_range.end, ev.name[:90]))
    total = sum(v[0] for v in by_name.values()) / steps
    launches = sum(v[1] for v in by_name.values()) // steps
    rows = sorted(((n, v[0] / steps, v[1] // steps) for n, v in by_name.items()), key=lambda r: -r[1])
    return rows[:top], total, launches, idle_gaps(spans, steps, top)


def idle_gaps(spans, steps: int, top: int):
    """Where the GPU waited inside the profiled steps: ``(idle ms per step, rows)``,
    the rows ``(kernel, ms per step, gaps per step)`` grouping each gap of 5 µs or
    more by the kernel that ended it (the launch the GPU waited for), the most idle
    first. The gaps between the profiled steps (the host's synchronize) are left out:
    a gap longer than 5 ms is taken for one."""
    spans.sort()
    by_next: dict[str, list[float]] = {}
    idle = 0.0
    busy_until = spans[0][1] if spans else 0.0
    for start, end, name in spans[1:]:
        gap = start - busy_until
        if 5.0 <= gap < 5000.0:  # µs
            entry = by_next.setdefault(name, [0.0, 0])
            entry[0] += gap / 1e3
            entry[1] += 1
            idle += gap / 1e3
        busy_until = max(busy_until, end)
    rows = sorted(((n, v[0] / steps, v[1] / steps) for n, v in by_next.items()), key=lambda r: -r[1])
    return idle / steps, rows[:top]


_RUNTIME_CALLS = {"cudaMemsetAsync": "memset", "cudaMemcpyAsync": "copy", "cudaLaunchKernel": "kernel",
                  "cuLaunchKernel": "kernel", "cuLaunchKernelEx": "kernel", "cudaLaunchKernelExC": "kernel"}
_OWN_SOURCE = ("te_fuser/", "kernels/", "examples/", "benchmarks/", "models/")


def launch_sources(step, steps: int, top: int) -> list[tuple[str, str, float]]:
    """Where the step's GPU work is launched from: ``(what, source, per step)``, the
    runtime calls (kernel launches, memsets, copies) grouped by the innermost frame
    of this project's own code above them (or the torch op, for torch's own work),
    the most frequent first. Memsets and copies are the ones worth a look: each is a
    launch, and one that a kernel could do is host time for nothing."""
    from torch.profiler import ProfilerActivity, profile

    torch.autograd.set_multithreading_enabled(False)  # the backward's Python frames on this thread, seen
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    return _group_launches(prof.events(), steps, top)


def _own_frame(name: str) -> bool:
    return any(tag in name for tag in _OWN_SOURCE) and "site-packages" not in name


def _group_launches(events, steps: int, top: int) -> list[tuple[str, str, float]]:
    """:func:`launch_sources`' grouping of profiler ``events``. A runtime call's
    frame is found up its parents; one without (torch's profiler links the runtime
    calls of a C++ extension or a Triton launcher to no parent) takes the innermost
    of the project's frames on its thread whose time range holds its start."""
    import bisect

    frames = sorted((ev.time_range.start, ev.time_range.end, ev.thread, ev.name) for ev in events
                    if _own_frame(ev.name))
    starts = [f[0] for f in frames]
    counts: dict[tuple[str, str], int] = {}
    for ev in events:
        what = _RUNTIME_CALLS.get(ev.name)
        if what is None:
            continue
        source, op, parent = None, None, ev.cpu_parent
        while parent is not None:
            name = parent.name
            if op is None and name.startswith("aten::"):
                op = name
            if _own_frame(name):
                source = name
                break
            parent = parent.cpu_parent
        if source is None:  # the innermost frame holding it: frames nest, so the latest-starting one
            t = ev.time_range.start
            i = bisect.bisect_right(starts, t) - 1
            while i >= 0 and source is None:
                start, end, thread, name = frames[i]
                if end >= t and thread == ev.thread:
                    source = name
                i -= 1
        source = source or "(no frame)"
        if op is not None:
            source = f"{source} <- {op}"
        counts[(what, source)] = counts.get((what, source), 0) + 1
    rows = sorted(((w, src, n / steps) for (w, src), n in counts.items()), key=lambda r: -r[2])
    return rows[:top]


_BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                   "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaMallocHost",
                   "cudaStreamWaitEvent", "cudaStreamQuery", "cudaEventQuery")


def sync_points(step, steps: int, top: int) -> tuple[list[tuple[str, float, float]], list[tuple[str, int]]]:
    """Where ``step`` may make its host wait for the GPU: ``(calls, warned)``. ``calls``
    are the CUDA runtime calls that can block or that copy, ``(name, per step, host ms
    per step)`` over ``steps`` profiled steps (a blocking call's host time is the GPU
    work it waited for, and the GPU then idles while the host catches up); ``warned``
    are torch's own synchronizing operations seen by ``torch.cuda.set_sync_debug_mode``
    in one step, ``(innermost project frame, count)``."""
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.name in _BLOCKING_CALLS:
            entry = totals.setdefault(ev.name, [0, 0.0])
            entry[0] += 1
            entry[1] += ev.cpu_time_total / 1e3
    calls = sorted(((n, v[0] / steps, v[1] / steps) for n, v in totals.items()), key=lambda r: -r[2])
    seen: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if _own_frame(f.filename)]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else filename
        seen[where] = seen.get(where, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autograd.set_multithreading_enabled(False):  # the backward's warnings on this thread
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return calls[:top], sorted(seen.items(), key=lambda r: -r[1])[:top]


def _on_caller(step):
    """``step`` with its backward on the calling thread (autograd's device threads off
    for it): the backward's Python and launches stay on the forward's thread and core."""

    def run():
        with torch.autograd.set_multithreading_enabled(False):
            step()

    return run


def host_profile(step, steps: int, top: int, dump: str | None = None) -> None:
    torch.autograd.set_multithreading_enabled(False)
    try:
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    print(f"  host: {host_ms:.2f} ms per step under cProfile (backward on this thread)")
    stats = pstats.Stats(profiler)
    if dump:
        stats.dump_stats(dump)  # for pstats' callers and callees, read anywhere
    stats.sort_stats("tottime").print_stats(top)


def graphed_te_step(config: GPTConfig, recipe, batch, clip: float = 0.0, one_launch_in_capture: bool = True):
    """A te GPT of ``config`` (seed 0) trained by ``te.make_graphed_step``: forward,
    loss, backward (with gradient clipping at ``clip`` when positive, as
    ``train_gpt.py`` clips at 1.0) and a capturable fused AdamW step replayed from
    one CUDA graph, its first calls eager and then the capture; called like
    :func:`step_fn`'s steps. Its kernel table is the GPU's work with no host gaps.
    ``one_launch_in_capture``: the capture takes the one-launch casts (cooperative
    kernel nodes), else their separate launches."""
    torch.manual_seed(0)
    model = GPT(config, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4, device="cuda"), fused=True, capturable=True)

    def body(b):  # the recipe comes from the te.autocast around the graphed call
        x, y = b[:, :-1], b[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        return _loss_backward_step(model, opt, logits, y, clip).detach()

    graphed = te.make_graphed_step(body, model)
    from te_fuser.kernels.cuda import set_one_launch_casts_in_capture

    def step():  # the setting is read when the graph is captured (the third call)
        previous = set_one_launch_casts_in_capture(one_launch_in_capture)
        try:
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                graphed(batch)
        finally:
            set_one_launch_casts_in_capture(previous)

    return step


def _fresh_te_step(config: GPTConfig, recipe, batch, clip: float = 0.0):
    """:func:`step_fn` of a te GPT of ``config`` made for it (seed 0) with fused AdamW."""
    torch.manual_seed(0)
    model = GPT(config, device="cuda")
    return step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), recipe, batch, clip=clip)


def _back_to_back(steps: dict, rounds: int, run_length: int) -> dict:
    """``{label: ms a step}``: each arm alone, ``rounds`` runs of ``run_length`` steps
    back to back (median), one arm after the other, no turns."""
    return {label: harness.interleaved_ms({label: step}, rounds, steps=run_length, sync=torch.cuda.synchronize)[label]
            for label, step in steps.items()}


def _peer_steps(twin: TorchGPT, batch, clip: float = 0.0) -> dict:
    """``{label: step}`` of the peers, each on a copy of ``twin`` with fused AdamW: the
    twin with its blocks compiled, and torchao's float8 twin where torchao imports.
    Both live in one process, so dynamo is not reset between them and its recompile
    limit is raised (their blocks share one forward's code)."""
    import copy

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.reset()
    peers = {"torch bf16 compiled": compile_blocks(copy.deepcopy(twin), reset=False)}
    try:
        peers["torchao float8"] = torchao_float8(copy.deepcopy(twin), reset=False)
    except ImportError as err:
        print(f"torchao float8 left out: {err}")
    return {label: step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), None, batch, clip=clip)
            for label, model in peers.items()}


def _separate_launches(step):
    """``step`` with the CUDA casts' one-launch path off for its duration (the same
    model and bits; the launches of the transposing casts apart)."""
    from te_fuser.kernels.cuda import set_one_launch_casts

    def separate():
        previous = set_one_launch_casts(False)
        try:
            step()
        finally:
            set_one_launch_casts(previous)

    return separate


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=["bf16", "delayed", "current"], choices=list(RECIPES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timed", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--host", action="store_true", help="also profile the host's Python per arm (cProfile)")
    p.add_argument("--dump", metavar="DIR", help="with --host: write each arm's cProfile statistics to DIR "
                                                  "(host_<arm>.prof, for pstats)")
    p.add_argument("--attention", choices=["sdpa", "te"], default="te",
                   help="the GPT's attention: te_fuser's attention ops (the default, as in train_gpt.py), "
                        "or torch SDPA between the fused groups")
    p.add_argument("--host-only", action="store_true",
                   help="time each arm at a tiny width with the same layers: the GPU work is negligible, so the step "
                        "time is the host's (what the host costs per step at full size, when it is not hidden)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="then time every arm again on a model of its own, the arms taking turns step by step for "
                        "ROUNDS rounds (medians): a drift of the host's speed touches every arm alike")
    p.add_argument("--run-length", type=int, nargs="+", default=[1], metavar="STEPS",
                   help="with --interleave: each turn runs STEPS steps back to back and syncs once after them, as "
                        "a training loop that does not wait on every step (1: a sync after every step, so a host "
                        "slower than the GPU in the forward is never hidden behind the previous step's backward); "
                        "several values: a table each")
    p.add_argument("--phases", action="store_true",
                   help="also time, per arm, the host and the GPU in each phase of the step (forward, backward, "
                        "optimizer): where the GPU waits on the host")
    p.add_argument("--syncs", action="store_true",
                   help="per arm, the CUDA runtime calls that can block the host (or copy) per step, and torch's "
                        "synchronizing operations in one step (torch.cuda.set_sync_debug_mode)")
    p.add_argument("--sources", type=int, default=0, metavar="N",
                   help="also list, per arm, the N most frequent sources of GPU work: the runtime calls (kernels, "
                        "memsets, copies) grouped by the project's frame (and torch op) that made them")
    p.add_argument("--graphed", action="store_true",
                   help="also each te recipe's step replayed from a CUDA graph (te.make_graphed_step, capturable "
                        "fused AdamW), captured with the one-launch casts and with their separate launches: its "
                        "kernel table is the step's GPU work with the host out of it")
    p.add_argument("--clip", type=float, default=0.0,
                   help="gradient norm clipping in every arm's step, eager, graphed and interleaved (train_gpt.py "
                        "clips at 1.0; 0: off)")
    p.add_argument("--peers", action="store_true",
                   help="with --interleave: also the twin with its blocks torch.compile'd (bf16) and, where torchao "
                        "imports, torchao's float8 twin (tensorwise, blocks compiled), as train_gpt.py builds them, "
                        "taking turns with the others: the te / torchao ratio with the host's drift shared; and "
                        "every other arm alone, back to back, before the peers are built and after the turns")
    p.add_argument("--caller-backward", action="store_true",
                   help="with --interleave: also every arm with its backward on the calling thread (autograd's "
                        "device threads off), taking turns with the others")
    p.add_argument("--separate-launches", action="store_true",
                   help="with --interleave: also time each te arm with the transposing casts as separate launches "
                        "(amax pass, cast, column sums; a memset first under delayed scaling) rather than one "
                        "cooperative launch, taking turns with the others")
    p.add_argument("--one-sequential", action="store_true",
                   help="with --interleave: also time each te arm built with one Sequential a block "
                        "(GPTConfig.layer='one_sequential': the residuals on channels), taking turns with the others")
    p.add_argument("--auto-entry", action="append", default=[], metavar="KERNEL=BACKEND",
                   help="auto's choice of BACKEND (reference, triton, cuda) for KERNEL in this process, for every "
                        "arm (te_fuser.backend.set_auto_entry): one kernel's A/B across two runs")
    p.add_argument("--compile", action="store_true",
                   help="also time each te arm through torch.compile(model) (inductor), beside its eager steps")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.one_sequential and args.attention != "te":
        p.error("--one-sequential: one Sequential a block needs the te attention ops (--attention te)")
    from te_fuser import backend

    for text in args.auto_entry:
        kernel, _, name = text.partition("=")
        try:
            print(f"auto's {kernel}: {backend.set_auto_entry(kernel, name)!r} -> {name!r}")
        except ValueError as err:
            p.error(f"--auto-entry {text}: {err}")
    config = dataclasses.replace(GPTConfig.gpu(), attention=args.attention)
    if args.host_only:
        config = host_only(config)
    torch.manual_seed(0)
    batch = text_batch(config)
    te_model = GPT(config, device="cuda")
    twin = TorchGPT(config, device="cuda")
    copy_weights(te_model, twin)
    arms = [("torch bf16", twin, None)] + [(f"te {name}", te_model, RECIPES[name]) for name in args.recipes]
    if args.compile:
        compiled = torch.compile(te_model)
        arms += [(f"te {name} compiled", compiled, RECIPES[name]) for name in args.recipes]
    if args.graphed:  # a model each, trained through te.make_graphed_step; captured with either cast path
        arms += [(f"te {name} graphed{tail}", (None, one), RECIPES[name]) for name in args.recipes
                 for tail, one in (("", True), (", separate casts", False))]
    tokens = config.batch_size * config.seq_len
    results = []
    for label, model, recipe in arms:
        if type(model) is tuple:
            step = graphed_te_step(config, recipe, batch, args.clip, one_launch_in_capture=model[1])
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # (a compiled model's: the te model's)
            step = step_fn(model, opt, recipe, batch, clip=args.clip)
        for _ in range(3):
            step()
        ms = step_ms(step, args.timed)
        rows, total, launches, (idle, gaps) = kernel_table(step, args.steps, args.top)
        results.append((label, ms, launches))
        print(f"\n== {label}: {ms:.2f} ms/step ({tokens / ms:.0f}k tokens/s), GPU kernels {total:.2f} ms/step, "
              f"{launches} launches/step")
        for name, kms, calls in rows:
            print(f"  {kms:8.3f} ms {calls:5d}x  {name}")
        print(f"  GPU idle inside the step: {idle:.2f} ms/step, by the kernel it waited for:")
        for name, gms, count in gaps:
            print(f"  {gms:8.3f} ms {count:5.0f}x  {name}")
        if args.phases and type(model) is not tuple:
            phases = phase_ms(model, opt, recipe, batch, args.timed)
            print("  phase        host ms   GPU ms (from the host's start of the phase to the GPU's end of it)")
            for name, (host_ms, gpu_ms) in phases.items():
                print(f"  {name:<10} {host_ms:8.2f} {gpu_ms:8.2f}")
        if args.syncs and type(model) is not tuple:
            calls, warned = sync_points(step, args.steps, args.top)
            print("  runtime calls that can block or copy (per step, host ms per step):")
            for name, count, ms in calls:
                print(f"  {count:7.1f}  {ms:8.3f} ms  {name}")
            print(f"  torch's synchronizing operations in one step: {sum(n for _, n in warned)}")
            for where, count in warned:
                print(f"  {count:5d}x  {where}")
        if args.sources:
            print("  launches by source (per step; memsets and copies first):")
            rows = launch_sources(step, args.steps, 10 * args.sources)
            rows.sort(key=lambda r: (r[0] == "kernel", -r[2]))
            for what, source, per_step in rows[:args.sources]:
                print(f"  {per_step:7.1f}  {what:6s}  {source[:150]}")
        if args.host and type(model) is not tuple:
            dump = args.dump and str(Path(args.dump) / f"host_{label.replace(' ', '_')}.prof")
            host_profile(step, args.steps, 2 * args.top, dump)
    base = results[0][1]
    print("\narm                 ms/step   tokens/s   vs torch bf16   launches/step")
    for label, ms, launches in results:
        print(f"{label:<18} {ms:8.2f} {tokens / ms:9.0f}k {base / ms:10.2f}x {launches:15d}")
    if args.interleave:
        steps = {"torch bf16": step_fn(twin, torch.optim.AdamW(twin.parameters(), lr=1e-4, fused=True), None, batch,
                                       clip=args.clip)}
        for name in args.recipes:  # a model each: taking turns on one model would time recipe switches
            steps[f"te {name}"] = _fresh_te_step(config, RECIPES[name], batch, args.clip)
            if args.separate_launches:
                steps[f"te {name}, separate launches"] = _separate_launches(steps[f"te {name}"])
            if args.one_sequential:
                steps[f"te {name}, one Sequential"] = _fresh_te_step(
                    dataclasses.replace(config, layer="one_sequential"), RECIPES[name], batch, args.clip)
        alone, peers = {}, {}
        if args.peers:  # the arms alone first: whether taking turns with the peers changes them
            alone = {"before the peers": _back_to_back(steps, args.interleave, args.run_length[-1])}
            peers = _peer_steps(twin, batch, args.clip)
            steps.update(peers)
        if args.caller_backward:
            steps.update({f"{label}, backward on the caller": _on_caller(step) for label, step in list(steps.items())})
        for run_length in args.run_length:
            medians = harness.interleaved_ms(steps, args.interleave, steps=run_length, sync=torch.cuda.synchronize)
            base = medians["torch bf16"]
            print(f"\ninterleaved ({args.interleave} rounds, {run_length} step(s) a turn)  ms/step   tokens/s   "
                  "vs torch bf16")
            for label, ms in medians.items():
                print(f"{label:<22} {ms:8.2f} {tokens / ms:9.0f}k {base / ms:10.2f}x")
        if alone:
            labels = list(alone["before the peers"]) + list(peers)
            alone["after the turns"] = _back_to_back({label: steps[label] for label in labels}, args.interleave,
                                                     args.run_length[-1])
            print(f"\neach arm alone, {args.run_length[-1]} steps back to back ({args.interleave} rounds), ms/step:")
            print(f"{'arm':<22} " + "   ".join(f"{when:>18}" for when in alone))
            for label in labels:
                cells = (f"{alone[when][label]:18.2f}" if label in alone[when] else f"{'-':>18}" for when in alone)
                print(f"{label:<22} " + "   ".join(cells))



if __name__ == "__main__":
    main()
