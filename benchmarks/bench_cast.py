"""FP8 cast kernels: time, logical TB/s and fraction of the measured copy ceiling.

Logical IO counts each input read once and each output written once (bf16 in,
FP8 out, plus the transposed copy where asked). Current scaling also reports the
fraction of its two-pass floor (read x for the amax, then read x and write FP8),
side by side with the same cast in torch eager and torch.compile. The Triton casts
run twice, with the hardware FP8 conversion (``triton``) and with the exact integer
encoding (``triton-exact``, what ``TE_FUSER_EXACT_FP8=1`` gives): the ``triton`` rows
note the speed-up, and a last table lists both side by side.

    python benchmarks/bench_cast.py [--backends triton triton-exact cuda] [--shapes 8192x8192 256x1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Row  # noqa: E402

E4M3 = torch.float8_e4m3fn


def torch_current_cast(x: torch.Tensor):
    """The peer: current scaling written in plain torch ops."""
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    return (x.float() * scale).clamp(-448.0, 448.0).to(E4M3), 1.0 / scale, amax


def _cases(mod, x: torch.Tensor):
    """name -> (callable on x, logical bytes, two-pass floor bytes or None)."""
    n = x.numel()
    scale = torch.tensor(0.5, device=x.device)
    cases = {
        "tensorwise": (lambda t: mod.quantize_tensorwise(t, scale, E4M3), 3 * n, None),
        "tensorwise+T": (lambda t: mod.quantize_tensorwise(t, scale, E4M3, True, True), 4 * n, None),
        "current": (lambda t: mod.quantize_current(t, E4M3), 3 * n, 5 * n),
        "current+T": (lambda t: mod.quantize_current(t, E4M3, columnwise=True), 4 * n, 6 * n),
        "rowwise": (lambda t: mod.quantize_rowwise(t, E4M3), 3 * n, None),
        "block_1x128": (lambda t: mod.quantize_block(t, E4M3, 1), 3 * n, None),
        "block_128x128": (lambda t: mod.quantize_block(t, E4M3, 128), 3 * n, None),
        # a quantizer's two copies (x and x.T quantized along M): one read, or two casts as before
        "block_1x128+T": (lambda t: mod.quantize_block(t, E4M3, 1, True, 0.0, True, True), 4 * n, None),
        "block_1x128, x and x.T cast apart": (lambda t: (mod.quantize_block(t, E4M3, 1),
                                                         mod.quantize_block(t.t(), E4M3, 1)), 4 * n, None),
        "block_128x128+T": (lambda t: mod.quantize_block(t, E4M3, 128, True, 0.0, True, True), 4 * n, None),
        "mxfp8": (lambda t: mod.quantize_mxfp8(t, E4M3), 3 * n + n // 32, None),
    }
    kernel_of = {"tensorwise": "quantize_tensorwise", "tensorwise+T": "quantize_tensorwise",
                 "current": "quantize_current", "current+T": "quantize_current", "rowwise": "quantize_rowwise",
                 "block_1x128": "quantize_block", "block_128x128": "quantize_block", "mxfp8": "quantize_mxfp8",
                 "block_1x128+T": "quantize_block", "block_1x128, x and x.T cast apart": "quantize_block",
                 "block_128x128+T": "quantize_block"}
    return {name: case for name, case in cases.items() if hasattr(mod, kernel_of[name])}


def _row(case: str, backend: str, label: str, ms: float, logical: int, floor: int | None, copy_tbs: float,
         graph: bool) -> Row:
    tbs = logical / (ms * 1e-3) / 1e12
    row = Row("cast-graph" if graph else "cast", case, backend, label, ms, tbs, "TB/s", tbs / copy_tbs)
    if floor is not None:
        row.extra["of_two_pass_floor"] = floor / (copy_tbs * 1e12) / (ms * 1e-3)
        row.note = f"{row.extra['of_two_pass_floor']:.0%} of two-pass floor"
    return row


def bench_shape(shape: tuple[int, int], backends: list[str], copy_tbs: float) -> list[Row]:
    """Every cast at one shape, timed from Python and (shapes over 8 MiB) from a CUDA graph."""
    rows_n, cols_n = shape
    n = rows_n * cols_n
    inputs = harness.rotation(lambda: (torch.randn(rows_n, cols_n, device="cuda").bfloat16(),), 2 * n)
    label = f"{rows_n}x{cols_n} bf16"
    timers = [(False, harness.time_ms)] + ([(True, harness.graph_time_ms)] if 2 * n >= 8 * 2**20 else [])
    compiled = torch.compile(torch_current_cast)
    out: list[Row] = []
    for graph, timer in timers:
        peer_ms = {}
        for name, fn in (("torch eager", torch_current_cast), ("torch.compile", compiled)):
            peer_ms[name] = timer(fn, inputs)
            out.append(harness.progress(_row("current", name, label, peer_ms[name], 3 * n, 5 * n, copy_tbs, graph)))
        for backend in backends:
            mod = harness.backend_module(backend)
            for name, (fn, logical, floor) in _cases(mod, inputs[0][0]).items():
                try:
                    ms = timer(fn, inputs)
                except Exception as err:  # a backend that cannot run this case says why
                    out.append(harness.progress(Row("cast", name, backend, label, float("nan"), float("nan"),
                                                    "TB/s", note=f"{type(err).__name__}: {str(err)[:80]}")))
                    continue
                row = _row(name, backend, label, ms, logical, floor, copy_tbs, graph)
                if name == "current":
                    row.vs_peer, row.peer = peer_ms["torch.compile"] / ms, "torch.compile"
                out.append(harness.progress(row))
    _note_encoding_speedup(out)
    return out


def _note_encoding_speedup(rows: list[Row]) -> None:
    """On each ``triton`` row: the time of the same cast with the exact FP8 encoding
    over its time (``x_vs_triton_exact``, and in the note)."""
    exact = {(r.bench, r.case, r.shape): r.ms for r in rows if r.backend == "triton-exact"}
    for row in rows:
        key = (row.bench, row.case, row.shape)
        if row.backend == "triton" and key in exact and row.ms == row.ms:
            row.extra["vs_triton_exact"] = exact[key] / row.ms
            row.note = "; ".join(filter(None, [row.note, f"{exact[key] / row.ms:.2f}x vs triton-exact"]))


def print_encoding_table(rows: list[Row]) -> None:
    """The Triton casts with the hardware FP8 conversion against the exact encoding."""
    pairs = [r for r in rows if r.backend == "triton" and "vs_triton_exact" in r.extra]
    if not pairs:
        return
    exact = {(r.bench, r.case, r.shape): r for r in rows if r.backend == "triton-exact"}
    print("\n== FP8 encoding: hardware conversion (triton) vs exact integer encoding (triton-exact)")
    print(f"{'timing':10s} {'case':14s} {'shape':16s} {'exact ms':>9s} {'hw ms':>9s} {'speed-up':>8s} "
          f"{'exact TB/s':>10s} {'hw TB/s':>8s}")
    for r in pairs:
        e = exact[(r.bench, r.case, r.shape)]
        timing = "graph" if r.bench == "cast-graph" else "eager"
        print(f"{timing:10s} {r.case:14s} {r.shape:16s} {e.ms:9.4f} {r.ms:9.4f} {e.ms / r.ms:7.2f}x "
              f"{e.rate:10.2f} {r.rate:8.2f}")


FLAT_PLANS = [(8, 1024, 8, 8), (8, 1024, 8, 4), (8, 1024, 8, 16), (4, 1024, 4, 16), (16, 512, 8, 8),
              (16, 1024, 8, 4), (8, 2048, 8, 4), (2, 1024, 4, 32)]
TRANSPOSE_PLANS = [(64, 128, 8, 8), (64, 64, 4, 16), (128, 64, 8, 8), (32, 128, 4, 16), (128, 128, 8, 4),
                   (64, 128, 4, 8), (64, 256, 8, 4), (32, 256, 8, 8), (128, 128, 8, 8),
                   # with a register cap (the fifth field: maxnreg), so that the plan's programs fit at once
                   (128, 128, 8, 4, 64), (128, 128, 8, 4, 32), (64, 128, 8, 4, 64), (64, 128, 8, 8, 32)]


def _amax_pass(x: torch.Tensor):
    """Pass 1 of current scaling alone (the amax partials)."""
    from te_fuser.kernels.triton import cast

    xk, plan = cast._cast_plan(x, False)
    programs, launch = cast._launch_meta(xk, plan)
    partials = torch.empty(programs, dtype=torch.int32, device=x.device)
    return lambda t: cast._amax_partials_kernel[(programs,)](t.view(xk.shape), partials, *xk.shape, xk.stride(0),
                                                           xk.stride(1), **launch)


def sweep(copy_tbs: float, rows_n: int = 8192, cols_n: int = 8192) -> list[Row]:
    """Time the Triton per-tensor casts under several launch plans."""
    from te_fuser.kernels import triton as tk
    from te_fuser.kernels.triton import cast

    x = torch.randn(rows_n, cols_n, device="cuda").bfloat16()
    n, label, out = x.numel(), f"{rows_n}x{cols_n} bf16", []
    saved = dict(cast.CAST_PLANS)
    scale = torch.tensor(0.5, device="cuda")
    try:
        for plan in FLAT_PLANS:
            cast.CAST_PLANS["flat"] = cast.CastPlan(*plan)
            cases = (("amax pass", _amax_pass(x), 2 * n), ("current", lambda t: tk.quantize_current(t, E4M3), 3 * n),
                     ("tensorwise", lambda t: tk.quantize_tensorwise(t, scale, E4M3), 3 * n))
            for name, fn, nbytes in cases:
                ms = harness.time_ms(fn, [(x,)])
                tbs = nbytes / (ms * 1e-3) / 1e12
                out.append(harness.progress(Row("cast-sweep", f"{name} flat {plan}", "triton", label, ms, tbs,
                                                "TB/s", tbs / copy_tbs)))
        for plan in TRANSPOSE_PLANS:
            cast.CAST_PLANS["transpose"] = cast.CastPlan(*plan)
            ms = harness.time_ms(lambda t: tk.quantize_tensorwise(t, scale, E4M3, True, True), [(x,)])
            tbs = 4 * n / (ms * 1e-3) / 1e12
            out.append(harness.progress(Row("cast-sweep", f"tensorwise+T {plan}", "triton", label, ms, tbs, "TB/s",
                                            tbs / copy_tbs)))
            ms = harness.time_ms(lambda t: tk.quantize_current(t, E4M3, rowwise=True, columnwise=True), [(x,)])
            tbs = 4 * n / (ms * 1e-3) / 1e12
            out.append(harness.progress(Row("cast-sweep", f"current+T {plan}", "triton", label, ms, tbs, "TB/s",
                                            tbs / copy_tbs)))
    finally:
        cast.CAST_PLANS.update(saved)
    return out


def bench_bias_grad(copy_tbs: float, rows_n: int = 16384, cols_n: int = 7168) -> list[Row]:
    """A linear's output gradient under current scaling, as its backward needs it: the
    bias gradient (column sums) and the cast with the transposed copy. Separate:
    torch's column sum, then the two-pass cast (three reads of dy). Fused: one
    ``amax_column_sums`` read, then the cast pass with that amax (two reads)."""
    from te_fuser import backend

    x = (torch.randn(rows_n, cols_n, device="cuda") - 0.3).bfloat16()
    e5m2 = torch.float8_e5m2
    cast = backend.resolve("quantize_current", x.device).fn
    fused_sums = backend.resolve("amax_column_sums", x.device).fn
    label = f"{rows_n}x{cols_n} bf16"
    n = x.numel()

    def column_sums():
        x.sum(dim=0, dtype=torch.float32)

    def separate():
        x.sum(dim=0, dtype=torch.float32)
        cast(x, e5m2, False, 0.0, True, True)

    def fused():
        amax, _ = fused_sums(x)
        cast(x, e5m2, False, 0.0, True, True, amax)

    times = {name: harness.time_ms(fn) for name, fn in
             (("sums", column_sums), ("amax_sums", lambda: fused_sums(x)), ("separate", separate), ("fused", fused))}
    out = []
    for case, key, logical in (("bias grad: torch column sum", "sums", 2 * n),
                               (f"bias grad + amax: amax_column_sums ({backend.resolve('amax_column_sums', x.device).backend})",
                                "amax_sums", 2 * n),
                               ("dy cast+T + bias grad, separate (3 reads)", "separate", 4 * n),
                               ("dy cast+T + bias grad, fused (2 reads)", "fused", 4 * n)):
        tbs = logical / (times[key] * 1e-3) / 1e12
        row = Row("cast", case, "auto", label, times[key], tbs, "TB/s", tbs / copy_tbs)
        if key == "fused":
            row.vs_peer, row.peer = times["separate"] / times["fused"], "separate"
        out.append(harness.progress(row))
    return out + bench_bias_grad_delayed(x, copy_tbs, label)


def bench_bias_grad_delayed(x: torch.Tensor, copy_tbs: float, label: str) -> list[Row]:
    """The same under delayed scaling: separate, torch's column sum then the one-pass
    cast (two reads of dy); fused, ``quantize_tensorwise_column_sums`` (one read)."""
    from te_fuser import backend

    e5m2 = torch.float8_e5m2
    scale = torch.tensor(0.5, device=x.device)
    cast = backend.resolve("quantize_tensorwise", x.device)
    fused_cast = backend.resolve("quantize_tensorwise_column_sums", x.device)
    n = x.numel()

    def separate():
        x.sum(dim=0, dtype=torch.float32)
        cast.fn(x, scale, e5m2, True, True)

    fused_triton = backend.resolve("quantize_tensorwise_column_sums", x.device, backend="triton")
    times = {"cast": harness.time_ms(lambda: cast.fn(x, scale, e5m2, True, True)),
             "separate": harness.time_ms(separate),
             "fused": harness.time_ms(lambda: fused_cast.fn(x, scale, e5m2, True, True)),
             "fused_triton": harness.time_ms(lambda: fused_triton.fn(x, scale, e5m2, True, True))}
    out = []
    for case, key, logical in ((f"delayed: dy cast+T alone ({cast.backend})", "cast", 2 * n),
                               (f"delayed: dy cast+T + bias grad, separate ({cast.backend} + torch, 2 reads)",
                                "separate", 3 * n),
                               (f"delayed: dy cast+T + bias grad, fused ({fused_cast.backend}, 1 read)", "fused",
                                2 * n),
                               ("delayed: dy cast+T + bias grad, fused (triton, 1 read)", "fused_triton", 2 * n)):
        tbs = logical / (times[key] * 1e-3) / 1e12
        row = Row("cast", case, "auto", label, times[key], tbs, "TB/s", tbs / copy_tbs)
        if key.startswith("fused"):
            row.vs_peer, row.peer = times["separate"] / times[key], "separate"
        out.append(harness.progress(row))
    return out


def sweep_column_sums(copy_tbs: float, rows_n: int = 16384, cols_n: int = 7168) -> list[Row]:
    """``amax_column_sums`` under several launch plans, each checked against torch
    (the amax bit for bit, the sums within 1e-5 of the largest) before it is timed."""
    from te_fuser.kernels.triton import cast as tcast

    x = (torch.randn(rows_n, cols_n, device="cuda") - 0.3).bfloat16()
    amax_ref, sums_ref = x.float().abs().amax(), x.double().sum(dim=0)
    label = f"{rows_n}x{cols_n} bf16"
    default = tcast.CAST_PLANS["column_sums"]
    out = []
    try:
        for bm, bn, warps, per_sm in ((32, 128, 4, 4), (64, 128, 8, 4), (32, 256, 8, 4), (16, 256, 4, 8),
                                      (64, 64, 4, 8), (32, 128, 4, 8), (128, 128, 8, 2), (32, 512, 8, 2)):
            tcast.CAST_PLANS["column_sums"] = tcast.CastPlan(bm, bn, warps, per_sm)
            amax, sums = tcast.amax_column_sums(x)
            worst = ((sums.double() - sums_ref).abs().max() / sums_ref.abs().max()).item()
            ok = torch.equal(amax, amax_ref) and worst < 1e-5
            ms = harness.time_ms(lambda: tcast.amax_column_sums(x))
            tbs = 2 * x.numel() / (ms * 1e-3) / 1e12
            out.append(harness.progress(Row("cast-sweep", f"amax_column_sums {bm}x{bn} w{warps} {per_sm}/SM", "triton",
                                            label, ms, tbs, "TB/s", tbs / copy_tbs,
                                            note=("ok" if ok else "WRONG") + f", sums off by {worst:.1e}")))
    finally:
        tcast.CAST_PLANS["column_sums"] = default
    return out


def bench_gradient_casts(copy_tbs: float, shapes: list[tuple[int, int]]) -> list[Row]:
    """The CUDA casts of a linear's output gradient with its transposed copy, with and
    without the bias gradient (column sums), under both tensor scalings, in one
    cooperative launch and in separate launches: GPU time from CUDA graphs, over
    inputs larger than L2. Before timing, each column-sums cast is checked: the same
    bits in one launch as in separate launches, and sums within 1e-5 (of the
    largest) of float64's."""
    from te_fuser.kernels import cuda as kcuda

    e5m2 = torch.float8_e5m2
    out = []
    for rows_n, cols_n in shapes:
        label = f"{rows_n}x{cols_n} bf16"
        n = rows_n * cols_n
        inputs = harness.rotation(lambda: ((torch.randn(rows_n, cols_n, device="cuda") - 0.3).bfloat16(),), 2 * n)
        scale = torch.tensor(0.5, device="cuda")
        cases = {
            "delayed cast+T": lambda x: kcuda.quantize_tensorwise(x, scale, e5m2, True, True),
            "delayed cast+T + bias grad": lambda x: kcuda.quantize_tensorwise_column_sums(x, scale, e5m2, True, True),
            "current cast+T": lambda x: kcuda.quantize_current(x, e5m2, columnwise=True),
            "current cast+T + bias grad": lambda x: kcuda.quantize_current_column_sums(x, e5m2, columnwise=True),
        }
        x0 = inputs[0][0]
        reference = x0.double().sum(dim=0)
        for case, fn in cases.items():
            times, results = {}, {}
            for one_launch in (True, False):
                previous = kcuda.set_one_launch_casts(one_launch)
                try:
                    results[one_launch] = fn(x0)
                    times[one_launch] = harness.graph_time_ms(fn, inputs)
                finally:
                    kcuda.set_one_launch_casts(previous)
            note = ""
            if case.endswith("bias grad"):
                same = all(torch.equal(a.view(torch.uint8) if a.dtype == e5m2 else a,
                                       b.view(torch.uint8) if b.dtype == e5m2 else b)
                           for a, b in zip(results[True], results[False]) if a is not None)
                sums = results[True][-1].double()
                worst = ((sums - reference).abs().max() / reference.abs().max()).item()
                note = ("same bits" if same else "BITS DIFFER") + f" both ways, sums off by {worst:.1e}"
            reads = 2 if case.startswith("current") else 1
            logical = reads * 2 * n + 2 * n  # bf16 reads, two FP8 copies written
            for one_launch in (True, False):
                ms = times[one_launch]
                tbs = logical / (ms * 1e-3) / 1e12
                row = Row("cast-graph", f"{case}, {'one launch' if one_launch else 'separate launches'}", "cuda",
                          label, ms, tbs, "TB/s", tbs / copy_tbs, note=note)
                if one_launch:
                    row.vs_peer, row.peer = times[False] / ms, "separate launches"
                out.append(harness.progress(row))
    return out


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--shapes", nargs="+", default=["8192x8192", "16384x8192", "256x1024"])
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton casts under several launch plans")
    parser.add_argument("--bias-grad", action="store_true",
                        help="only the output gradient's cast with its bias gradient, separate and fused")
    parser.add_argument("--gradient-casts", nargs="*", metavar="RxC", default=None,
                        help="only the CUDA output-gradient casts with and without the bias gradient, one launch and "
                             "separate, GPU time (default shapes: the yardstick GPT's 16384x1024 16384x4096)")
    args = parser.parse_args(argv)
    if args.gradient_casts is not None:
        shapes = [tuple(int(v) for v in text.split("x")) for text in (args.gradient_casts or
                                                                      ["16384x1024", "16384x4096"])]
        rows = bench_gradient_casts(harness.copy_ceiling_tbs(), shapes)
        harness.append_csv(rows, args.csv)
        harness.print_table(rows, "the output gradient's casts, with and without its bias gradient")
        return rows
    if args.bias_grad:
        copy_tbs = harness.copy_ceiling_tbs()
        rows = bench_bias_grad(copy_tbs)
        if args.sweep:
            rows += sweep_column_sums(copy_tbs)
        harness.append_csv(rows, args.csv)
        harness.print_table(rows, "bias gradient with the gradient's cast")
        return rows
    backends = args.backends or _default_backends()
    copy_tbs = harness.copy_ceiling_tbs()
    rows = [harness.progress(Row("cast", "device copy", "torch", "1 GiB", float("nan"), copy_tbs, "TB/s", 1.0))]
    for text in args.shapes:
        rows += bench_shape(tuple(int(v) for v in text.split("x")), backends, copy_tbs)
    if args.sweep:
        rows += sweep(copy_tbs)
    harness.append_csv(rows, args.csv)
    harness.print_table(rows, "FP8 casts")
    print_encoding_table(rows)
    return rows


def _default_backends() -> list[str]:
    """triton, triton-exact (the exact FP8 encoding), then cuda and auto when available."""
    backends = harness.default_backends("quantize_current")
    return backends[:1] + ["triton-exact"] + backends[1:]


if __name__ == "__main__":
    main()
