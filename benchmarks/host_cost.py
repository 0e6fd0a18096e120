"""What the host pays per call, with the GPU kept busy: te_fuser's pieces beside torch's.

    python benchmarks/host_cost.py [--calls 100] [--repeats 7]

A long ``torch.cuda._sleep`` kernel is queued first, so that every launch of the
timed loop queues behind it and the loop's wall time is the host's cost alone
(no waiting on the GPU, no overlap); ``--calls`` stays below the launch queue's
depth. Rows (µs per call, best of ``--repeats``):

- primitives: ``torch.empty``, a bf16 ``torch.mm``, ``torch._scaled_mm``, the
  backend's casts and GEMM, a Python ``autograd.Function``, ``te.autocast``;
- one Linear at the GPT's MLP shape (16384 tokens, 1024 -> 4096, fp32 weights
  under ``torch.autocast(bfloat16)``): forward, and forward + backward, for
  torch's ``nn.Linear`` and te_fuser in bf16 and under each FP8 recipe;
- the whole GPT step's host time at a tiny size (d 64, seq 64: the GPU has
  almost nothing to do, so the step time is the host's), te beside the torch twin.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from profile_gpt import step_fn  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser import backend  # noqa: E402

SLEEP_CYCLES = 300_000_000  # about 0.15 s at H200 clocks: longer than any timed loop (at most about 50 ms)


def host_us(fn, calls: int, repeats: int) -> float:
    """Best of ``repeats``: host µs per ``fn()`` while the GPU sleeps."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls * 1e6


def blocking_calls(fn, calls: int, top: int = 6) -> list[tuple[str, float]]:
    """The functions whose own time holds the GPU's sleep: where ``fn`` waits on the GPU."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{name} ({file.rsplit('/', 1)[-1]}:{line})", tt * 1e3) for (file, line, name), (_, _, tt, _, _)
                   in stats.items()), key=lambda r: -r[1])
    return rows[:top]


def step_profile(step, calls: int, top: int) -> None:
    """cProfile of ``calls`` steps with the backward on this thread (autograd's device
    threads off, so its Python is seen) while the GPU sleeps: own time per step."""
    import cProfile

    torch.autograd.set_multithreading_enabled(False)
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            step()
        prof.disable()
        torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    harness.print_own_times(prof, calls, top, indent="    ")


def primitives(calls: int, repeats: int) -> list[tuple[str, float]]:
    dev = "cuda"
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    current = backend.resolve("quantize_current", a.device).fn
    tensorwise = backend.resolve("quantize_tensorwise", a.device).fn
    col_sums = backend.resolve("amax_column_sums", a.device).fn
    gemm = backend.resolve("gemm", a.device).fn
    xq, _, _, s_inv, _ = current(a, torch.float8_e4m3fn, False, 0.0, True, False, None)
    wq, _, _, w_inv, _ = current(b, torch.float8_e4m3fn, False, 0.0, True, False, None)
    from te_fuser.kernels.operand import ScaledOperand

    xo, wo = ScaledOperand(xq, s_inv, "tensor"), ScaledOperand(wq, w_inv, "tensor")

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    recipe = te.recipe.Float8CurrentScaling()
    # the MLP's first GEMM: 16384 tokens, 1024 -> 4096, and its backward's shapes
    xg = torch.randn(16384, 1024, device=dev).to(torch.float8_e4m3fn)
    wg = torch.randn(4096, 1024, device=dev).to(torch.float8_e4m3fn)
    dyg = torch.randn(16384, 4096, device=dev).to(torch.float8_e5m2)
    dygt, xgt = dyg.t().contiguous(), xg.t().contiguous()
    wgt = wg.t().contiguous()
    bias = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    update = backend.resolve("delayed_scale_update", a.device)
    history, count = torch.zeros(1024, device=dev), torch.zeros((), dtype=torch.int64, device=dev)

    def autocast():
        with te.autocast(recipe=recipe):
            pass

    # one cast and one GEMM, layer by layer: the binding's call alone, the launcher,
    # the quantizer / the ops' gemm, and pieces each of them pays
    from te_fuser.kernels.cuda._build import extension, raw_stream
    from te_fuser.ops.gemm import gemm as ops_gemm
    from te_fuser.quantization import Float8CurrentScalingQuantizer

    ext, stream, s16 = extension(), raw_stream(a.device), one.reshape(1).clone()
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=dev)
    a3 = a.reshape(16, 64, 1024)
    f32 = torch.randn(1024, device=dev)
    layers = [
        ("binding: fp8_gemm_plans (a call, no work)", lambda: ext.fp8_gemm_plans()),
        ("binding: cast_current, with T", lambda: ext.cast_current(a, 1, 0, 1024, 1024, False, 0.0, True, True, None,
                                                                   False, False, False, stream)),
        ("launcher: quantize_current, with T", lambda: current(a, torch.float8_e4m3fn, False, 0.0, True, True, None)),
        ("quantizer.cast (current), with T", lambda: quantizer.cast(a, rowwise=True, columnwise=True)),
        ("binding: fp8_gemm_tensorwise", lambda: ext.fp8_gemm_tensorwise(xq, wq, s16, s16, None, torch.bfloat16, False,
                                                                         stream)),
        ("ops gemm (te_fuser.ops.gemm.gemm)", lambda: ops_gemm(xo, wo, torch.bfloat16)),
        ("x.reshape (3-D -> 2-D)", lambda: a3.reshape(-1, 1024)),
        ("fp32 (1024,) .to(bf16)", lambda: f32.to(torch.bfloat16)),
        ("torch._C._cuda_getDevice", lambda: torch._C._cuda_getDevice()),
        ("raw_stream", lambda: raw_stream(a.device)),
    ]
    rows = layers + [
        ("torch.empty (1024x1024 bf16)", lambda: torch.empty(1024, 1024, device=dev, dtype=torch.bfloat16)),
        ("torch.mm bf16", lambda: torch.mm(a, b)),
        ("torch._scaled_mm tensorwise", lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)),
        (f"gemm ({backend.resolve('gemm', a.device).backend})", lambda: gemm(xo, wo, torch.bfloat16)),
        ("_scaled_mm fprop 16384x1024->4096", lambda: torch._scaled_mm(xg, wg.t(), one, one, out_dtype=torch.bfloat16)),
        ("  the same, bf16 bias, fast accumulation", lambda: torch._scaled_mm(
            xg, wg.t(), one, one, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)),
        ("_scaled_mm dgrad 16384x4096->1024", lambda: torch._scaled_mm(dyg, wgt.t(), one, one,
                                                                        out_dtype=torch.bfloat16)),
        ("_scaled_mm wgrad 4096x16384->1024, fp32 out", lambda: torch._scaled_mm(dygt, xgt.t(), one, one,
                                                                                   out_dtype=torch.float32)),
        (f"delayed_scale_update ({update.backend})", lambda: update.fn(history, one, one, count, torch.float8_e4m3fn)),
        (f"quantize_current ({backend.resolve('quantize_current', a.device).backend}), with T",
         lambda: current(a, torch.float8_e4m3fn, False, 0.0, True, True, None)),
        (f"quantize_tensorwise ({backend.resolve('quantize_tensorwise', a.device).backend}), with T",
         lambda: tensorwise(a, one, torch.float8_e4m3fn, True, True)),
        (f"amax_column_sums ({backend.resolve('amax_column_sums', a.device).backend})", lambda: col_sums(a)),
        ("autograd.Function apply (no-op)", lambda: Nothing.apply(a)),
        ("te.autocast enter+exit", autocast),
    ]
    return [(name, host_us(fn, calls, repeats)) for name, fn in rows]


def anatomy_rows(calls: int, repeats: int) -> list[tuple[str, float]]:
    """A cast's and a GEMM's binding at the GPT's sizes beside 1024x1024, and what
    each might pay inside: an empty kernel's launch, allocations of growing size,
    the one-launch (cooperative) cast against the separate launches. A call's host
    cost that grows with the problem is paid below Python, where the rows above
    cannot see it."""
    from te_fuser.kernels.cuda._build import extension, raw_stream

    dev = "cuda"
    ext, stream = extension(), raw_stream(torch.device(dev, torch.cuda.current_device()))
    one = torch.ones(1, device=dev)
    rows = [("torch.cuda._sleep(1) (an empty kernel's launch)", lambda: torch.cuda._sleep(1))]
    for mib in (2, 32, 128):
        rows.append((f"torch.empty {mib} MiB", lambda n=mib << 20: torch.empty(n, device=dev, dtype=torch.uint8)))
    shapes = ((1024, 1024), (16384, 1024), (16384, 4096))
    inputs = {s: torch.randn(*s, device=dev, dtype=torch.bfloat16) for s in shapes}

    def under(enabled: bool, cast):  # the call with the one-launch casts set to ``enabled`` around it
        def call():
            previous = ext.one_launch_casts(enabled)
            try:
                return cast()
            finally:
                ext.one_launch_casts(previous)

        return call

    for enabled in (True, False):
        how = "one launch" if enabled else "separate launches"
        for (r, c), x in inputs.items():
            rows.append((f"binding cast_current {r}x{c}, with T, {how}", under(enabled, lambda x=x, r=r, c=c: (
                ext.cast_current(x, 1, 0, r, c, False, 0.0, True, True, None, False, False, False, stream)))))
            rows.append((f"binding cast_tensorwise {r}x{c}, with T, {how}", under(enabled, lambda x=x, r=r, c=c: (
                ext.cast_tensorwise(x, 1, 0, r, c, one, None, True, True, False, False, False, stream)))))
    rows.append(("binding one_launch_casts (toggle, twice)", lambda: ext.one_launch_casts(ext.one_launch_casts(True))))
    f8 = torch.float8_e4m3fn
    for m, n, k, name in ((1024, 1024, 1024, "1024^3"), (16384, 4096, 1024, "fc1 fprop"),
                          (16384, 1024, 4096, "fc2 fprop"), (1024, 4096, 16384, "fc1 wgrad")):
        a = torch.randn(m, k, device=dev).to(f8)
        b = torch.randn(n, k, device=dev).to(f8)
        rows.append((f"binding fp8_gemm_tensorwise {name}",
                     lambda a=a, b=b: ext.fp8_gemm_tensorwise(a, b, one, one, None, torch.bfloat16, False, stream)))
    return [(name, host_us(fn, calls, repeats)) for name, fn in rows]


def linear_rows(calls: int, repeats: int, profile: int) -> list[tuple[str, float, float]]:
    dev = "cuda"
    x = torch.randn(16384, 1024, device=dev, requires_grad=True)
    dy = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    torch_lin = torch.nn.Linear(1024, 4096, device=dev)
    te_lin = te.ops.Sequential(te.ops.Linear(1024, 4096, device=dev))
    arms = [("torch nn.Linear", torch_lin, None), ("te bf16", te_lin, None)]
    arms += [(f"te {n}", te_lin, r) for n, r in (("current", te.recipe.Float8CurrentScaling()),
                                                 ("delayed", te.recipe.DelayedScaling()))]
    rows = []
    for label, mod, recipe in arms:
        def fwd():
            with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(enabled=recipe is not None, recipe=recipe):
                return mod(x)

        def step():
            fwd().backward(dy)

        rows.append((label, host_us(fwd, max(calls // 5, 10), repeats), host_us(step, max(calls // 5, 10), repeats)))
        if profile and recipe is not None:
            print(f"  {label}, fwd+bwd:")
            step_profile(step, 10, profile)
        if rows[-1][1] > 20 * rows[0][1]:
            print(f"  {label}: the forward waits on the GPU; own time (ms) of the top functions over {calls} calls:")
            for name, ms in blocking_calls(fwd, calls):
                print(f"    {ms:10.1f}  {name}")
    return rows


def gpt_rows(steps: int) -> list[tuple[str, float]]:
    from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT, copy_weights

    config = GPTConfig.gpu().replace(d_model=64, n_head=4, d_ffn=256, seq_len=64, batch_size=4, attention="sdpa")
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (config.batch_size, config.seq_len + 1), device="cuda")
    te_model, twin = GPT(config, device="cuda"), TorchGPT(config, device="cuda")
    copy_weights(te_model, twin)
    rows = []
    arms = [("torch bf16", twin, None), ("te bf16", te_model, None),
            ("te current", te_model, te.recipe.Float8CurrentScaling()), ("te delayed", te_model, te.recipe.DelayedScaling())]
    for label, model, recipe in arms:
        step = step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), recipe, batch)
        for _ in range(5):
            step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append((label, statistics.median(times)))
    return rows


def _all_threads_on(cpus: set) -> None:
    """Pin every thread of this process (the autograd engine's device threads too) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def gpt_setting_rows(steps: int, rounds: int) -> list[tuple[str, str, float]]:
    """The tiny yardstick GPT's step (te attention; the GPU has almost nothing to do,
    so a step's time is the host's) under process settings that change what the
    host's step costs, each arm and setting taking turns: as it is; autograd's
    backward on the calling thread (``set_multithreading_enabled(False)``: the
    backward's Python and launches on the forward's core, its caches warm); the
    garbage collector off after a ``gc.freeze()``; every thread pinned to one core
    (the forward and the backward threads then share it). ms per step, medians."""
    import gc

    from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT, copy_weights

    config = GPTConfig.gpu().replace(d_model=128, n_head=4, d_ffn=512, seq_len=64, batch_size=4)
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (config.batch_size, config.seq_len + 1), device="cuda")
    te_model, twin = GPT(config, device="cuda"), TorchGPT(config, device="cuda")
    copy_weights(te_model, twin)
    arms = [("torch bf16", twin, None), ("te current", te_model, te.recipe.Float8CurrentScaling()),
            ("te delayed", te_model, te.recipe.DelayedScaling())]
    steps_of = {label: step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), recipe, batch)
                for label, model, recipe in arms}
    everything = os.sched_getaffinity(0)
    one_core, threads = {min(everything)}, torch.get_num_threads()

    def setting(name: str, on: bool) -> None:
        if name == "backward on the calling thread":
            torch.autograd.set_multithreading_enabled(not on)
        elif name == "gc frozen and off":
            if on:
                gc.collect()
                gc.freeze()
                gc.disable()
            else:
                gc.enable()
                gc.unfreeze()
        elif name == "all threads on one core":  # torch's CPU pool shrunk to one thread with it
            torch.set_num_threads(1 if on else threads)
            _all_threads_on(one_core if on else everything)

    settings = ["as it is", "backward on the calling thread", "gc frozen and off", "all threads on one core"]
    times: dict = {}
    for step in steps_of.values():
        for _ in range(5):
            step()
    for _ in range(rounds):
        for name in settings:
            setting(name, True)
            try:  # one round of the arms' turns under the setting, after two steps each under it
                medians = harness.interleaved_ms(steps_of, 1, steps=steps, sync=torch.cuda.synchronize, warmup=2)
            finally:
                setting(name, False)
            for label, ms in medians.items():
                times.setdefault((label, name), []).append(ms)
    return [(label, name, statistics.median(ts)) for (label, name), ts in times.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gpt-steps", type=int, default=20)
    p.add_argument("--anatomy-only", action="store_true", help="stop after the launch anatomy rows")
    p.add_argument("--settings", action="store_true",
                   help="after the anatomy, the tiny GPT's host step under process settings (threads, gc, affinity)")
    p.add_argument("--profile", type=int, default=25, help="profile the FP8 Linear steps: top N functions (0: off)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    print(f"backend={te.get_backend()} torch={torch.__version__}")
    print("\nprimitive                                      host us/call")
    for name, us in primitives(args.calls, args.repeats):
        print(f"  {name:<44} {us:8.1f}")
    print("\nlaunch anatomy (GPT sizes)                   host us/call")
    for name, us in anatomy_rows(args.calls, args.repeats):
        print(f"  {name:<52} {us:8.1f}")
    if args.settings:
        print("\ntiny GPT step under process settings   ms/step (median of rounds)")
        for label, name, ms in gpt_setting_rows(args.gpt_steps, 5):
            print(f"  {label:<12} {name:<34} {ms:8.2f}")
    if args.anatomy_only:
        return
    print("\nLinear 16384x1024->4096            fwd us   fwd+bwd us")
    for label, f_us, s_us in linear_rows(args.calls, args.repeats, args.profile):
        print(f"  {label:<30} {f_us:8.1f} {s_us:11.1f}")
    print("\ntiny GPT step (host-bound)        ms/step   vs torch")
    rows = gpt_rows(args.gpt_steps)
    for label, ms in rows:
        print(f"  {label:<30} {ms:8.2f} {rows[0][1] / ms:8.2f}x")


if __name__ == "__main__":
    main()
