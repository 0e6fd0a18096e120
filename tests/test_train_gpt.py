"""The GPT yardstick: its corpus, the te model against its torch twin, and the
training script (examples/train_gpt.py) at the smoke size on the CPU: its default
schedule, and the te arm's linear weights as FP8 parameters."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import te_fuser as te
from te_fuser.models import (
    GPT, GPTConfig, TorchGPT, copy_weights, load_stdlib_corpus, parameter_name_map, rename_state_dict,
    sample_windows, split_corpus, stdlib_source_files,
)
from te_fuser.ops.fp8_parameters import master_of
from te_fuser.quantization.float8_tensor import Float8Tensor
from tolerances import assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEDULE = "bf16:4,delayed:4,bf16:4"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train_gpt = _load_script()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One short run of both arms through bf16 -> delayed scaling -> bf16."""
    out = tmp_path_factory.mktemp("gpt")
    argv = ["--size", "smoke", "--schedule", SCHEDULE, "--arms", "te,torch", "--corpus-bytes", "300000",
            "--eval-batches", "2", "--log-every", "4", "--json", str(out / "run.json"), "--png", str(out / "run.png")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = train_gpt.main(argv)
    return report, json.loads((out / "run.json").read_text()), stdout.getvalue(), out


def test_the_summary_compares_te_with_each_other_arm_per_phase(smoke_run):
    """The run ends with te's tokens/s over the torch twin's and the difference of
    their validation losses, per phase, from the report's own records."""
    report, _, stdout, _ = smoke_run
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["phase", "te", "/"])
    te_phases, torch_phases = report["arms"]["te"]["phases"], report["arms"]["torch"]["phases"]
    for line, ours, theirs in zip(lines[head + 1:], te_phases, torch_phases, strict=False):
        name, ratio, diff = line.split()
        assert name == ours["phase"]
        assert ratio == f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x", line
        assert float(diff) == round(ours["val_bpb"] - theirs["val_bpb"], 4), line


def test_smoke_run_trains_both_arms(smoke_run):
    report, _, _, _ = smoke_run
    assert set(report["arms"]) == {"te", "torch"}
    for name, arm in report["arms"].items():
        losses = arm["losses"]
        assert len(losses) == 12 and all(math.isfinite(v) for v in losses), f"{name}: {losses}"
        assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, f"{name}: the loss did not fall: {losses}"
        assert [p["phase"] for p in arm["phases"]] == ["bf16", "delayed", "bf16"]
        for phase in arm["phases"]:
            assert math.isfinite(phase["val_bpb"]) and math.isfinite(phase["val_bpb_bf16"]), f"{name}: {phase}"
    te_phases = report["arms"]["te"]["phases"]
    assert te_phases[1]["recipe"] == str(te.recipe.DelayedScaling())
    assert all(p["refusions"] > 0 for p in te_phases)  # every phase switches recipe (and evaluates)


def _run(argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        return train_gpt.main(argv), stdout.getvalue()


def _same_losses_with(argv, flags):
    """``(plain report, report, stdout)`` of ``argv`` run without and with ``flags``,
    every te and torch arm's losses checked to be the same bits."""
    plain, _ = _run(argv)
    report, stdout = _run(argv + flags)
    for arm in ("te", "torch"):
        assert report["arms"][arm]["losses"] == plain["arms"][arm]["losses"], arm
    return plain, report, stdout


@pytest.fixture(scope="module")
def fp8_params_run(tmp_path_factory):
    """The te arm of ``smoke_run`` again, its linear weights FP8 parameters."""
    json_path = tmp_path_factory.mktemp("gpt_fp8_params") / "run.json"
    argv = ["--size", "smoke", "--schedule", SCHEDULE, "--fp8-params", "--arms", "te", "--corpus-bytes", "300000",
            "--eval-batches", "2", "--log-every", "100", "--json", str(json_path)]
    report, stdout = _run(argv)
    return report, json.loads(json_path.read_text()), stdout


def test_the_default_is_te_attention_through_the_attention_recipes():
    args = train_gpt.parse_args([])
    assert args.config.attention == GPTConfig.smoke().attention == "te"
    assert [p.name for p in args.phases] == ["bf16", "delayed", "delayed_mha", "current", "current_dpa", "block",
                                             "mxfp8", "bf16"]
    sdpa = train_gpt.parse_args(["--attention", "sdpa"])
    assert sdpa.config.attention == "sdpa"
    assert [p.name for p in sdpa.phases] == ["bf16", "delayed", "current", "block", "mxfp8", "bf16"]


def test_the_sdpa_model_still_trains_through_the_script():
    report, _ = _run(["--size", "smoke", "--attention", "sdpa", "--schedule", "bf16:2,delayed:2", "--arms", "te",
                      "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100"])
    assert report["config"]["attention"] == "sdpa"
    for name, arm in report["arms"].items():
        assert all(math.isfinite(v) for v in arm["losses"]) and arm["losses"][-1] < arm["losses"][0], name


def test_fp8_params_hold_a_quarter_of_the_fp32_weight_bytes_and_keep_the_loss(fp8_params_run, smoke_run):
    """The GPT trains fp32 weights under bf16 autocast; as FP8 parameters its linear
    weights hold one byte an element plus scales: a quarter of the fp32 weights'
    bytes (half of what bf16 weights would hold), read from the tensors. The loss
    ends within the bf16 band of the same run with fp32 weights."""
    report, written, stdout = fp8_params_run
    fp8, fp32 = report["arms"]["te"], smoke_run[0]["arms"]["te"]  # the same model, schedule and batches
    assert fp8["memory"]["fp8_parameters"] and not fp32["memory"]["fp8_parameters"]
    assert written["arms"]["te"]["memory"] == fp8["memory"]
    assert report["config"]["fp8_params"] and report["config"]["fp8_params_recipe"] == str(te.recipe.DelayedScaling())
    for phase in fp8["phases"]:
        ratio = phase["weight_bytes"] / fp32["memory"]["weight_bytes"]
        assert 0.25 <= ratio <= 0.2502, (phase["phase"], ratio)  # per-tensor scales: 4 bytes a weight
    assert fp8["memory"]["parameter_bytes"] < 0.4 * fp32["memory"]["parameter_bytes"]  # embeddings, norms: fp32
    assert "FP8 params" in stdout
    losses = fp8["losses"]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, f"the loss did not fall: {losses}"
    final = [torch.tensor([arm["phases"][-1]["val_bpb"]]) for arm in (fp8, fp32)]
    assert_close(final[0], final[1], torch.bfloat16, "GPT smoke, FP8 parameters against fp32 weights, last validation")


def test_fp8_params_train_as_their_masters_under_fp8_recipes_and_as_fp8_values_in_bf16():
    """What the schedule does with FP8 parameters (train_gpt.py's docstring): each
    FP8 phase trains bit for bit as the model whose fp32 weights are the masters; a
    bf16 phase computes from the FP8 values."""
    config = GPTConfig.smoke().replace(n_layer=1, seq_len=32, batch_size=2)
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=train_gpt.RECIPES["delayed"]):
        model = GPT(config)
    ref = GPT(config)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p.dequantize() if type(p) is Float8Tensor else p)
    cpu = torch.device("cpu")
    opts = [train_gpt.make_adamw(m, "foreach", 2e-3, 0.1) for m in (model, ref)]
    windows = sample_windows(load_stdlib_corpus(50_000), config.batch_size, config.seq_len,
                             torch.Generator().manual_seed(0))
    for name in ("delayed", "delayed_mha", "current", "current_dpa", "block", "mxfp8"):
        recipe = train_gpt.RECIPES[name]
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = train_gpt.loss_bits_per_byte(m, windows, recipe, cpu)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"{name}: {losses}"
    weights = [p for p in model.parameters() if type(p) is Float8Tensor]
    assert weights and all(w.fp8_storage.q.scaling == "mx_32" for w in weights)  # the last phase's layout
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(master_of(p) if type(p) is Float8Tensor else p, q), "the masters are the weights"
            q.copy_(p.dequantize() if type(p) is Float8Tensor else p)  # the FP8 values
        bf16 = [train_gpt.loss_bits_per_byte(m, windows, None, cpu) for m in (model, ref)]
    assert torch.equal(bf16[0], bf16[1])


def test_smoke_run_writes_the_json(smoke_run):
    report, written, stdout, out = smoke_run
    assert written == json.loads(json.dumps(report))
    assert {"config", "device", "versions", "date", "corpus", "arms", "skipped"} <= set(written)
    assert {"torch", "triton", "python"} <= set(written["versions"])
    assert written["config"]["n_layer"] == GPTConfig.smoke().n_layer
    assert [p["name"] for p in written["config"]["phases"]] == ["bf16", "delayed", "bf16"]
    for arm in written["arms"].values():
        assert {"losses", "phases", "evals", "tokens_per_s"} <= set(arm)
        assert arm["tokens_per_s"] > 0
        assert {"val_bpb", "val_bpb_bf16", "tokens_per_s", "steady_tokens_per_s", "first_step_ms", "steps",
                "weight_bytes"} <= set(arm["phases"][0])
        for phase in arm["phases"]:  # 4-step phases logged every 4: one window after the first step
            assert phase["steady_tokens_per_s"] == phase["tokens_per_s"] > 0
        memory = arm["memory"]
        assert not memory["fp8_parameters"]
        if torch.cuda.is_available():  # the run's default device
            assert 0 < memory["start_mib"] < memory["peak_mib"], memory
        else:
            assert memory["start_mib"] is None and memory["peak_mib"] is None  # no CUDA memory figures
        assert memory["weight_bytes"] < memory["parameter_bytes"]
    png_lines = [line for line in stdout.splitlines() if line.startswith("PNG ")]
    assert len(png_lines) == 1, stdout
    assert (out / "run.png").exists() == png_lines[0].startswith("PNG written")


@pytest.mark.parametrize("attention", ["te", "sdpa"])
def test_te_in_bf16_matches_the_torch_twin_at_step_0(attention):
    config = GPTConfig.smoke().replace(attention=attention)
    torch.manual_seed(0)
    te_model = GPT(config)
    twin = TorchGPT(config)
    copy_weights(te_model, twin)
    data = load_stdlib_corpus(200_000)
    windows = sample_windows(data, config.batch_size, config.seq_len, torch.Generator().manual_seed(0))
    te_loss = train_gpt.loss_bits_per_byte(te_model, windows, None, torch.device("cpu"))
    torch_loss = train_gpt.loss_bits_per_byte(twin, windows, None, torch.device("cpu"))
    assert_close(te_loss.detach(), torch_loss.detach(), torch.bfloat16, f"GPT smoke, {attention} attention, bf16, "
                 f"step 0")


@pytest.mark.parametrize("attention", ["te", "sdpa"])
def test_state_dicts_convert_both_ways(attention):
    config = GPTConfig.smoke().replace(attention=attention)
    torch.manual_seed(0)
    te_model, twin = GPT(config), TorchGPT(config)
    names = parameter_name_map(te_model, twin)
    assert len(names) == len(list(te_model.parameters())) == len(list(twin.parameters()))
    twin.load_state_dict(rename_state_dict(te_model.state_dict(), names))
    back = GPT(config)
    missing, unexpected = back.load_state_dict(rename_state_dict(twin.state_dict(), {v: k for k, v in names.items()}),
                                               strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    for (name, p), q in zip(te_model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), name


def test_corpus_is_the_stdlib_in_sorted_order():
    files = stdlib_source_files()
    root = os.path.dirname(os.__file__)
    rel = [os.path.relpath(f, root) for f in files]
    assert rel == sorted(rel) and all(f.endswith(".py") for f in rel)
    assert not any(part in ("site-packages", "test", "tests") for f in rel for part in f.split(os.sep))
    data = load_stdlib_corpus(100_000)
    assert len(data) == 100_000 and torch.equal(data, load_stdlib_corpus(100_000))
    with open(files[0], "rb") as f:
        head = f.read(100)
    assert bytes(data[: len(head)].tolist()) == head
    train, val = split_corpus(data)
    assert len(val) == 5_000 and torch.equal(torch.cat([train, val]), data)
    a = sample_windows(train, 3, 16, torch.Generator().manual_seed(1))
    b = sample_windows(train, 3, 16, torch.Generator().manual_seed(1))
    assert a.shape == (3, 17) and a.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: must be a positive integer"),
        (["--schedule", "bf16,fp4"], "unknown phase 'fp4'"),
        (["--schedule", "delayed:ten"], "the step count of 'delayed:ten' must be a positive integer"),
        (["--seq-len", "4096", "--corpus-bytes", "10000"], "does not fit the validation split"),
        (["--arms", "te,jax"], "argument --arms: must be distinct names"),
        (["--lr", "-1"], "argument --lr: must be a positive number"),
        (["--attention", "sdpa", "--schedule", "bf16,current_dpa"],
         "phase 'current_dpa' runs attention in FP8 (fp8_dpa / fp8_mha), which te_fuser's attention ops do"),
        (["--graphed", "--device", "cpu"], "--graphed: CUDA graphs need a CUDA device, got cpu"),
        (["--checkpoint", "--graphed"], "--checkpoint with --graphed: a captured step does not recompute"),
        (["--schedule", "bf16,delayed", "--profile-switch", "block"],
         "--profile-switch: 'block' is not a phase of the schedule (bf16, delayed)"),
        (["--schedule", "bf16,delayed", "--profile-phase", "current"],
         "--profile-phase: 'current' is not a phase of the schedule (bf16, delayed)"),
        (["--schedule", "bf16,delayed", "--profile-switch", "delayed", "--trace-switch", "delayed"],
         "--profile-switch and --trace-switch: one of them for phase 'delayed'"),
    ],
)
def test_argument_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_steps_train_as_the_eager_steps(monkeypatch):
    """``--graphed``: the te arm's steps replayed from one CUDA graph per recipe train
    as the eager steps (the eager run given the graphed run's capturable AdamW),
    through two switches, bit for bit: every default kernel sums in a fixed order."""
    argv = ["--size", "smoke", "--device", "cuda", "--schedule", "bf16:5,delayed:5,current:5", "--arms", "te",
            "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100", "--adamw", "fused"]
    graphed, _ = _run(argv + ["--graphed"])
    make_adamw = train_gpt.make_adamw
    monkeypatch.setattr(train_gpt, "make_adamw", lambda *a, capturable=False: make_adamw(*a, capturable=True))
    eager, _ = _run(argv)
    assert graphed["config"]["graphed"] is True and eager["config"]["graphed"] is False
    a, b = eager["arms"]["te"]["losses"], graphed["arms"]["te"]["losses"]
    assert len(a) == len(b) == 15
    assert b == a


def test_the_determinism_check_finds_two_runs_identical(capsys):
    """``benchmarks/check_determinism.py``: the te arm trained twice in one process,
    through an evaluation between phases of one recipe and a switch, gives the same
    loss bits (on the GPU it also compares a graphed run: ``run_gpu.sh determinism``)."""
    spec = importlib.util.spec_from_file_location("check_determinism", ROOT / "benchmarks" / "check_determinism.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.first_difference([1.0, 2.0], [1.0, 2.5]) == (1, 2.0, 2.5)
    assert check.first_difference([1.0], [1.0]) is None
    assert check.main(["--schedule", "bf16:3,bf16:2,delayed:2", "--device", "cpu"]) == 0
    assert "eager 2  identical to eager 1" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [[], ["--checkpoint"]], ids=["kept", "checkpointed"])
def test_the_compiled_arm_is_the_twin_with_its_blocks_compiled(monkeypatch, flags):
    """``--arms compiled``: the plain-torch twin with each block through
    ``torch.compile`` trains from the same weights on the same batches to the
    twin's losses; it is in the default arms on a GPU only. On the CPU the blocks
    compile with the ``aot_eager`` backend (the arm's wiring and autograd through
    dynamo, without a C++ compile per test); a GPU run uses inductor. With
    ``--checkpoint`` the recomputation is inside each compiled block (a compiled
    block under an eager checkpoint recomputes a graph whose saved tensors need
    not match the forward's, and torch rejects it)."""
    compile_, compiled_blocks = torch.compile, []

    def aot_eager(module, **kwargs):
        compiled_blocks.append(type(module).__name__)
        return compile_(module, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", aot_eager)
    argv = ["--size", "smoke", "--device", "cpu", "--schedule", "bf16:3", "--arms", "torch,compiled",
            "--corpus-bytes", "300000", "--eval-batches", "1", *flags]
    with contextlib.redirect_stdout(io.StringIO()):
        report = train_gpt.main(argv)
    assert compiled_blocks == ["TorchBlock"] * train_gpt.SIZES["smoke"].config.n_layer, compiled_blocks
    eager, compiled = report["arms"]["torch"], report["arms"]["compiled"]
    assert compiled["phases"][0]["numerics"] == "bf16"
    for a, b in zip(eager["losses"], compiled["losses"], strict=True):
        assert abs(a - b) < 2e-3, (eager["losses"], compiled["losses"])
    assert abs(eager["evals"][-1]["val_bpb"] - compiled["evals"][-1]["val_bpb"]) < 2e-3
    assert "compiled" not in train_gpt.parse_args(["--device", "cpu"]).arms
    assert train_gpt.parse_args(["--device", "cpu", "--arms", "compiled"]).arms == ["compiled"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="autograd's device threads serve GPU tensors"))])
def test_the_backward_on_the_calling_thread_trains_the_same_bits(device):
    """``--backward-thread caller``: every arm's backward on the thread that calls it
    (autograd's device threads off for the run) gives the default run's losses bit for
    bit, is recorded in the report, and leaves the setting as it found it."""
    argv = ["--size", "smoke", "--device", device, "--schedule", "bf16:2,current:2", "--arms", "te,torch",
            "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100"]
    default, _ = _run(argv)
    caller, _ = _run(argv + ["--backward-thread", "caller"])
    assert default["config"]["backward_thread"] == "autograd" and caller["config"]["backward_thread"] == "caller"
    for arm in ("te", "torch"):
        assert len(caller["arms"][arm]["losses"]) == 4
        assert caller["arms"][arm]["losses"] == default["arms"][arm]["losses"], arm
    assert torch._C._is_multithreading_enabled()


def test_checkpointed_blocks_train_the_same_bits():
    """``--checkpoint``: every arm recomputes each block in the backward (te.checkpoint,
    torch.utils.checkpoint for the twin) and trains the default run's losses bit for
    bit through a switch into and out of delayed scaling; the report says so."""
    argv = ["--size", "smoke", "--schedule", "bf16:2,delayed:2,current:2,bf16:1", "--arms", "te,torch",
            "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100"]
    kept, recomputed, _ = _same_losses_with(argv, ["--checkpoint"])
    assert kept["config"]["checkpoint"] is False and recomputed["config"]["checkpoint"] is True
    for arm in ("te", "torch"):
        assert len(recomputed["arms"][arm]["losses"]) == 7
    assert recomputed["arms"]["te"]["evals"] == kept["arms"]["te"]["evals"]


def test_a_profiled_phase_trains_the_same_bits_and_records_each_arms_kernels():
    """``--profile-phase delayed``: three steps in the middle of that phase run under
    torch.profiler for every arm, out of the phase's clock; the losses are those of
    the run without it, bit for bit, and each arm's record for the phase holds its
    table (CPU ops here). A phase too short to profile says so. A phase of eight
    steps or more also times steps alone (the yardstick of its first step), out of
    its rate."""
    argv = ["--size", "smoke", "--schedule", "bf16:4,delayed:8,bf16:4", "--arms", "te,torch", "--corpus-bytes",
            "300000", "--eval-batches", "2", "--log-every", "4"]
    _, report, stdout = _same_losses_with(argv, ["--profile-phase", "delayed"])
    for arm in ("te", "torch"):
        profiles = [p.get("profile") for p in report["arms"][arm]["phases"]]
        assert profiles[0] is None and profiles[2] is None, arm
        table = profiles[1]
        assert table["steps"] == 3 and table["ms_per_step"] > 0 and table["top"], (arm, table)
        assert all(row["ms"] >= 0 and row["calls"] > 0 and row["name"] for row in table["top"])
    assert "delayed: steps 7-9 profiled" in stdout
    for arm in ("te", "torch"):
        lone = [p["lone_step_ms"] for p in report["arms"][arm]["phases"]]
        assert lone[0] is None and lone[1] > 0 and lone[2] is None, (arm, lone)
    assert stdout.count("(a step alone ") == 2
    report, _ = _run(argv[:3] + ["bf16:4,delayed:9,bf16:4"] + argv[4:])  # three steps alone, their median
    for arm in ("te", "torch"):
        phase = report["arms"][arm]["phases"][1]
        lone = phase["lone_steps_ms"]
        assert len(lone) == 3 and phase["lone_step_ms"] == sorted(lone)[1], (arm, lone)
        assert report["arms"][arm]["phases"][0]["lone_steps_ms"] == []
    _, stdout = _run(argv[:3] + ["bf16:3"] + argv[4:] + ["--profile-phase", "bf16"])
    assert "bf16: 3 steps, too few to profile (5 or more)" in stdout


def test_a_profiled_switch_trains_the_same_bits_and_records_the_hosts_functions():
    """``--profile-switch current``: the te arm's first step of the current phase runs
    under cProfile with its backward on the calling thread; the losses are those of
    the run without it, and the phase's record holds the functions with the most own
    time (the re-fusion's among them); the other phases and arms hold none."""
    argv = ["--size", "smoke", "--schedule", "bf16:2,delayed:2,current:2", "--arms", "te,torch", "--corpus-bytes",
            "300000", "--eval-batches", "1", "--log-every", "100"]
    _, report, stdout = _same_losses_with(argv, ["--profile-switch", "current"])
    switch = [p.get("switch_profile") for p in report["arms"]["te"]["phases"]]
    assert switch[0] is None and switch[1] is None
    assert switch[2]["ms_own_total"] > 0 and len(switch[2]["top"]) == 25
    assert all(row["ms"] >= 0 and row["calls"] > 0 and row["name"] for row in switch[2]["top"])
    assert all(p.get("switch_profile") is None for p in report["arms"]["torch"]["phases"])
    assert "current: the switch step under cProfile" in stdout
    assert torch._C._is_multithreading_enabled()


def test_a_profiled_switch_beside_its_lone_step_names_where_the_extra_time_goes():
    """``--profile-switch`` in a phase long enough to time a step alone: that step
    runs under cProfile too, and the phase's record holds the functions whose
    cumulative time the switch step exceeded it by most, most first: among them the
    fusers' miss path, which only a step that builds takes (the lone step's calls
    take the armed guard), once for every fuser of the model."""
    argv = ["--size", "smoke", "--schedule", "bf16:2,current:8", "--arms", "te,torch", "--corpus-bytes", "300000",
            "--eval-batches", "1", "--log-every", "100"]
    _, report, stdout = _same_losses_with(argv, ["--profile-switch", "current"])
    phase = report["arms"]["te"]["phases"][1]
    assert phase["lone_profile"]["ms_own_total"] > 0
    rows = phase["switch_extra"]["top"]
    assert [row["extra_ms"] for row in rows] == sorted((row["extra_ms"] for row in rows), reverse=True)
    extra = {row["name"].split(" (")[0]: row for row in rows}
    from te_fuser.models.gpt import GPT, GPTConfig
    from te_fuser.ops.find import fusers_of

    fusers = len(list(fusers_of(GPT(GPTConfig.smoke()))))
    assert extra["_run_and_arm"]["extra_ms"] > 0 and extra["_run_and_arm"]["extra_calls"] == fusers, extra
    assert "switch_extra" not in report["arms"]["te"]["phases"][0]
    assert "current: the switch step's cumulative time over the lone step's" in stdout


def test_a_traced_switch_trains_the_same_bits_and_records_it_beside_a_step_alone():
    """``--trace-switch delayed``: the te arm's first step of the delayed phase and its
    step timed alone run under torch.profiler; the losses are those of the run
    without it, and the phase's record holds both traces (wall time, and on a CPU no
    GPU kernel time); no other phase or arm holds one."""
    argv = ["--size", "smoke", "--schedule", "bf16:2,delayed:8", "--arms", "te,torch", "--corpus-bytes", "300000",
            "--eval-batches", "1", "--log-every", "100"]
    _, report, stdout = _same_losses_with(argv, ["--trace-switch", "delayed"])
    phases = report["arms"]["te"]["phases"]
    assert "switch_trace" not in phases[0] and "lone_trace" not in phases[0]
    for what in ("switch", "lone"):
        trace = phases[1][f"{what}_trace"]
        assert trace["wall_ms"] > 0 and (trace["gpu_kernels_ms"] is None) == (not torch.cuda.is_available())
        assert f"delayed: the {what} step traced" in stdout
    assert phases[1]["lone_step_ms"] > 0
    # the traced switch's yardstick is its one step alone, traced alike
    assert phases[1]["lone_steps_ms"] == [phases[1]["lone_step_ms"]]
    assert phases[0]["lone_steps_ms"] == [] and phases[0]["lone_step_ms"] is None
    assert all("switch_trace" not in p for p in report["arms"]["torch"]["phases"])


def test_the_warm_up_readies_every_phase_of_the_te_model_itself(monkeypatch):
    """te.warmup runs the te arm's own model under every recipe of the schedule and
    puts it back: training then matches no fusion rule at any switch (a first switch
    builds only its quantizers, as a switch back does), and trains the same bits as
    a warm-up on a model of its own, which readied only the kernels."""
    from op_testing import record_matches

    argv = ["--size", "smoke", "--schedule", "bf16:2,delayed:2,current:2,delayed:1", "--arms", "te",
            "--corpus-bytes", "300000", "--eval-batches", "1", "--log-every", "100"]
    warm_up, after_warm_up = train_gpt._warm_up, []
    matched = record_matches(monkeypatch)

    def counted(run, te_model):
        warm_up(run, te_model)
        after_warm_up.append(len(matched))

    monkeypatch.setattr(train_gpt, "_warm_up", counted)
    own, _ = _run(argv)
    assert after_warm_up and after_warm_up[0] > 0 and len(matched) == after_warm_up[0], matched

    def apart(run, te_model):  # as before: the kernels warmed on another model
        warm_up(run, train_gpt._te_model(run.args))

    monkeypatch.setattr(train_gpt, "_warm_up", apart)
    other, _ = _run(argv)
    assert own["arms"]["te"]["losses"] == other["arms"]["te"]["losses"]
    assert [p["val_bpb"] for p in own["arms"]["te"]["phases"]] == [p["val_bpb"] for p in other["arms"]["te"]["phases"]]


def test_the_issues_table_from_runs_in_processes_of_their_own(tmp_path):
    """``benchmarks/gpt_table.py`` over two runs of the main job, each a process of
    its own: every phase's rates and te's ratio to the eager twin per run and their
    median, #14's targets counted over the runs, and te's validation bits the same
    in both runs. Reports from other schedules, or without a te arm, are refused
    with a message naming the file."""
    argv = ["--size", "smoke", "--schedule", "bf16:2,current:2", "--arms", "te,torch", "--corpus-bytes", "300000",
            "--eval-batches", "1", "--log-every", "100"]
    paths = []
    for r in range(2):
        path = tmp_path / f"gpt_{r}.json"
        run = subprocess.run([sys.executable, "examples/train_gpt.py", *argv, "--json", str(path)],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        paths.append(str(path))
    table = subprocess.run([sys.executable, "benchmarks/gpt_table.py", *paths], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    reports = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    for phase, kind in (("bf16", "bf16"), ("current", "fp8")):
        rows = [line.split() for line in lines if line.startswith(phase)]
        assert [row[1] for row in rows] == ["1", "2", "median"], rows
        for r, row in enumerate(rows[:2]):
            te_rate = [p for p in reports[r]["arms"]["te"]["phases"] if p["phase"] == phase][0]["tokens_per_s"]
            assert row[2] == f"{te_rate / 1e3:.1f}", (row, te_rate)
        ratios = [float(row[6].rstrip("x")) for row in rows[:2]]
        median = float(rows[2][2].rstrip("x"))
        assert abs(median - sum(ratios) / 2) <= 0.006, (ratios, median)
        least = 0.95 if kind == "bf16" else 1.3
        # the table counts the unrounded ratios: a printed one within its rounding of the target may fall either way
        surely = sum(r - least > 0.005 for r in ratios)
        maybe = sum(abs(r - least) <= 0.005 for r in ratios)
        assert any(f"target te/torch >= {least}: met in {met} of 2 runs" in table.stdout
                   for met in range(surely, surely + maybe + 1)), (ratios, table.stdout)
    assert "the same bits in every run" in table.stdout
    other = tmp_path / "other.json"
    report = json.loads(pathlib.Path(paths[0]).read_text())
    report["arms"]["te"]["phases"][1]["phase"] = "delayed"
    other.write_text(json.dumps(report))
    refused = subprocess.run([sys.executable, "benchmarks/gpt_table.py", paths[0], str(other)], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 2 and "other.json: phase 2 is not 'current'" in refused.stderr
    del report["arms"]["te"]
    other.write_text(json.dumps(report))
    refused = subprocess.run([sys.executable, "benchmarks/gpt_table.py", str(other)], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert refused.returncode == 2 and "other.json: no te arm in this report" in refused.stderr
