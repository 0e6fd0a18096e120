"""Measure each kernel on every backend that has it and rewrite kernels/auto_table.json.

The ``auto`` backend uses that table on a GPU ({kernel: fastest backend}). Run
this on the GPU the table is for (an H200 for the shipped one):

    python benchmarks/tune_auto.py                 # measure, print, rewrite the table
    python benchmarks/tune_auto.py --dry-run       # measure and print only
    python benchmarks/tune_auto.py --csv out.csv   # also append the rows to a CSV

Timings are medians of ``triton.testing.do_bench`` (L2 flushed before every
run). Casts report logical bandwidth (each input read once, each output written
once) and, against a device-to-device copy measured here, the fraction of the
copy's bandwidth; current scaling also against its two-pass floor (x read
twice). GEMMs report TFLOP/s beside bf16 ``torch.matmul`` and plain
``torch._scaled_mm``. Every size list includes a small, CPU-bound shape.
Kernels not measured here keep ``triton`` in the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "kernels" / "auto_table.json"
BACKENDS = ("reference", "triton", "cuda")
CAST_SHAPES = ((1024, 1024), (8192, 8192))
GEMM_SIZES = (1024, 4096, 8192)


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, default=TABLE, help="table to rewrite (default: kernels/auto_table.json)")
    parser.add_argument("--dry-run", action="store_true", help="measure and print, leave the table alone")
    parser.add_argument("--csv", type=Path, help="append one row per measurement to this CSV")
    return parser.parse_args(argv)


class Bench:
    """Times callables and keeps the rows."""

    def __init__(self):
        import torch
        import triton

        self.torch, self.triton = torch, triton
        self.rows: list[dict] = []
        self.copy_bw = self._copy_bandwidth()

    def time_ms(self, fn) -> float:
        return float(self.triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def _copy_bandwidth(self) -> float:
        src = self.torch.randn(2**28, device="cuda")  # 1 GiB
        dst = self.torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * src.numel() * 4 / (ms * 1e-3)

    def add(self, kind, kernel, backend, shape, ms, metric, unit, note=""):
        row = dict(kind=kind, kernel=kernel, backend=backend, shape=shape, ms=ms, metric=metric, unit=unit, note=note)
        self.rows.append(row)
        print("[tune_auto]", _format(row), flush=True)


def _backends():
    modules = {}
    for name in BACKENDS:
        try:
            modules[name] = importlib.import_module(f"te_fuser.kernels.{name}")
        except Exception as err:  # a backend that cannot load here is simply not measured
            print(f"[tune_auto] backend {name} unavailable: {err}", file=sys.stderr)
    return modules


def _kernel(modules, backend, kernel):
    suffix = "_reference" if backend == "reference" else ""
    return getattr(modules.get(backend), kernel + suffix, None) if backend in modules else None


def _cast_cases(torch, x):
    """(kernel name, call(fn), bytes moved, label) for each timed cast."""
    e4m3 = torch.float8_e4m3fn
    n = x.numel()
    read, fp8 = n * x.element_size(), n
    scale = torch.tensor(1.5, device="cuda")
    slot = torch.zeros(4, device="cuda")[1]
    return [
        ("quantize_current", lambda f: f(x, e4m3), read + fp8, "rowwise"),
        ("quantize_current", lambda f: f(x, e4m3, rowwise=True, columnwise=True), read + 2 * fp8, "row+col"),
        ("quantize_tensorwise", lambda f: f(x, scale, e4m3, amax_out=slot), read + fp8, "rowwise+amax"),
        ("quantize_tensorwise", lambda f: f(x, scale, e4m3, rowwise=True, columnwise=True, amax_out=slot),
         read + 2 * fp8, "row+col+amax"),  # fmt: skip
        ("quantize_rowwise", lambda f: f(x, e4m3), read + fp8 + 4 * x.shape[0], "rowwise"),
        ("quantize_mxfp8", lambda f: f(x, e4m3), read + fp8 + n // 32, "rowwise"),
    ]


def bench_casts(bench: Bench, modules) -> dict:
    torch = bench.torch
    totals: dict = {}
    for rows, cols in CAST_SHAPES:
        x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
        for kernel, call, nbytes, label in _cast_cases(torch, x):
            for backend in BACKENDS:
                fn = _kernel(modules, backend, kernel)
                if fn is None:
                    continue
                try:
                    ms = bench.time_ms(lambda: call(fn))
                except Exception as err:  # report and go on: one failing variant must not stop the table
                    print(f"[tune_auto] {kernel} {backend} {rows}x{cols} failed: {err}", file=sys.stderr)
                    continue
                gbs = nbytes / (ms * 1e-3) / 1e9
                note = f"{label}; {100 * gbs * 1e9 / bench.copy_bw:.0f}% of copy"
                if kernel == "quantize_current":
                    floor_ms = (nbytes + x.numel() * x.element_size()) / bench.copy_bw * 1e3
                    note += f"; {100 * floor_ms / ms:.0f}% of two-pass floor"
                bench.add("cast", kernel, backend, f"{rows}x{cols} bf16", ms, gbs, "GB/s", note)
                totals.setdefault(kernel, {}).setdefault(backend, 0.0)
                totals[kernel][backend] += ms
    return totals


def _gemm_operands(torch, ref, scaling_a, scaling_b, m, k, n):
    """bf16 x (M, K), w (N, K) and their FP8 operands quantized by the reference casts."""
    from te_fuser.kernels.operand import ScaledOperand

    e4m3 = torch.float8_e4m3fn
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)

    def quantize(t, scaling):
        if scaling == "tensor":
            data, _, _, scale_inv, _ = ref.quantize_current_reference(t, e4m3)
            return ScaledOperand(data, scale_inv, "tensor")
        if scaling == "row":
            return ref.quantize_rowwise_reference(t, e4m3)
        return ref.quantize_block_reference(t, e4m3, tile_rows=1 if scaling == "block_1x128" else 128)

    return x, w, quantize(x, scaling_a), quantize(w, scaling_b)


def bench_gemms(bench: Bench, modules) -> dict:
    torch = bench.torch
    ref = modules["reference"]
    totals: dict = {}
    pairs = [("tensor", "tensor"), ("row", "row"), ("block_1x128", "block_128x128")]
    for size in GEMM_SIZES:
        m = k = n = size
        flops = 2.0 * m * k * n
        shape = f"{m}x{k}x{n}"
        for pair in pairs:
            x, w, a, b = _gemm_operands(torch, ref, *pair, m, k, n)
            if pair == ("tensor", "tensor"):
                ms = bench.time_ms(lambda: torch.matmul(x, w.t()))
                bench.add("gemm", "bf16 torch.matmul", "torch", shape, ms, flops / ms / 1e9, "TFLOP/s", "peer")
                for fast in (False, True):
                    run = lambda: torch._scaled_mm(a.data, b.data.t(), a.scale_inv, b.scale_inv,  # noqa: E731
                                                   out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip
                    ms = bench.time_ms(run)
                    bench.add("gemm", "torch._scaled_mm tensorwise", "torch", shape, ms, flops / ms / 1e9, "TFLOP/s",
                              f"peer; use_fast_accum={fast}")  # fmt: skip
            for backend in BACKENDS:
                fn = _kernel(modules, backend, "gemm")
                if fn is None or (backend == "reference" and size > 4096):
                    continue
                note = f"{pair[0]} x {pair[1]}, bf16 out"
                if backend == "cuda":
                    reason = modules["cuda"].gemm_unsupported_reason(a, b)
                    note += f"; reference fallback: {reason}" if reason else ""
                try:
                    ms = bench.time_ms(lambda: fn(a, b))
                except Exception as err:  # report and go on: one failing variant must not stop the table
                    print(f"[tune_auto] gemm {pair} {backend} {shape} failed: {err}", file=sys.stderr)
                    continue
                bench.add("gemm", f"gemm {pair[0]}x{pair[1]}", backend, shape, ms, flops / ms / 1e9, "TFLOP/s", note)
                if pair == ("tensor", "tensor") and size >= 4096 and backend != "reference":
                    totals.setdefault(backend, 0.0)
                    totals[backend] += ms
    return {"gemm": totals} if totals else {}


def bench_epilogue(bench: Bench, modules) -> None:
    torch = bench.torch
    size = 4096
    x, w, a, b = _gemm_operands(torch, modules["reference"], "tensor", "tensor", size, size, size)
    bias = torch.randn(size, device="cuda").to(torch.bfloat16)
    residual = torch.randn(size, size, device="cuda").to(torch.bfloat16)
    flops = 2.0 * size**3
    for backend in ("triton", "cuda"):
        fn = _kernel(modules, backend, "gemm")
        if fn is None:
            continue
        ms = bench.time_ms(lambda: fn(a, b, torch.bfloat16, bias=bias, activation="gelu", residual=residual))
        bench.add("gemm", "gemm tensor + bias+gelu+residual", backend, f"{size}^3", ms, flops / ms / 1e9, "TFLOP/s")


def choose(totals: dict, kernels, previous: dict | None = None) -> dict:
    """The fastest backend per kernel; entries of ``previous`` that split by size
    (measured at a small and a large shape, see te_fuser/backend.py) are kept, and
    so is the entry of a kernel this script does not measure (attention, the
    state updates: chosen by their own benchmarks)."""
    table = {}
    for kernel in kernels:
        if isinstance((previous or {}).get(kernel), dict):
            table[kernel] = previous[kernel]
            continue
        measured = totals.get(kernel, {})
        table[kernel] = min(measured, key=measured.get) if measured else (previous or {}).get(kernel, "triton")
    return table


def _format(r: dict) -> str:
    return (f"{r['kind']:5} {r['kernel']:36} {r['backend']:9} {r['shape']:18} {r['ms']:9.4f} "
            f"{r['metric']:8.1f} {r['unit']:7} {r['note']}")  # fmt: skip


def print_table(bench: Bench, table: dict) -> None:
    print(f"\ndevice copy: {bench.copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'kind':5} {'kernel':36} {'backend':9} {'shape':18} {'ms':>9} {'rate':>10}  note")
    for row in bench.rows:
        print(_format(row))
    print("\nauto table:", json.dumps(table, sort_keys=True))


def write_csv(path: Path, bench: Bench) -> None:
    torch, triton = bench.torch, bench.triton
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version())  # fmt: skip
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(meta) + list(bench.rows[0]))
        if new:
            writer.writeheader()
        for row in bench.rows:
            writer.writerow({**meta, **row})


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tune_auto: needs a CUDA GPU", file=sys.stderr)
        return 2
    from te_fuser.backend import KERNELS

    modules = _backends()
    bench = Bench()
    totals = bench_casts(bench, modules)
    totals.update(bench_gemms(bench, modules))
    bench_epilogue(bench, modules)
    previous = json.loads(args.table.read_text()) if args.table.exists() else {}
    table = choose(totals, KERNELS, previous)
    if args.csv:
        write_csv(args.csv, bench)
    if not args.dry_run:
        args.table.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print_table(bench, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
