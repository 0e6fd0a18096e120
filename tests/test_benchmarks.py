"""The re-fusion benchmark runs on CPU (quick mode) and reports the published figures."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_refusion_quick_runs_and_reports(tmp_path):
    out = tmp_path / "refusion.json"
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_refusion.py", "--quick", "--no-csv", "--device", "cpu",
         "--json", str(out), "--plot", str(tmp_path / "refusion.svg")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.perf_counter() - t0 < 60
    figures = json.loads(out.read_text())
    for key in ("hot_path_us_same_object", "hot_path_us_equal_object", "warm_switch_us"):
        assert set(figures[key]) == {"2", "8", "32", "128"}, key
        assert all(v >= 0 for v in figures[key].values())
    phases = figures["warm_switch_phases_us"]["8"]
    assert {"key", "quantizers", "fusion", "validation", "publish", "total"} <= set(phases)
    svg = (tmp_path / "refusion.svg").read_text()
    assert "measured at 2, 8, 32, 128 ops" in svg and torch.__version__ in svg
    assert (tmp_path / "refusion-switch.svg").exists()


def test_benchmark_rows_go_to_an_untracked_file_and_are_recorded_only_when_asked(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness

    assert harness.RESULTS_CSV.parent.name == "out" and harness.RECORD_CSV.name == "results.csv"
    rows = [harness.Row("t", "case", "b", "s", 1.0, 2.0, "u"), harness.Row("t", "case2", "b", "s", 3.0, 4.0, "u")]
    source = harness.append_csv(rows, tmp_path / "run.csv")
    target = tmp_path / "record.csv"
    assert harness.record(source, target) == 2
    assert harness.record(source, target) == 0  # already held
    assert len(target.read_text().strip().splitlines()) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU they are full benchmarks (run_gpu.sh handoff, launches)")
@pytest.mark.parametrize("script", ["bench_handoff.py", "count_launches.py", "gemm_workspace_ab.py",
                                    "ncu_attention.py", "stages_ab.py", "bench_dequantize.py"])
def test_a_gpu_benchmark_imports_and_asks_for_a_gpu_on_cpu(script):
    run = subprocess.run([sys.executable, f"benchmarks/{script}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs a GPU" in run.stdout


def test_bench_dequantize_looks_the_scale_up_element_by_element_and_puts_the_grids_back():
    """bench_dequantize.py's second arm: the same bits through the block scales'
    lookup, and the scale grid's lookup as it was after the call."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_dequantize
    cast = importlib.import_module("te_fuser.kernels.triton.cast")
    from te_fuser.kernels.operand import ScaledOperand

    op = ScaledOperand((torch.randn(40, 96) * 20).to(torch.float8_e4m3fn), torch.tensor(0.37), "tensor")
    lookup = cast._scale_lookup
    calls = []
    launch = cast.launch
    cast.launch = lambda fn, grid, *a, **kw: (calls.append((kw["TILE_R"], kw["TILE_C"])), launch(fn, grid, *a, **kw))
    try:
        once = cast.dequantize(op, torch.bfloat16)
        looked = bench_dequantize._looked_up(cast, lambda: cast.dequantize(op, torch.bfloat16))()
    finally:
        cast.launch = launch
    assert calls == [(0, 0), (1, 1)]  # the whole tensor, then tiles of one element
    assert torch.equal(once.view(torch.int16), looked.view(torch.int16))
    assert cast._scale_lookup is lookup


def test_forward_items_deals_every_item_once_and_balances_the_causal_list():
    """The model of the persistent forwards' dealing: each way gives every item to
    one block (the sums add up to the list's), and at #16's case the rounds dealt
    forwards and backwards end within 1% of the mean where forwards only do not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import forward_items

    costs = forward_items.item_costs(64, 4096, 1.0)
    assert len(costs) == 64 * 32 and costs[0] == 33.0 and costs[-1] == 2.0
    for dealing in forward_items.DEALINGS.values():
        assert sum(dealing(costs, 132)) == pytest.approx(sum(costs))
    assert forward_items.busiest_over_mean(forward_items.mirrored, costs, 132) < 1.01
    assert forward_items.busiest_over_mean(forward_items.forwards, costs, 132) > 1.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is the full benchmark (run_gpu.sh embedding)")
def test_bench_embedding_imports_and_refuses_a_machine_without_a_gpu():
    run = subprocess.run([sys.executable, "benchmarks/bench_embedding.py"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr, run.stderr[-3000:]


def test_tune_auto_keeps_the_entries_it_does_not_measure():
    """Rewriting the auto table from the casts and GEMMs it measured leaves the
    kernels chosen by other benchmarks (attention, the state updates) as they were."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tune_auto

    previous = json.loads((ROOT / "kernels" / "auto_table.json").read_text())
    totals = {"gemm": {"triton": 2.0, "cuda": 1.0}, "quantize_current": {"triton": 1.0, "cuda": 3.0}}
    table = tune_auto.choose(totals, list(previous) + ["a_new_kernel"], previous)
    assert table["gemm"] == "cuda" and table["quantize_current"] == "triton"
    for kernel in ("attention_forward", "delayed_scale_update", "delayed_scale_update_many", "quantize_mxfp8"):
        assert table[kernel] == previous[kernel], kernel
    assert table["a_new_kernel"] == "triton"


def test_interleaved_timing_takes_turns_and_reports_per_call_medians():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness

    order, synced = [], []
    arms = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    ms = harness.interleaved_ms(arms, rounds=3, steps=2, sync=lambda: synced.append(1), warmup=1)
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # the warm-up, then the arms in turn each round
    assert len(synced) == 2 * 2 * 3


def test_profile_gpt_finds_the_gpus_idle_gaps_and_the_frames_of_launches():
    """``profile_gpt``'s readings of a profile, on events made up here: the idle gaps
    inside a step (grouped by the kernel that ended them; a gap as long as a sync is
    left out) and each runtime call's frame (up its parents, else the innermost of the
    project's frames on its thread that holds it in time)."""
    from types import SimpleNamespace as Event

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_gpt

    idle, rows = profile_gpt.idle_gaps([(0, 10, "a"), (20, 30, "b"), (25, 40, "c"), (42, 50, "d"),
                                        (10000, 10010, "e"), (10030, 10040, "b")], 2, 5)
    assert idle == pytest.approx(0.015) and rows == [("b", pytest.approx(0.015), 1.0)]

    def event(name, start, end, thread=1, parent=None):
        return Event(name=name, time_range=Event(start=start, end=end), thread=thread, cpu_parent=parent)

    op = event("aten::zero_", 40, 45, parent=event("te_fuser/ops/basic/linear.py(9): linear_forward", 35, 90))
    events = [event("te_fuser/ops/fuser.py(1): run_forward", 0, 100), event("kernels/cuda/cast.py(3): cast", 10, 20),
              event("cudaLaunchKernel", 12, 13), event("cudaMemsetAsync", 30, 31), event("cudaLaunchKernel", 200, 201),
              event("cudaLaunchKernel", 15, 16, thread=2), event("cudaMemsetAsync", 41, 42, parent=op)]
    got = {(what, source): n for what, source, n in profile_gpt._group_launches(events, 1, 10)}
    assert got == {("kernel", "kernels/cuda/cast.py(3): cast"): 1.0, ("kernel", "(no frame)"): 2.0,
                   ("memset", "te_fuser/ops/fuser.py(1): run_forward"): 1.0,
                   ("memset", "te_fuser/ops/basic/linear.py(9): linear_forward <- aten::zero_"): 1.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts what the GPU runs")
def test_count_launches_sees_every_entry_launch_a_kernel():
    """Each GEMM and cast row reports at least one kernel a call (none is missed by the count)."""
    run = subprocess.run([sys.executable, "benchmarks/count_launches.py", "--tokens", "256", "--calls", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines()[1:] if line.startswith(("gemm", "cast"))]
    assert len(rows) == 21
    for line in rows:
        kernels = float(re.split(r"\s{2,}", line)[1])
        assert kernels >= 1.0, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times cuBLASLt's algorithms on the GPU")
def test_count_launches_times_the_heuristics_candidates():
    """``--candidates``: each GEMM problem's first algorithm (the one the GEMM uses) is
    timed, with a kernel a call and a workspace size."""
    run = subprocess.run([sys.executable, "benchmarks/count_launches.py", "--tokens", "256", "--calls", "1",
                          "--candidates", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stdout.split("\n\n")[0].splitlines()[1:]  # problem (24 columns), candidate, workspace, kernels, ...
    rows = [(line[:24].strip(), line[24:].split()) for line in table]
    assert sorted(name for name, fields in rows if fields[0] == "0") == sorted(
        f"gemm {linear} {kind}" for linear in ("qkv", "proj", "fc1", "fc2")
        for kind in ("fprop bf16", "fprop fp32", "dgrad", "wgrad")), table
    for name, fields in rows:
        assert int(fields[1]) >= 0 and float(fields[2]) >= 1.0, (name, fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is a full benchmark (the GPT's host step split)")
def test_host_split_times_each_arm_in_turns_and_splits_its_step():
    """host_split.py on the CPU: a row per arm with its step's time, the Triton
    launches' share (none here: the CPU runs the reference kernels) and the rest;
    with --layers the layers' timers, te's own only in te's column."""
    run = subprocess.run([sys.executable, "benchmarks/host_split.py", "--rounds", "1", "--steps", "1",
                          "--recipes", "current", "--layers"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line.split() for line in run.stdout.splitlines()
            if line.startswith(("torch bf16", "te current"))}
    assert set(rows) == {"torch bf16", "te current"}, run.stdout
    for label, cells in rows.items():
        words = len(label.split())
        step, launches_ms, launches, rest = (float(c) for c in cells[words:words + 4])
        assert step > 0 and launches_ms == 0 and launches == 0 and rest == pytest.approx(step), run.stdout
    layers = {line[:20].strip(): line[20:].split() for line in run.stdout.split("layer (inclusive)")[1].splitlines()[1:]
              if line.strip()}
    # torch's model has a forward, a backward and an optimizer step, and no te layer; te's has them all
    for bucket in ("model forward", "autograd backward", "optimizer step"):
        assert float(layers[bucket][0]) > 0 and float(layers[bucket][3]) > 0, run.stdout
    for bucket in ("te groups forward", "linear backward", "casts", "gemm calls"):
        assert float(layers[bucket][0]) == 0 and float(layers[bucket][3]) > 0, run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is a full benchmark (the GPT's switch steps)")
def test_switch_split_times_each_switch_and_its_builds():
    """switch_split.py on the CPU: a row per phase with its switch step, its steps alone
    and their ratio; a switch into delayed scaling builds every fuser's plan and
    quantizers and seeds every quantizer with a current-scaling cast, a switch into
    current scaling (warmed up: its plans kept, their quantizers holding no state)
    publishes the kept plans without building quantizers, and a switch back to bf16
    after an FP8 phase builds plans without quantizers."""
    run = subprocess.run([sys.executable, "benchmarks/switch_split.py", "--schedule", "delayed,current,bf16",
                          "--steps", "4"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.split()[:1] in (["delayed"], ["current"],
                                                                                               ["bf16"])}
    assert set(rows) == {"delayed", "current", "bf16"}, run.stdout
    for name, line in rows.items():
        first, alone, ratio = (float(c) for c in line.split()[1:4])
        assert first > 0 and alone > 0 and ratio == pytest.approx(first / alone, abs=0.01), line
    builds = {name: line.split("(")[1].split(")")[0].strip() for name, line in rows.items()}
    fusers = builds["delayed"]
    assert int(fusers) > 0 and builds["current"] == fusers and builds["bf16"] == fusers, run.stdout
    cells = rows["delayed"].split(")")
    assert len(cells) == 5, rows["delayed"]  # builds, quantizers, place_states and seeding casts all ran
    assert rows["bf16"].count("(") == 1, rows["bf16"]  # builds alone: high precision makes no quantizer
    assert rows["current"].count("(") == 1, rows["current"]  # the warmed plans published again: builds alone
    bad = subprocess.run([sys.executable, "benchmarks/switch_split.py", "--schedule", "delayed,fp7"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--schedule: unknown recipe(s) ['fp7']" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is a full benchmark (the GPT's step in turns)")
def test_auto_entry_ab_times_both_entries_in_turns_and_puts_the_table_back():
    """auto_entry_ab.py on the CPU (where the auto table sends every kernel to the
    reference, so both entries run alike): a row per recipe with both entries'
    medians, their ratio and the rounds the second won; an unknown kernel is refused;
    the table's entry is the one it was after the run (a subprocess: nothing leaks)."""
    run = subprocess.run([sys.executable, "benchmarks/auto_entry_ab.py", "--kernel", "dact_dbias", "--rounds", "2",
                          "--steps", "1", "--recipes", "current"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("te current")]
    assert len(rows) == 1, run.stdout
    cells = rows[0]
    assert cells[2] == "triton" and cells[4] == "cuda" and float(cells[3]) > 0 and float(cells[5]) > 0, cells
    assert cells[-2] in ("0/2", "1/2", "2/2"), cells
    bad = subprocess.run([sys.executable, "benchmarks/auto_entry_ab.py", "--kernel", "nope"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--kernel: must be one of" in bad.stderr
    # the cuda backend's attention forward kernels in turns (on the CPU the reference runs both turns)
    run = subprocess.run([sys.executable, "benchmarks/auto_entry_ab.py", "--cuda-forward", "--rounds", "2",
                          "--steps", "1", "--recipes", "current"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = [line.split() for line in run.stdout.splitlines() if line.startswith("te current")][0]
    assert cells[2] == "cudnn" and cells[4] == "hopper", cells
    bad = subprocess.run([sys.executable, "benchmarks/auto_entry_ab.py", "--cuda-forward", "--entries", "cudnn", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--entries: with --cuda-forward" in bad.stderr


def test_auto_entry_ab_puts_the_entry_back():
    """Run in this process, the A/B leaves the auto table's entry as it found it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import auto_entry_ab

    from te_fuser import backend

    before = backend._load_auto_table().get("rotary")
    auto_entry_ab.main(["--kernel", "rotary", "--entries", "cuda", "reference", "--rounds", "1", "--steps", "1",
                        "--recipes", "bf16"])
    assert backend._load_auto_table().get("rotary") == before


def test_backward_threads_splits_each_arms_step_in_both_modes():
    """backward_threads.py (on the CPU, where autograd has no device thread to hand
    the backward to, both modes run on the caller's): a row per arm and mode, the
    split's pieces within the step, the time inside te's fused backward for te's
    arms only and within its backward's body."""
    run = subprocess.run([sys.executable, "benchmarks/backward_threads.py", "--size", "64", "--steps", "2",
                          "--rounds", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    arms = ("bf16 eager", "te_fuser current", "te_fuser delayed", "te_fuser delayed h16")
    rows = {}
    for line in run.stdout.splitlines():
        for arm in arms:
            rest = line[len(arm):].split() if line.startswith(arm + " ") else []
            if rest[:1] in (["device"], ["caller"]):
                mode = rest[0]
                cells = [float(c) for c in rest[2 if mode == "device" else 1:]]
                rows[(arm, mode)] = dict(zip(("step", "forward", "start", "body", "end", "fuser"), cells))
    assert set(rows) == {(arm, mode) for arm in arms for mode in ("device", "caller")}, run.stdout
    for (arm, _), r in rows.items():
        assert all(r[k] > 0 for k in ("step", "forward", "start", "body", "end")), (arm, r)
        assert r["forward"] + r["start"] + r["body"] + r["end"] <= r["step"], (arm, r)
        assert (r["fuser"] == 0) == (arm == "bf16 eager") and r["fuser"] <= r["body"], (arm, r)


@pytest.fixture
def bench_attention_on_cpu(monkeypatch):
    """bench_attention.py with a small causal case "cpu" (1x2:1x40x64), each timing
    one call (1.0 ms) and one set of inputs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_attention
    import harness

    def once(fn, inputs=((),), **_):
        fn(*inputs[0])
        return 1.0

    monkeypatch.setattr(harness, "time_ms", once)
    monkeypatch.setattr(harness, "rotation", lambda make, _bytes: [make()])
    monkeypatch.setitem(bench_attention.CASES, "cpu", (1, 2, 1, 40, 64, True))
    return bench_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is the full benchmark (run_gpu.sh attention)")
def test_bench_attention_runs_a_case_through_every_row_the_cpu_takes(bench_attention_on_cpu):
    """One small causal case of bench_attention.py on the CPU (each timing one call):
    SDPA's flash rows, Triton's bf16 and FP8 forwards and its backward, each within
    bound of SDPA's output; the cuDNN and Hopper rows are left out (their kernels
    refuse the CPU's tensors)."""
    rows = bench_attention_on_cpu.bench_case("cpu", ceiling=1.0, device="cpu")
    names = [(r.case, r.backend) for r in rows]
    assert names == [("fwd bf16", "torch sdpa flash"), ("fwd bf16", "triton"), ("fwd fp8", "triton"),
                     ("fwd fp8 + q/k/v casts", "triton"), ("bwd bf16", "torch sdpa flash"), ("bwd bf16", "triton")], names
    for r in rows:  # each check against SDPA's output: bf16 rounding, or FP8's (randn q, k, v)
        if "sdpa|" in r.note:
            diff = float(re.search(r"sdpa\| ([0-9.e+-]+)", r.note).group(1))
            assert diff < (0.25 if "fp8" in r.case else 0.02), (r.case, r.backend, r.note)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it is the full sweep (run_gpu.sh attnsweep)")
def test_bench_attention_sweeps_the_backwards_shapes_and_puts_the_plans_back(bench_attention_on_cpu):
    """bench_attention.py's sweep of the backward's two kernels at a small case on
    the CPU: a row for every launch shape of AUTOTUNE_CONFIGS["dq"] and ["dkdv"],
    each of which ran (no error in its note), and the plan table as it was."""
    from te_fuser.kernels.triton import attention as attn

    plans = dict(attn.ATTENTION_PLANS)
    rows = bench_attention_on_cpu.sweep(1.0, "cpu", kernels=["dq", "dkdv"], device="cpu")
    assert len(rows) == len(attn.AUTOTUNE_CONFIGS["dq"]) + len(attn.AUTOTUNE_CONFIGS["dkdv"])
    for r in rows:
        assert r.case.split()[0] in ("dq", "dkdv") and "(whole backward)" in r.case and r.ms == 1.0, (r.case, r.note)
    assert attn.ATTENTION_PLANS == plans


# Two kernels of an ``ncu --csv --page details`` export, as Nsight Compute writes one
# (thousands separators inside the quoted values; the raw counters asked for with
# --metrics under their own names)
_NCU_CSV = """\
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","7","python3","127.0.0.1","v_keys_inner_kernel","1","7","(256, 1, 1)","(32, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","21.31"
"0","7","python3","127.0.0.1","v_keys_inner_kernel","1","7","(256, 1, 1)","(32, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Memory Throughput","%","71.20"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","1,478.56"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","48.10"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","168"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","","0.52"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","","1.93"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","","n/a"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","%","61.50"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","%","38.00"
"1","7","python3","127.0.0.1","attention_fp8_forward_kernel","1","7","(384, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active","%","12.25"
"""


def test_ncu_attention_condenses_an_ncu_export_per_kernel(capsys):
    """ncu_attention.py's summary of a details export: kernels in launch order, the
    sections' figures by their names, stall reasons and pipes largest first (a
    value ncu leaves out is not a number and goes last), and the same from a saved
    CSV through --summarize."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_attention

    kernels = ncu_attention.summarize(_NCU_CSV)
    assert ncu_attention.summarize("==PROF== Connected to process 7\n" + _NCU_CSV) == kernels
    assert [k["kernel"] for k in kernels] == ["v_keys_inner_kernel", "attention_fp8_forward_kernel"]
    v, fwd = kernels
    assert v["shown"] == {"duration": (21.31, "us"), "memory %": (71.2, "%")} and not v["stalls"]
    assert fwd["shown"]["duration"] == (1478.56, "us") and fwd["shown"]["registers"] == (168.0, "register/thread")
    assert [r for r, _ in fwd["stalls"]] == ["wait", "barrier", "math_pipe_throttle"]
    assert fwd["pipes"] == [("xu (inst)", 61.5), ("tensor_op_gmma (cycles)", 38.0), ("fma (inst)", 12.25)]
    ncu_attention.print_summary("fp8fwd", kernels)
    out = capsys.readouterr().out
    assert "fp8fwd    attention_fp8_forward_kernel: duration 1478.56 us, SM % 48.1, registers 168" in out
    assert "stalls (cycles a warp waited per issued instruction): wait 1.93, barrier 0.52" in out
    assert "pipes (% of peak while active): xu (inst) 61.5, tensor_op_gmma (cycles) 38.0" in out
    shown = ncu_attention._distinct([("xu (inst)", 36.1), ("xu_realtime (inst)", 36.1), ("shared (cycles)", 34.5),
                                     ("tensor (cycles)", 34.5), ("tensor_op_hmma (cycles)", 34.5), ("alu (inst)", 2.0)])
    assert shown == [("xu (inst)", 36.1), ("tensor (cycles)", 34.5), ("alu (inst)", 2.0)]


def test_ncu_attention_profiles_one_call_with_the_clocks_as_they_are(tmp_path):
    """The ncu command: only the kernels between cudaProfilerStart and Stop (the child's
    one call after its warm-up), the clocks left alone, the report exported, the
    sections and the raw stall and pipe counters (left out on the retry)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_attention

    cmd = ncu_attention.ncu_command("ncu", "bwd", "gpt", tmp_path / "bwd")
    text = " ".join(cmd)
    assert "--profile-from-start off" in text and "--clock-control none" in text
    assert f"--export {tmp_path / 'bwd'}" in text and "--section WarpStateStats" in text
    assert cmd[-4:] == ["--launch", "bwd", "--case", "gpt"] and cmd[-5].endswith("ncu_attention.py")
    assert "--metrics" in cmd and "--metrics" not in ncu_attention.ncu_command("ncu", "fp8fwd", "main", tmp_path, False)
    (tmp_path / "fp8fwd.csv").write_text(_NCU_CSV)
    run = subprocess.run([sys.executable, "benchmarks/ncu_attention.py", "--summarize", str(tmp_path / "fp8fwd.csv")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and "fp8fwd    v_keys_inner_kernel: duration 21.31 us" in run.stdout, run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU ncu profiles them (run_gpu.sh ncuattn)")
def test_ncu_attentions_backward_target_is_triton_backward(bench_attention_on_cpu):
    """The call ncu_attention.py profiles for Triton's backward, at a small case on
    the CPU: the two kernels' dq, dk and dv of that case's inputs."""
    import ncu_attention

    from te_fuser.kernels import triton as tk

    torch.manual_seed(0)
    grads = ncu_attention._call("bwd", "cpu", device="cpu")()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 64, dtype=torch.bfloat16) for h in (2, 1, 1))
    do = torch.randn_like(q)
    o, lse = tk.attention_forward(q, k, v, True, 1 / 8)
    for got, want in zip(grads, tk.attention_backward(q, k, v, o, lse, do, True, 1 / 8)):
        assert torch.equal(got, want)


# Two kernels of an ``ncu --csv --page source --print-source sass`` export (a
# "Kernel Name" line before each kernel's table; stall samples per instruction)
_NCU_SOURCE_CSV = """\
"Kernel Name","v_keys_inner_kernel<128>(te_fuser::AttentionFp8Args)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","LDG.E R2, desc[UR4][R2.64]","10","9","0","10","0","9"
"0x20","STS [R5], R2","30","20","0","28","2","20"
"Kernel Name","attention_fp8_forward_kernel<128, true, __nv_bfloat16>(te_fuser::AttentionFp8Args)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x100","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x1c020], R2","5","5","0","0","5","0"
"0x110","@!P0 BRA 0x900","60","60","0","60","0","60"
"0x120","MUFU.EX2 R4, R4","25","10","20","0","5","0"
"0x130","WARPGROUP.DEPBAR.LE gsb0, 0x1","10","10","10","0","0","0"
"""


def test_ncu_attention_places_the_warps_stalls_by_instruction(capsys, tmp_path):
    """ncu_attention.py --source's summary of a source page: per kernel its warp
    samples, their shares by reason and by opcode (a predicate dropped), and its
    instructions most sampled, a branch shown with the wait it loops on; the
    command asks for ncu's SourceCounters without the raw counters."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_attention

    v, fwd = ncu_attention.summarize_source(_NCU_SOURCE_CSV)
    assert v["kernel"].startswith("v_keys_inner_kernel") and v["samples"] == 40
    assert fwd["samples"] == 100 and fwd["reasons"][0] == ("long_sb", 0.6)
    assert dict(fwd["opcodes"]) == {"SYNCS": 0.05, "BRA": 0.6, "MUFU": 0.25, "WARPGROUP": 0.1}
    address, instruction, share, why = fwd["top"][0]
    assert (address, share, why[0]) == ("0x110", 0.6, ("long_sb", 1.0))
    assert instruction == "@!P0 BRA 0x900 (after SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x1c020], R2)"
    (tmp_path / "fp8fwd-source.csv").write_text(_NCU_SOURCE_CSV)
    ncu_attention.main(["--summarize", str(tmp_path / "fp8fwd-source.csv")])
    out = capsys.readouterr().out
    assert "fp8fwd-source attention_fp8_forward_kernel" in out and "by opcode: BRA 60.0%, MUFU 25.0%" in out
    cmd = ncu_attention.ncu_command("ncu", "fp8fwd", "main", tmp_path / "x", source=True)
    assert "SourceCounters" in cmd and "--metrics" not in cmd and "SpeedOfLight" not in cmd


def test_block_cast_host_times_each_case_and_puts_the_launch_back():
    """block_cast_host.py: a positive time for each case, the launch stubbed only
    while it measures (the cast launches again after it)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        block_cast_host = importlib.import_module("block_cast_host")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from te_fuser.kernels.triton import cast

    launch = cast.launch
    times = block_cast_host.measure(calls=20)
    assert set(times) == {"1x128 row-wise", "1x128 both copies", "128x128 both copies"}
    assert all(us > 0 for us in times.values()), times
    assert cast.launch is launch
