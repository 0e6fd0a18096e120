"""Where the attention kernels' time goes, from the GPU's hardware counters (Nsight Compute).

Timing variants tells how long a kernel takes, not what holds it back. This runs
one call of each attention path under ``ncu`` and condenses its report: per kernel
the duration, the SM's and memory's throughput against peak, achieved occupancy,
registers, the issue slots used, the warps' stall reasons (cycles a warp waited
per instruction it issued, by reason) and the pipes' utilization (tensor, FMA,
ALU, the XU that runs ``ex2`` and conversions, ...). The targets, each at one case
of ``bench_attention.CASES`` (default the main one, 4x16x4096x128 causal):

- ``fp8fwd``: our Hopper FP8 forward (``kernels/cuda/attention_kernels.cu``), with
  the kernel that writes V transposed (``v_keys_inner_kernel``) before it;
- ``hpfwd``: our Hopper bf16 forward (``attention_hp_kernels.cu``);
- ``cudnnfwd`` / ``cudnnbwd``: SDPA's cuDNN kernels, the yardstick;
- ``bwd``: Triton's two-kernel backward (dq's kernel, then dk / dv's);
- ``hpbwd``: our Hopper backward (``attention_hp_kernels.cu``: delta, the dk / dv
  kernel that adds dq, dq's store); ``hpdkdv``: its dk / dv kernel without dq.

    python benchmarks/ncu_attention.py [--targets fp8fwd ...] [--case main] [--out DIR] [--source]

Each target is a child process (``--launch TARGET``) that warms the path up, then
runs one call between ``cudaProfilerStart`` and ``cudaProfilerStop``; ``ncu``
(``--profile-from-start off``, ``--clock-control none``: the clocks as they are)
profiles the kernels of that call into ``DIR/TARGET.ncu-rep``, then exports its
details as ``DIR/TARGET.csv``, which :func:`summarize` reads. ``--source`` asks for
the warps' stall samples of each machine instruction instead (``DIR/TARGET-source.csv``,
read by :func:`summarize_source`): where a kernel's warps wait, by instruction, opcode
and reason. Where the counters cannot be read (a runtime without them) ``ncu``'s
message is printed instead.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

TARGETS = ("fp8fwd", "hpfwd", "cudnnfwd", "bwd", "cudnnbwd", "hpbwd", "hpdkdv")
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis", "WarpStateStats",
            "MemoryWorkloadAnalysis")
SOURCE_SECTIONS = ("WarpStateStats", "SourceCounters")  # the stall samples of each SASS instruction
# Raw counters beside the sections: every stall reason and every pipe's utilization
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
PEAK = ".avg.pct_of_peak_sustained_active"
# (prefix, suffix, label) of the pipes' figures: instructions issued to a pipe, and
# the cycles a pipe was busy (the tensor pipe's products take many cycles each)
PIPES = (("sm__inst_executed_pipe_", PEAK, "inst"), ("sm__pipe_", "_cycles_active" + PEAK, "cycles"))
METRICS = tuple(f"regex:^{re.escape(prefix)}.*{re.escape(suffix)}$"
                for prefix, suffix in ((STALL_PREFIX, STALL_SUFFIX), *((p, s) for p, s, _ in PIPES)))
# The sections' figures a summary line shows, by their names in the report
SHOWN = {"Duration": "duration", "Compute (SM) Throughput": "SM %", "Memory Throughput": "memory %",
         "Achieved Occupancy": "occupancy %", "Registers Per Thread": "registers", "Issue Slots Busy": "issue %",
         "Warp Cycles Per Issued Instruction": "cycles / issue"}


def ncu_command(ncu: str, target: str, case: str, report: Path, counters: bool = True,
                source: bool = False) -> list[str]:
    """``ncu`` over one child launching ``target`` at ``case``, its report at ``report``
    (``.ncu-rep`` added); ``counters``: the raw stall and pipe counters too;
    ``source``: instead, the warps' stall samples per machine instruction."""
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--force-overwrite", "--export", str(report)]
    for section in SOURCE_SECTIONS if source else SECTIONS:
        cmd += ["--section", section]
    if counters and not source:
        cmd += ["--metrics", ",".join(METRICS)]
    return cmd + [sys.executable, str(Path(__file__).resolve()), "--launch", target, "--case", case]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return math.nan


def summarize(csv_text: str) -> list[dict]:
    """Per kernel of an ``ncu --csv --page details`` export, in launch order:
    ``{"kernel", "shown": {label: (value, unit)}, "stalls": [(reason, cycles)],
    "pipes": [(pipe, percent)]}``, stalls and pipes largest first."""
    kernels: dict = {}
    lines = csv_text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), len(lines))  # past ==PROF== lines
    for row in csv.DictReader(lines[header:]):
        metric = row.get("Metric Name", "")
        if not metric:
            continue
        k = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"], "shown": {}, "stalls": [], "pipes": []})
        value, unit = _number(row.get("Metric Value", "")), row.get("Metric Unit", "")
        if metric in SHOWN:
            k["shown"][SHOWN[metric]] = (value, unit)
        elif metric.startswith(STALL_PREFIX) and metric.endswith(STALL_SUFFIX):
            k["stalls"].append((metric[len(STALL_PREFIX):-len(STALL_SUFFIX)], value))
        else:
            for prefix, suffix, label in PIPES:
                if metric.startswith(prefix) and metric.endswith(suffix):
                    k["pipes"].append((f"{metric[len(prefix):-len(suffix)]} ({label})", value))
                    break
    out = [kernels[i] for i in sorted(kernels, key=_number)]
    for k in out:
        k["stalls"].sort(key=_largest_first)
        k["pipes"].sort(key=_largest_first)
    return out


def _largest_first(item: tuple[str, float]) -> float:
    """A sort key: larger values first, a value ncu left out (NaN) after them."""
    return -item[1] if item[1] == item[1] else 0.0


def print_summary(target: str, kernels: list[dict], top: int = 6) -> None:
    for k in kernels:
        name = k["kernel"] if len(k["kernel"]) <= 60 else k["kernel"][:57] + "..."
        shown = ", ".join(f"{label} {value:g}{' ' + unit if unit and unit != '%' else ''}"
                          for label, (value, unit) in k["shown"].items())
        print(f"{target:9s} {name}: {shown}")
        if k["stalls"]:
            print("    stalls (cycles a warp waited per issued instruction): "
                  + ", ".join(f"{reason} {cycles:.2f}" for reason, cycles in k["stalls"][:top]))
        if k["pipes"]:
            print("    pipes (% of peak while active): "
                  + ", ".join(f"{pipe} {pct:.1f}" for pipe, pct in _distinct(k["pipes"])[:top]))


def _distinct(pipes: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """``pipes`` without the aliases of one pipe (Hopper reports the tensor pipe's
    busy cycles under five names, among them the shared pipe's, and the XU's
    under two): of the names with one value, a tensor one, else the shortest."""
    def rank(pipe):
        return not pipe.startswith("tensor"), len(pipe)

    by_value: dict = {}
    for pipe, pct in pipes:
        if pct not in by_value or rank(pipe) < rank(by_value[pct]):
            by_value[pct] = pipe
    return [(pipe, pct) for pipe, pct in pipes if by_value.get(pct) == pipe]


def summarize_source(csv_text: str, top: int = 12) -> list[dict]:
    """Per kernel of an ``ncu --csv --page source --print-source sass`` export (a
    ``"Kernel Name"`` line before each kernel's table): ``{"kernel", "samples",
    "reasons": [(reason, share)], "opcodes": [(opcode, share)], "top": [(address,
    instruction, share, [(reason, share of its samples)])]}``, shares of the
    kernel's warp samples, largest first."""
    lines = csv_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    out = []
    for n, start in enumerate(starts):
        kernel = next(csv.reader([lines[start]]))[1]
        rows = list(csv.DictReader(lines[start + 1:starts[n + 1] if n + 1 < len(starts) else len(lines)]))
        samples = [_count(r.get("Warp Stall Sampling (All Samples)", "")) for r in rows]
        total = sum(samples) or 1.0
        reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
        texts = [" ".join(r["Source"].split()) for r in rows]
        ranked = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
        out.append({
            "kernel": kernel, "samples": total,
            "reasons": _shares(((k[len("stall_"):], _count(r[k])) for r in rows for k in reasons), total),
            "opcodes": _shares(((_opcode(t), x) for t, x in zip(texts, samples)), total),
            "top": [(rows[i]["Address"], _with_wait(texts[i], texts[i - 1] if i else ""), samples[i] / total,
                     _shares(((k[len("stall_"):], _count(rows[i][k])) for k in reasons), samples[i] or 1.0)[:2])
                    for i in ranked]})
    return out


def _count(text: str) -> float:
    """A sample count of the export (0 where it shows none)."""
    value = _number(text)
    return value if value == value else 0.0


def _shares(pairs, total: float) -> list[tuple[str, float]]:
    """``(key, count)`` pairs summed per key, as shares of ``total``, largest first."""
    merged: dict = {}
    for key, count in pairs:
        merged[key] = merged.get(key, 0.0) + count
    return sorted(((k, v / total) for k, v in merged.items()), key=_largest_first)


def _opcode(instruction: str) -> str:
    """``@!P0 BRA 0x900`` -> ``BRA``, ``MUFU.EX2 R4, R4`` -> ``MUFU``."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def _with_wait(instruction: str, before: str) -> str:
    """A branch with the instruction before it where that is a wait it loops on (an
    mbarrier's try-wait): the wait names the barrier."""
    if "BRA" in instruction and ("TRYWAIT" in before or "SYNCS" in before):
        return f"{instruction} (after {before})"
    return instruction


def print_source_summary(target: str, kernels: list[dict], top: int = 8) -> None:
    for k in kernels:
        print(f"{target:9s} {k['kernel'][:70]}: {k['samples']:.0f} warp samples")
        print("    by reason: " + ", ".join(f"{r} {v:.1%}" for r, v in k["reasons"][:top]))
        print("    by opcode: " + ", ".join(f"{o} {v:.1%}" for o, v in k["opcodes"][:top]))
        for address, instruction, part, why in k["top"]:
            print(f"    {part:6.1%} {address[-6:]} {instruction[:110]:60s} "
                  + ", ".join(f"{r} {v:.0%}" for r, v in why))


def profile(ncu: str, target: str, case: str, out: Path, source: bool = False) -> list[dict] | None:
    """One target under ncu (without the raw counters where ncu refuses them): its
    kernels' summaries (``source``: per instruction), or None with ncu's message
    printed."""
    report = out / (target + ("-source" if source else ""))
    message = ""
    for counters in (True, False):
        try:
            run = subprocess.run(ncu_command(ncu, target, case, report, counters, source), capture_output=True,
                                 text=True, timeout=150)
        except subprocess.TimeoutExpired:
            message = "no report within 150 s"
            continue
        if run.returncode == 0 and report.with_suffix(".ncu-rep").exists():
            break
        message = (run.stdout + run.stderr)[-1500:]
    else:
        print(f"{target}: ncu failed: {message}")
        return None
    page = ["--page", "source", "--print-source", "sass"] if source else ["--page", "details"]
    exported = subprocess.run([ncu, "--import", str(report.with_suffix(".ncu-rep")), "--csv", *page],
                              capture_output=True, text=True, timeout=120)
    report.with_suffix(".csv").write_text(exported.stdout)
    if exported.returncode != 0:
        print(f"{target}: ncu --import failed:\n{exported.stderr[-1500:]}")
        return None
    return summarize_source(exported.stdout) if source else summarize(exported.stdout)


def _call(target: str, case: str, device: str = "cuda"):
    """The call ``target`` profiles at ``case``, its inputs made (bf16 q, k, v on ``device``)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_attention as ba

    from te_fuser.kernels import triton as tk

    cuda_attn = ba.cuda_attn
    B, H, Hkv, T, D, causal = ba.CASES[case]
    scale = 1 / math.sqrt(D)
    q, k, v = (torch.randn(B, h, T, D, device=device, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    do = torch.randn_like(q)
    if target == "fp8fwd":
        (q8, qsi), (k8, ksi), (v8, vsi) = ba._fp8(q), ba._fp8(k), ba._fp8(v)
        reason = cuda_attn.attention_forward_fp8_unsupported_reason(q8, k8)
        if reason is not None:
            raise SystemExit(f"ncu_attention: fp8fwd: {reason}")
        p_scale = torch.tensor(448.0, device=device)
        return lambda: cuda_attn.attention_forward_fp8(q8, k8, v8, qsi, ksi, vsi, p_scale, causal, scale,
                                                       torch.bfloat16)
    if target == "hpfwd":
        reason = cuda_attn.attention_forward_hopper_unsupported_reason(q, k)
        if reason is not None:
            raise SystemExit(f"ncu_attention: hpfwd: {reason}")
        return lambda: cuda_attn.attention_forward_hopper(q, k, v, causal, scale)
    if target == "cudnnfwd":
        return lambda: ba._sdpa(q, k, v, causal, "cudnn")
    if target == "cudnnbwd":
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        o = ba._sdpa(qg, kg, vg, causal, "cudnn")
        return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    o, lse = tk.attention_forward(q, k, v, causal, scale)
    if target in ("hpbwd", "hpdkdv"):
        reason = cuda_attn.attention_forward_hopper_unsupported_reason(q, k)
        if reason is not None:
            raise SystemExit(f"ncu_attention: {target}: {reason}")
        if target == "hpbwd":
            return lambda: cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, causal, scale)
        delta = (o.float() * do.float()).sum(-1)
        return lambda: cuda_attn.attention_dkdv_hopper(q, k, v, o, lse, do, causal, scale, delta=delta)
    return lambda: tk.attention_backward(q, k, v, o, lse, do, causal, scale)


def launch(target: str, case: str) -> None:
    """The child ncu runs: two calls to warm up (compilation, plans), then one call
    between cudaProfilerStart and cudaProfilerStop, the only kernels profiled."""
    import torch

    call = _call(target, case)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _ncu() -> str | None:
    """The ncu on the PATH, else one of the CUDA toolkit's or Nsight Compute's own."""
    found = shutil.which("ncu")
    if found:
        return found
    installed = sorted(Path("/usr/local").glob("cuda*/bin/ncu")) + sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))
    return str(installed[-1]) if installed else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--case", default="main", help="a case of bench_attention.CASES")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/ncu"), help="where the reports and CSVs go")
    p.add_argument("--launch", choices=TARGETS, help=argparse.SUPPRESS)  # the child ncu runs
    p.add_argument("--summarize", type=Path, nargs="+", metavar="CSV",
                   help="print the summary of exported reports (TARGET.csv) instead of profiling")
    p.add_argument("--source", action="store_true",
                   help="the warps' stall samples per machine instruction instead (ncu's SourceCounters)")
    args = p.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            text = path.read_text()
            if text.lstrip().startswith('"Kernel Name"'):  # a source page
                print_source_summary(path.stem, summarize_source(text))
            else:
                print_summary(path.stem, summarize(text))
        return
    import torch

    if not torch.cuda.is_available():
        print("ncu_attention needs a GPU")
        return
    if args.launch:
        launch(args.launch, args.case)
        return
    ncu = _ncu()
    if ncu is None:
        print("ncu_attention: ncu (Nsight Compute) is not installed here")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for target in args.targets:
        kernels = profile(ncu, target, args.case, args.out, args.source)
        if kernels is not None:
            (print_source_summary if args.source else print_summary)(target, kernels)


if __name__ == "__main__":
    main()
