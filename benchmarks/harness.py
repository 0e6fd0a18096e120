"""The one benchmark harness: timing, ceilings, CSV rows and a table.

- :func:`time_ms`: median time of a CUDA callable through
  ``triton.testing.do_bench`` (CUDA events; the L2 cache is flushed before every
  timed run), cycling through several input sets so that repeated runs never
  find their inputs in the cache.
- :func:`interleaved_ms`: host-bound arms timed taking turns, so a drift of the
  host's speed (the GPU machine's host moves by tens of percent within a minute)
  touches every arm alike.
- :func:`copy_ceiling_tbs`: the device-copy bandwidth measured in this run (bytes
  read plus bytes written), the ceiling of memory-bound kernels.
- :class:`Row`, :func:`append_csv`, :func:`print_table`: every script reports rows
  of (benchmark, case, backend, time, achieved rate, fraction of a ceiling, ratio
  to a peer) and appends them to ``benchmarks/results.csv`` with the device, the
  versions and the date.
"""

from __future__ import annotations

import csv
import datetime
import itertools
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

# Rows go to an untracked file by default; the tracked record (results.csv) takes
# rows only when asked: `python benchmarks/harness.py --record FILE.csv` (e.g. the
# CSV a GPU run brings back) appends the rows it does not hold yet.
RESULTS_CSV = Path(__file__).with_name("out") / "results.csv"
RECORD_CSV = Path(__file__).with_name("results.csv")


def time_ms(fn: Callable[..., object], inputs: Sequence[tuple] = ((),), warmup_ms: int = 25,
            rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn(*inputs[i])`` launched from Python (what an
    eager caller sees: includes the host's launch cost when it exceeds the GPU's
    time), rotating over ``inputs``, L2 flushed before every timed run."""
    import triton.testing

    cycle = itertools.cycle(inputs)

    def call():
        return fn(*next(cycle))

    return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def rounds_ms(arms: dict, rounds: int) -> dict:
    """Per arm, ``rounds`` times of :func:`time_ms` (ms), the arms taking turns round
    by round, so that a drift of the clocks or of the host touches every arm alike."""
    times: dict = {label: [] for label in arms}
    for _ in range(rounds):
        for label, fn in arms.items():
            times[label].append(time_ms(fn))
    return times


def interleaved_ms(arms: dict, rounds: int, steps: int = 1, sync: Callable[[], object] | None = None,
                   warmup: int = 3) -> dict:
    """Per arm, the median over ``rounds`` of the milliseconds per call of
    ``steps`` back-to-back calls, the arms taking turns round by round; ``sync``
    (e.g. ``torch.cuda.synchronize``) runs before and after each arm's calls."""
    import statistics
    import time

    sync = sync or (lambda: None)
    for fn in arms.values():
        for _ in range(warmup):
            fn()
    times: dict = {label: [] for label in arms}
    for _ in range(rounds):
        for label, fn in arms.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            times[label].append((time.perf_counter() - t0) * 1e3 / steps)
    return {label: statistics.median(t) for label, t in times.items()}


def graph_time_ms(fn: Callable[..., object], inputs: Sequence[tuple] = ((),), rep_ms: int = 100) -> float:
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph: the GPU
    time alone, without the host's launch cost. The graph captures one call per
    input set (rotating), and no L2 flush, so use inputs larger than L2."""
    import triton.testing

    cycle = itertools.cycle(inputs)
    fn(*inputs[0])  # compile and allocate outside the capture
    torch.cuda.synchronize()

    def call():
        return fn(*next(cycle))

    return float(triton.testing.do_bench_cudagraph(call, rep=rep_ms, return_mode="median"))


def rotation(make: Callable[[], tuple], bytes_per_set: int, l2_bytes: int | None = None) -> list[tuple]:
    """Enough input sets (from ``make()``) to cover twice the L2 cache, at most 8."""
    l2 = l2_bytes if l2_bytes is not None else _l2_bytes()
    count = max(1, min(8, -(-2 * l2 // max(bytes_per_set, 1))))
    return [make() for _ in range(count)]


def _l2_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20))


def copy_ceiling_tbs(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def matmul_ceiling_tflops(n: int = 8192) -> float:
    """bf16 torch.matmul TFLOP/s at n^3 on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


@dataclass
class Row:
    """One measurement. ``rate`` is in ``unit`` (TB/s or TFLOP/s); ``of_ceiling`` is
    rate / measured ceiling; ``vs_peer`` is peer time / our time (>1: faster)."""

    bench: str
    case: str
    backend: str
    shape: str
    ms: float
    rate: float
    unit: str
    of_ceiling: float | None = None
    vs_peer: float | None = None
    peer: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)


def environment() -> dict:
    import triton

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
    }


def append_csv(rows: Sequence[Row], path: Path | str | None = None) -> Path:
    """Append rows (with device, versions and date) to the results CSV (by default
    ``benchmarks/out/results.csv``, untracked)."""
    path = Path(path) if path is not None else RESULTS_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    records = []
    for row in rows:
        record = {**env, **asdict(row)}
        record.pop("extra")
        record.update({f"x_{k}": v for k, v in row.extra.items()})
        records.append(record)
    if not records:
        return path
    fields = list(records[0])
    for record in records[1:]:
        fields += [k for k in record if k not in fields]
    new_file = not path.exists() or os.path.getsize(path) == 0
    if not new_file:
        with open(path, newline="") as f:
            existing = next(csv.reader(f), [])
        fields = existing + [k for k in fields if k not in existing]
        if fields != existing:  # the header grew: rewrite the file with the wider header
            with open(path, newline="") as f:
                old = list(csv.DictReader(f))
            records = old + records
            new_file = True
    with open(path, "w" if new_file else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        if new_file:
            writer.writeheader()
        writer.writerows(records)
    return path


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


def progress(row: Row) -> Row:
    """Print one row as soon as it is measured (a run cut short still shows it)."""
    rate = "-" if row.rate != row.rate else f"{row.rate:.1f} {row.unit}"
    print(f"  {row.bench:10s} {row.case:40s} {row.backend:12s} {row.shape:16s} {row.ms:9.4f} ms  {rate}"
          f"{'  ' + row.note if row.note else ''}", flush=True)
    return row


def print_table(rows: Sequence[Row], title: str = "") -> None:
    """A fixed-width table of rows, the way RESULTS.md quotes them."""
    header = ("bench", "case", "backend", "shape", "ms", "rate", "unit", "of ceil", "vs peer", "peer")
    table = [header] + [
        (r.bench, r.case, r.backend, r.shape, _fmt(r.ms, 4), _fmt(r.rate), r.unit, _fmt(r.of_ceiling),
         _fmt(r.vs_peer), r.peer)
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    if title:
        print(f"\n== {title}")
    for i, line in enumerate(table):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * width for width in widths))


def print_own_times(prof, steps: int, top: int, indent: str = "  ") -> None:
    """The cProfile ``prof`` of ``steps`` steps: own time per step in all, then the
    ``top`` functions by own time (us per step, calls per step)."""
    import pstats

    stats = pstats.Stats(prof).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values()) / steps * 1e6
    rows = sorted(((tt / steps * 1e6, nc / steps, f"{name} ({file.rsplit('/', 1)[-1]}:{line})")
                   for (file, line, name), (_, nc, tt, _, _) in stats.items()), reverse=True)
    print(f"{indent}profiled: {total:.0f} us of own time per step; the top functions (us per step, calls per step):")
    for us, n, name in rows[:top]:
        print(f"{indent}{us:8.1f} {n:7.1f}  {name}")


def default_backends(kernel: str) -> list[str]:
    """triton, plus cuda when that backend module exposes ``kernel``, plus auto
    (which must never be slower than the best of them beyond noise)."""
    backends = ["triton"]
    try:
        import te_fuser.kernels.cuda as cuda_backend

        if hasattr(cuda_backend, kernel):
            backends.append("cuda")
    except Exception:  # a cuda backend that cannot even be imported is not benchmarked
        pass
    return backends + ["auto"]


class _AutoBackend:
    """The kernels ``auto`` picks on this GPU (``kernels/auto_table.json``, with the
    per-call fallbacks), under their usual names, so ``auto`` benchmarks side by side
    with the single backends."""

    def __getattr__(self, name: str):
        from te_fuser import backend

        if name not in backend.KERNELS:
            raise AttributeError(name)
        return backend.resolve(name, "cuda", backend="auto").fn


class _ExactFP8Triton:
    """The triton backend with the exact FP8 encoding (what ``TE_FUSER_EXACT_FP8=1``
    gives), so that one run times both encodings side by side."""

    def __getattr__(self, name: str):
        from te_fuser.kernels import triton as tk
        from te_fuser.kernels.triton import _common

        fn = getattr(tk, name)

        def exact(*args, **kwargs):
            saved, _common.EXACT_FP8 = _common.EXACT_FP8, True
            try:
                return fn(*args, **kwargs)
            finally:
                _common.EXACT_FP8 = saved

        return exact


def backend_module(name: str):
    """The kernels of a backend: ``reference``, ``triton``, ``cuda``, ``auto``, or
    ``triton-exact`` (triton with the exact FP8 encoding)."""
    import importlib

    if name == "auto":
        return _AutoBackend()
    if name == "triton-exact":
        return _ExactFP8Triton()
    return importlib.import_module(f"te_fuser.kernels.{name}")


def record(source: Path | str, target: Path | str = RECORD_CSV) -> int:
    """Append to the tracked record the rows of ``source`` it does not hold yet
    (widening its header where ``source`` has more columns); returns how many."""
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    target = Path(target)
    old, fields = [], []
    if target.exists() and os.path.getsize(target):
        with open(target, newline="") as f:
            reader = csv.DictReader(f)
            fields, old = list(reader.fieldnames or []), list(reader)
    seen = {tuple(sorted(r.items())) for r in old}
    new = [r for r in rows if tuple(sorted({k: r.get(k, "") for k in fields}.items())) not in seen
           and tuple(sorted(r.items())) not in seen]
    fields += [k for r in new for k in r if k not in fields]
    with open(target, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(old + new)
    return len(new)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="benchmarks/results.csv: the tracked record of benchmark rows")
    parser.add_argument("--record", metavar="CSV", required=True, help="append this CSV's new rows to the record")
    args = parser.parse_args()
    print(f"{record(args.record)} new rows recorded in {RECORD_CSV}")
