"""#14's table from one or more runs of ``examples/train_gpt.py`` (their ``--json``
reports), each run a process of its own, so that the ratios come with their spread.

    python benchmarks/gpt_table.py RUN.json [RUN.json ...]

te's eager step is bound by its host, and the host's speed moves between processes
and within one (runs 159-167: te's step alone 24-37 ms, the GPU-bound twins within
2%), so one run's ratio is one sample. Per phase of te's schedule, each run's
tokens/s of every arm and te's ratio to each peer (none for the compiled peers'
first phase, which compiles), then the median over the runs,
then #14's targets (te bf16 >= 0.95x the eager twin; te FP8 >= 1.3x the eager twin
and >= 1.15x torchao) met in how many runs and by the median. The peers keep their
own numerics in every phase (torchao float8, the others bf16), so a phase's ratio
compares te's numerics of that phase with each peer's. Last, te's validation bpb
(under its recipe / in bf16) per run: a tree trains the same bits in every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PEERS = ("torch", "compiled", "torchao")
COMPILING = ("compiled", "torchao")  # their first phase includes torch.compile's work: not a rate to compare
# phase kind -> (peer, the least te / peer) of #14
TARGETS = {"bf16": (("torch", 0.95),), "fp8": (("torch", 1.3), ("torchao", 1.15))}


def load(paths: list[str]) -> list[dict]:
    """The reports, each with the path it came from; a report without a te arm is refused."""
    runs = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        if "te" not in report.get("arms", {}):
            raise ValueError(f"{path}: no te arm in this report (train_gpt.py --json with the te arm)")
        report["path"] = str(path)
        runs.append(report)
    return runs


def phase_rates(report: dict) -> list[tuple[str, dict]]:
    """``[(phase name, {arm: tokens/s or None})]`` in te's schedule order; None for
    an arm without the phase and for a compiled peer's first phase (compiling)."""
    arms = report["arms"]
    out = []
    for i, te_phase in enumerate(arms["te"]["phases"]):
        rates = {"te": te_phase.get("tokens_per_s")}
        for peer in PEERS:
            phases = arms.get(peer, {}).get("phases", [])
            rates[peer] = phases[i].get("tokens_per_s") if i < len(phases) and not (
                i == 0 and peer in COMPILING) else None
        out.append((te_phase["phase"], rates))
    return out


def ratios(rates: dict) -> dict:
    """te / each peer, where both have a rate (a compiling phase's counts too, as the report has it)."""
    te = rates["te"]
    return {peer: (te / rates[peer] if te and rates.get(peer) else None) for peer in PEERS}


def _kind(name: str) -> str:
    return "bf16" if name == "bf16" else "fp8"


def table(runs: list[dict]) -> list[str]:
    """The lines of the table (see the module docstring)."""
    lines = []
    head = f"{'phase':<10} {'run':<6} {'te k/s':>8} " + " ".join(f"{p + ' k/s':>13}" for p in PEERS) + " " + \
        " ".join(f"{'te/' + p:>11}" for p in PEERS)
    lines.append(head)
    per_run = [phase_rates(r) for r in runs]
    names = [name for name, _ in per_run[0]]
    for i, name in enumerate(names):
        samples = {peer: [] for peer in PEERS}
        for r, phases in enumerate(per_run):
            if i >= len(phases) or phases[i][0] != name:
                raise ValueError(f"{runs[r]['path']}: phase {i + 1} is not {name!r}: the runs' schedules differ")
            rates = phases[i][1]
            rs = ratios(rates)
            for peer in PEERS:
                if rs[peer] is not None:
                    samples[peer].append(rs[peer])
            cells = " ".join(f"{_k(rates[p]):>13}" for p in PEERS)
            lines.append(f"{name:<10} {r + 1:<6} {_k(rates['te']):>8} {cells} " +
                         " ".join(f"{_x(rs[p]):>11}" for p in PEERS))
        medians = {p: (statistics.median(v) if v else None) for p, v in samples.items()}
        lines.append(f"{name:<10} {'median':<6} {'':>8} " + " ".join(f"{'':>13}" for _ in PEERS) + " " +
                     " ".join(f"{_x(medians[p]):>11}" for p in PEERS))
        for peer, least in TARGETS[_kind(name)]:
            got = samples[peer]
            if got:
                met = sum(v >= least for v in got)
                lines.append(f"{'':<10} target te/{peer} >= {least}: met in {met} of {len(got)} runs, "
                             f"median {medians[peer]:.2f}x")
    lines.append("")
    lines.append("te's validation bpb (under its recipe / in bf16), per run:")
    for r, report in enumerate(runs):
        cells = []
        for phase in report["arms"]["te"]["phases"]:
            bf16 = phase.get("val_bpb_bf16")
            cells.append(f"{phase['phase']} {phase['val_bpb']:.4f}" + ("" if bf16 is None else f" / {bf16:.4f}"))
        lines.append(f"  run {r + 1} ({Path(report['path']).name}): " + "; ".join(cells))
    bits = {tuple((p["val_bpb"], p.get("val_bpb_bf16")) for p in rep["arms"]["te"]["phases"]) for rep in runs}
    lines.append("  the same bits in every run" if len(bits) == 1 else f"  {len(bits)} different sets of bits")
    return lines


def _k(rate) -> str:
    return "-" if rate is None else f"{rate / 1e3:.1f}"


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="train_gpt.py --json reports, one per run")
    args = p.parse_args(argv)
    try:
        runs = load(args.reports)
        lines = table(runs)
    except (ValueError, KeyError, json.JSONDecodeError) as err:
        p.error(str(err))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
