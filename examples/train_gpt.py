"""Train the te_fuser GPT on the Python standard library's source, beside plain torch.

Arms, one after another, each from the same initial weights and on the same batches:

- ``te``: ``te_fuser.models.GPT`` through a schedule of recipes, one per phase
  (``name:steps`` sets a phase's length). The model is te_fuser ops throughout
  (``--attention te``, the default: rotary embeddings and ``DotProductAttention``),
  and the default schedule is ``bf16,delayed,delayed_mha,current,current_dpa,
  block,mxfp8,bf16``: each per-tensor recipe, then the same recipe with attention
  in FP8 (``fp8_mha``, ``fp8_dpa``). ``--attention sdpa`` puts torch's SDPA between
  the fused groups instead, with the default schedule
  ``bf16,delayed,current,block,mxfp8,bf16`` (its FP8 attention phases are refused);
- ``torch``: its plain-torch twin, ``TorchGPT``, in bf16 autocast throughout;
- ``compiled``: the twin with each block ``torch.compile``d (inductor), in bf16
  autocast throughout; by default on a GPU only (``--arms`` asks for it anywhere);
- ``torchao``: the twin converted by ``torchao.float8.convert_to_float8_training``
  (tensorwise scaling), each block ``torch.compile``d; only on a GPU with torchao.

Weights are fp32, compute runs under ``torch.autocast(dtype=torch.bfloat16)``,
the optimizer is AdamW (fused where torch has it for the device, or
``--adamw foreach|for-loop``) and losses are in bits per byte. At the end of each
phase (and every ``--eval-every`` steps) the validation loss is measured on a
fixed set of batches, under the phase's recipe and in plain bf16.

Only the arm in training holds its model, gradients and optimizer state on the
device: the twins wait on the CPU until their turn, and the te model (made first:
it is the weights' source) is dropped after its own. Each arm reports the bytes
of its linear layers' weights and of all its parameters, read from the tensors as
they are held (an FP8 parameter's data and scales), and on CUDA its peak memory:
``torch.cuda.max_memory_allocated`` from a reset at the start of its training,
its evaluations included.

``--fp8-params`` makes the te arm's linear weights FP8 parameters
(``te.quantized_model_init`` under the schedule's first FP8 recipe, keeping the
initial fp32 values on the CPU until the first step makes them the masters): the model
holds one byte an element plus scales, a quarter of the fp32 weights' bytes, and
each weight's fp32 master lives in AdamW's state, which every step updates and
casts back. Every phase runs with them, as follows:

- an FP8 phase trains bit for bit as the model whose fp32 weights are the masters.
  Delayed scaling casts the master at every forward; current scaling, block and
  MXFP8 re-cast the parameter from its master at the phase's first forward when
  it was stored under another scheme, and it then keeps that recipe's layout and
  scales (its bytes too: MXFP8 adds a scale per 32 elements) until another phase
  re-casts it;
- a bf16 phase computes in bf16 from the parameters' FP8 values, not from the
  masters (the weights *are* FP8; the optimizer still updates the masters), so its
  loss and every evaluation "in bf16" are those of the FP8 weights.

``--graphed`` runs the te arm's training steps through ``te.make_graphed_step``
(CUDA only): forward, loss, backward, clipping and the AdamW step replay from one
CUDA graph per recipe, the first two steps of each phase running eagerly (the
fuser builds the phase's plan, then the graph is captured). AdamW is then
``capturable`` with its learning rate a device tensor that the schedule fills
before each step. The numbers are the eager step's; the host's launch cost is
gone, so the rows show what the GPU work of the step costs.

``--profile-phase NAME`` runs three steps in the middle of phase NAME under
torch.profiler, for every arm: each arm's kernels by GPU time a step (its CPU ops
on a CPU) are printed and kept in the JSON with the phase, and those steps are left
out of the phase's tokens/s (they train as any other step: the same bits).
``--profile-switch NAME`` runs the te arm's first step of phase NAME (the recipe
switch: the re-fusion and every first use after it) under cProfile, its backward
on the calling thread: the host's functions by own time are printed and kept in
the JSON with the phase; that phase's first-step time is then the profiled one's.
``--trace-switch NAME`` runs it under torch.profiler instead: the GPU's kernel time
against the step's wall time, and the CUDA runtime calls (cudaMalloc, waits).
Every phase records the first step's time and, from eight steps on, the median of
three later steps, each timed alone the same way (between two syncs), with the
cudaMalloc calls of both.

    python examples/train_gpt.py --size smoke --steps 20 --json gpt.json --png gpt.png
    python examples/train_gpt.py --size gpu --fp8-params --arms te,torch --json gpt_fp8_params.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import triton
from torch import nn

import te_fuser as te
from te_fuser.models import (
    GPT, VALIDATION_FRACTION, GPTConfig, TorchGPT, compile_blocks, copy_weights, load_stdlib_corpus, sample_windows,
    split_corpus, torchao_float8,
)
from te_fuser.quantization.float8_tensor import Float8Tensor

RECIPES = {
    "bf16": None,
    "delayed": te.recipe.DelayedScaling(),
    "current": te.recipe.Float8CurrentScaling(),
    "block": te.recipe.Float8BlockScaling(),
    "mxfp8": te.recipe.MXFP8BlockScaling(),
    # FP8 attention (--attention te; head dims 32, 64 or 128)
    "delayed_mha": te.recipe.DelayedScaling(fp8_mha=True),
    "current_dpa": te.recipe.Float8CurrentScaling(fp8_dpa=True),
}
DEFAULT_SCHEDULES = {  # per --attention: torch's SDPA has no FP8 attention phases
    "te": "bf16,delayed,delayed_mha,current,current_dpa,block,mxfp8,bf16",
    "sdpa": "bf16,delayed,current,block,mxfp8,bf16",
}
MIB = 2**20
ARMS = ("te", "torch", "compiled", "torchao")
FIXED_NUMERICS = {"torch": "bf16", "compiled": "bf16", "torchao": "float8"}  # the arms that ignore the recipes
ADAMW_KINDS = ("auto", "fused", "foreach", "for-loop")
# Where a backward runs: autograd's device thread (torch's default for GPU tensors) or
# the thread that calls it. A host-bound step pays for the hand-over between the two.
BACKWARD_THREADS = ("autograd", "caller")


@dataclass(frozen=True)
class SizeDefaults:
    config: GPTConfig
    steps: int  # per phase
    lr: float
    corpus_bytes: int
    eval_batches: int


SIZES = {
    "smoke": SizeDefaults(GPTConfig.smoke(), steps=10, lr=2e-3, corpus_bytes=1_000_000, eval_batches=4),
    "gpu": SizeDefaults(GPTConfig.gpu(), steps=200, lr=6e-4, corpus_bytes=8_000_000, eval_batches=16),
}


@dataclass(frozen=True)
class Phase:
    name: str
    steps: int
    recipe: te.recipe.Recipe | None


# -- arguments -----------------------------------------------------------------------


def parse_schedule(text: str, default_steps: int) -> list[Phase]:
    """``"bf16,delayed:30"`` -> phases; an entry without ``:steps`` runs ``default_steps``."""
    phases = []
    for entry in text.split(","):
        name, _, steps = entry.strip().partition(":")
        if name not in RECIPES:
            raise ValueError(f"--schedule: unknown phase {name!r} in {entry!r} (choose from {', '.join(RECIPES)})")
        if steps and not (steps.isdigit() and int(steps) > 0):
            raise ValueError(f"--schedule: the step count of {entry!r} must be a positive integer")
        phases.append(Phase(name, int(steps) if steps else default_steps, RECIPES[name]))
    return phases


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    if _number(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return float(text)


def _non_negative_float(text: str) -> float:
    if _number(text) < 0:
        raise argparse.ArgumentTypeError(f"must be zero or positive, got {text!r}")
    return float(text)


def _arm_list(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"must be distinct names from {', '.join(ARMS)}, got {text!r}")
    return arms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, help="model and batch preset (default: gpu on CUDA, else smoke)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--steps", type=_positive_int, help="steps of a phase without its own count (default: per size)")
    p.add_argument("--schedule", help="te arm's phases: name[:steps],... with names from "
                   f"{', '.join(RECIPES)} (default: {DEFAULT_SCHEDULES['te']}; with --attention sdpa "
                   f"{DEFAULT_SCHEDULES['sdpa']})")
    p.add_argument("--arms", type=_arm_list, help="comma-separated, of " + ",".join(ARMS) + " (default: all of "
                   "them on a GPU; te,torch,torchao elsewhere, where compiling the twin's blocks is the slow part)")
    p.add_argument("--batch", type=_positive_int, help="batch size (default: per size)")
    p.add_argument("--seq-len", type=_positive_int, help="sequence length (default: per size)")
    p.add_argument("--lr", type=_positive_float, help="peak learning rate (default: per size)")
    p.add_argument("--warmup-steps", type=_non_negative_int, help="linear warm-up (default: a tenth of all steps)")
    p.add_argument("--weight-decay", type=_non_negative_float, default=0.1, help="AdamW's, on matrices only")
    p.add_argument("--clip", type=_non_negative_float, default=1.0, help="gradient norm clipping (0: off)")
    p.add_argument("--adamw", choices=ADAMW_KINDS, default="auto", help="implementation (auto: fused when supported)")
    p.add_argument("--corpus-bytes", type=_positive_int, help="stdlib bytes to read (default: per size)")
    p.add_argument("--eval-every", type=_non_negative_int, default=0,
                   help="also evaluate every N steps (0: at phase ends only)")
    p.add_argument("--eval-batches", type=_positive_int, help="validation batches (default: per size)")
    p.add_argument("--log-every", type=_positive_int, default=10, help="print a line every N steps")
    p.add_argument("--attention", choices=("te", "sdpa"), default="te",
                   help="the GPT's attention: te_fuser ops (RoPE, DotProductAttention), or torch's SDPA")
    p.add_argument("--fp8-params", action="store_true",
                   help="the te arm's linear weights as FP8 parameters, fp32 masters in AdamW's state")
    p.add_argument("--checkpoint", action="store_true",
                   help="every arm recomputes each block's activations in the backward instead of keeping them "
                        "(te.checkpoint for te, torch.utils.checkpoint for the twins)")
    p.add_argument("--graphed", action="store_true",
                   help="the te arm's steps replayed from CUDA graphs (te.make_graphed_step; CUDA only)")
    p.add_argument("--backward-thread", choices=BACKWARD_THREADS, default="autograd",
                   help="where every arm's backward runs: autograd's device thread (torch's default) or the "
                        "calling thread (torch.autograd.set_multithreading_enabled(False), for the whole run)")
    p.add_argument("--backend", choices=te.backend.BACKENDS, help="te_fuser kernel backend (default: the library's)")
    p.add_argument("--profile-phase", metavar="NAME",
                   help="profile three steps in the middle of phase NAME for every arm (torch.profiler): the kernels "
                        "(on CUDA; the CPU ops elsewhere) by time a step, printed and in the JSON; those steps are "
                        "left out of the phase's tokens/s")
    p.add_argument("--profile-switch", metavar="NAME",
                   help="profile the te arm's first step of phase NAME (the switch) with cProfile, the backward on the "
                        "calling thread: the host's functions by own time, printed and in the JSON")
    p.add_argument("--trace-switch", metavar="NAME",
                   help="trace the te arm's first step of phase NAME (the switch) with torch.profiler: its GPU "
                        "kernels' time against its wall time, and the CUDA runtime calls (allocations and waits "
                        "among them), printed and in the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the run's figures here")
    p.add_argument("--png", metavar="PATH", help="plot the loss curves here (needs matplotlib)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check ``argv``, filling the size's defaults; errors exit with one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device: {err}")
    if args.device.type == "cuda" and not cuda:
        parser.error(f"--device {args.device}: CUDA is not available here")
    args.size = args.size or ("gpu" if args.device.type == "cuda" else "smoke")
    if args.arms is None:
        args.arms = list(ARMS) if args.device.type == "cuda" else [a for a in ARMS if a != "compiled"]
    defaults = SIZES[args.size]
    for name in ("steps", "lr", "corpus_bytes", "eval_batches"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    try:
        args.config = defaults.config.replace(batch_size=args.batch or defaults.config.batch_size,
                                              seq_len=args.seq_len or defaults.config.seq_len,
                                              attention=args.attention, checkpoint=args.checkpoint)
        args.schedule = args.schedule or DEFAULT_SCHEDULES[args.attention]
        args.phases = parse_schedule(args.schedule, args.steps)
    except ValueError as err:
        parser.error(str(err))
    names = dict.fromkeys(p.name for p in args.phases)
    if args.profile_switch is not None and args.profile_switch == args.trace_switch:
        parser.error(f"--profile-switch and --trace-switch: one of them for phase {args.profile_switch!r}")
    for flag, phase in (("--profile-switch", args.profile_switch), ("--profile-phase", args.profile_phase),
                        ("--trace-switch", args.trace_switch)):
        if phase is not None and phase not in names:
            parser.error(f"{flag}: {phase!r} is not a phase of the schedule ({', '.join(names)})")
    if args.checkpoint and args.graphed:
        parser.error("--checkpoint with --graphed: a captured step does not recompute checkpointed blocks; "
                     "choose one")
    _check_attention_phases(parser, args)
    _check_windows_fit(parser, args)
    if args.graphed and args.device.type != "cuda":
        parser.error(f"--graphed: CUDA graphs need a CUDA device, got {args.device}")
    if args.graphed and args.fp8_params:
        parser.error("--graphed: not with --fp8-params (their re-casts between phases are not captured)")
    args.fp8_params_recipe = _fp8_params_recipe(args.phases) if args.fp8_params else None
    args.adamw = _resolve_adamw(parser, args.adamw, args.device)
    total = sum(p.steps for p in args.phases)
    args.warmup_steps = total // 10 if args.warmup_steps is None else args.warmup_steps
    return args


def _check_attention_phases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """FP8 attention is te_fuser's attention ops': refuse its phases for the SDPA model."""
    if args.attention == "te":
        return
    for phase in args.phases:
        if phase.recipe is not None and phase.recipe.fp8_attention:
            parser.error(f"--schedule: phase {phase.name!r} runs attention in FP8 (fp8_dpa / fp8_mha), which "
                         f"te_fuser's attention ops do; --attention sdpa runs torch's SDPA (use --attention te, "
                         f"or leave the phase out)")


def _fp8_params_recipe(phases: list[Phase]) -> te.recipe.Recipe:
    """The recipe FP8 parameters are first cast under: the schedule's first FP8 one
    (te's default recipe for an all-bf16 schedule)."""
    return next((p.recipe for p in phases if p.recipe is not None), te.DEFAULT_RECIPE)


def _check_windows_fit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    val_bytes = max(1, int(args.corpus_bytes * VALIDATION_FRACTION))
    window = args.config.seq_len + 1
    if window > val_bytes:
        parser.error(f"--seq-len {args.config.seq_len}: a window of {window} bytes does not fit the validation "
                     f"split ({val_bytes} bytes of --corpus-bytes {args.corpus_bytes}); raise --corpus-bytes")


def _resolve_adamw(parser: argparse.ArgumentParser, kind: str, device: torch.device) -> str:
    if kind not in ("auto", "fused"):
        return kind
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except RuntimeError as err:
        if kind == "fused":
            parser.error(f"--adamw fused: not supported on {device}: {err}")
        return "foreach"
    return "fused"


# -- one arm's training ------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_mallocs(device: torch.device) -> int | None:
    """How many segments the CUDA caching allocator has taken from the driver so far
    (each a cudaMalloc, which waits for the device); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0)


def _compute(recipe, device: torch.device):
    """bf16 autocast, plus te's FP8 autocast when ``recipe`` is given."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    stack.enter_context(te.autocast(enabled=recipe is not None, recipe=recipe))
    return stack


def loss_bits_per_byte(model: nn.Module, windows: torch.Tensor, recipe, device: torch.device) -> torch.Tensor:
    """Next-byte cross-entropy of (B, T+1) windows, in bits per byte."""
    inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
    with _compute(recipe, device):
        logits = model(inputs)  # (B, T, V)
    nats = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return nats / math.log(2)


def make_adamw(model: nn.Module, kind: str, lr: float, weight_decay: float,
               capturable: bool = False) -> torch.optim.AdamW:
    """AdamW on ``model``, decaying only its matrices. ``capturable``: the state and a
    tensor learning rate on the device, so that a CUDA graph can replay the step."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    if capturable:
        device = next(model.parameters()).device
        return torch.optim.AdamW(groups, lr=torch.tensor(lr, device=device), betas=(0.9, 0.95), capturable=True,
                                 **flags)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **flags)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then a cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class Arm:
    """One model under training, with its optimizer, data stream and records. The
    model and optimizer exist while the arm trains (``make`` builds the model when
    the te arm's is not given) and are dropped after, its memory with them."""

    name: str
    generator: torch.Generator
    model: nn.Module | None = None
    make: Callable[[], nn.Module] | None = None
    opt: torch.optim.Optimizer | None = None
    losses: list[float] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)  # losses not yet read back (no sync per step)
    profiles: dict = field(default_factory=dict)  # phase name -> its profiled steps' table (--profile-phase)
    phases: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    graphed: Callable | None = None  # te.make_graphed_step's step (--graphed), called with the batch
    step_recipe: object = None  # the recipe the graphed step computes under (read at eager steps and capture)

    def recipe(self, phase: Phase):
        """The te recipe of ``phase``: the schedule's for the te arm, None for the others."""
        return phase.recipe if self.name == "te" else None

    def numerics(self, phase: Phase) -> str:
        return FIXED_NUMERICS.get(self.name, phase.name)

    def refusions(self) -> int | None:
        return self.model.refusions() if isinstance(self.model, GPT) else None

    def read_losses(self) -> None:
        if self.pending:
            self.losses += torch.stack(self.pending).tolist()
            self.pending.clear()


@dataclass
class Run:
    """What every arm shares: arguments, data, the fixed validation batches."""

    args: argparse.Namespace
    train: torch.Tensor
    val_batches: list[torch.Tensor]
    total_steps: int


def train_step(arm: Arm, run: Run, recipe, step: int) -> None:
    args, config = run.args, run.args.config
    lr = learning_rate(step, run.total_steps, args.lr, args.warmup_steps)
    for group in arm.opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # the graphed step's AdamW reads it on the device
        else:
            group["lr"] = lr
    windows = sample_windows(run.train, config.batch_size, config.seq_len, arm.generator)  # (B, T+1)
    if arm.graphed is not None:
        arm.step_recipe = recipe
        with te.autocast(enabled=recipe is not None, recipe=recipe):  # the graph's key reads the recipe here
            arm.pending.append(arm.graphed(windows.to(args.device)))
        return
    arm.opt.zero_grad(set_to_none=True)
    arm.pending.append(_loss_backward_step(arm, run, windows, recipe))


def _loss_backward_step(arm: Arm, run: Run, windows: torch.Tensor, recipe) -> torch.Tensor:
    """The loss of ``windows``, its backward, clipping and the optimizer's step, on
    gradients that start at None; returns the loss, detached."""
    loss = loss_bits_per_byte(arm.model, windows, recipe, run.args.device)
    loss.backward()
    if run.args.clip > 0:
        nn.utils.clip_grad_norm_(arm.model.parameters(), run.args.clip)
    arm.opt.step()
    return loss.detach()


@torch.no_grad()
def validation_loss(arm: Arm, run: Run, recipe) -> float:
    arm.model.eval()
    total = sum(loss_bits_per_byte(arm.model, w, recipe, run.args.device) for w in run.val_batches)
    arm.model.train()
    return float(total) / len(run.val_batches)


def evaluate(arm: Arm, run: Run, phase: Phase, step: int) -> dict:
    """Validation bits/byte under the arm's numerics for ``phase`` and in plain bf16."""
    recipe = arm.recipe(phase)
    under_recipe = validation_loss(arm, run, recipe)
    if arm.name == "torchao":
        bf16 = None  # the converted model has no plain bf16 forward
    else:
        bf16 = under_recipe if recipe is None else validation_loss(arm, run, None)
    record = {"step": step, "phase": phase.name, "numerics": arm.numerics(phase), "val_bpb": under_recipe,
              "val_bpb_bf16": bf16}
    arm.evals.append(record)
    return record


def _log(arm: Arm, step: int, total: int, phase: Phase, tokens_per_s: float) -> None:
    refusions = arm.refusions()
    tail = "" if refusions is None else f"  re-fusions {refusions}"
    print(f"[{arm.name:<8}] step {step:>5}/{total} {arm.numerics(phase):<11} loss {arm.losses[-1]:.4f} bpb  "
          f"{tokens_per_s / 1e3:8.1f}k tok/s{tail}", flush=True)


@dataclass
class PhaseClock:
    """Training time of one phase, read at sync points: its first step (the
    recipe switch) alone, then the other steps; evaluation is left out."""

    device: torch.device
    first_step_ms: float | None = None
    lone_steps_ms: list = field(default_factory=list)  # steady steps each timed alone, as the first step is
    # segments the CUDA caching allocator took from the driver (cudaMalloc) in the first
    # step and in the step timed alone (None off CUDA)
    first_step_mallocs: int | None = None
    lone_step_mallocs: int | None = None  # over all the steps timed alone
    _mallocs0: int | None = None
    timed_s: float = 0.0
    timed_steps: int = 0
    last_window: tuple[float, int] | None = None  # (seconds, steps) between the last two sync points
    _t0: float = 0.0
    _steps: int = 0

    def restart(self) -> None:
        _sync(self.device)
        self._mallocs0 = _device_mallocs(self.device)
        self._t0, self._steps = time.perf_counter(), 0

    def _mallocs(self) -> int | None:
        return None if self._mallocs0 is None else _device_mallocs(self.device) - self._mallocs0

    def stepped(self) -> None:
        self._steps += 1

    def commit(self) -> None:
        """Count the steps since the last restart (a read, when there are any): before
        steps the clock must leave out, which a :meth:`restart` then follows."""
        if self._steps:
            self.read()

    def lone(self, step) -> None:
        """Run ``step`` timed alone between two syncs, as the first step is, and leave
        it out of the phase's rate: the first step's yardstick. A step timed alone
        also pays for filling the GPU's queue, which steps back to back overlap."""
        self.commit()
        self.restart()
        step()
        _sync(self.device)
        self.lone_steps_ms.append(1e3 * (time.perf_counter() - self._t0))
        mallocs = self._mallocs()
        if mallocs is not None:
            self.lone_step_mallocs = (self.lone_step_mallocs or 0) + mallocs
        self.restart()

    @property
    def lone_step_ms(self) -> float | None:
        """The first step's yardstick: the median of the steps timed alone (None: none were)."""
        return statistics.median(self.lone_steps_ms) if self.lone_steps_ms else None

    def read(self) -> tuple[float, int]:
        """Seconds and steps since the last restart (synchronising the device)."""
        _sync(self.device)
        elapsed = time.perf_counter() - self._t0
        if self.first_step_ms is None:
            self.first_step_ms = 1e3 * elapsed
            self.first_step_mallocs = self._mallocs()
        else:
            self.timed_s, self.timed_steps = self.timed_s + elapsed, self.timed_steps + self._steps
            self.last_window = (elapsed, self._steps)
        return elapsed, self._steps

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        return self.timed_steps * tokens_per_step / self.timed_s if self.timed_steps else None

    def steady_tokens_per_s(self, tokens_per_step: int) -> float | None:
        """The rate of the phase's last window (its last ``--log-every`` steps or fewer):
        past the first steps of a switch, a graph's capture among them."""
        if self.last_window is None:
            return None
        elapsed, steps = self.last_window
        return steps * tokens_per_step / elapsed


def train_phase(arm: Arm, run: Run, phase: Phase, first_step: int) -> None:
    """Run ``phase``'s steps, logging at its first and last step and every
    ``--log-every``; evaluate every ``--eval-every`` steps and at its end."""
    args = run.args
    tokens_per_step = args.config.batch_size * args.config.seq_len
    recipe, refusions_before = arm.recipe(phase), arm.refusions()
    clock = PhaseClock(args.device)
    clock.restart()
    profiled = _profiled_steps(args, phase)
    probe = None  # --profile-switch or --trace-switch: its first step and its step alone, for the te arm
    if arm.name == "te":
        probe = {args.profile_switch: _profile_switch, args.trace_switch: _trace_switch}.get(phase.name)
    if args.profile_phase == phase.name and not profiled:
        print(f"[{arm.name:<8}] {phase.name}: {phase.steps} steps, too few to profile ({PROFILED_STEPS + 2} or more)",
              flush=True)
    for i in range(phase.steps):
        if i in profiled:  # the profiled steps run together, at the first of them
            if i == profiled.start:
                _profile_steps(arm, run, phase, recipe, first_step + i, len(profiled), clock)
            continue
        # the steps timed alone: LONE_STEPS of them, or under a probe its one step (as the switch ran)
        lone = phase.steps >= LONE_MIN_STEPS and 0 <= phase.steps - LONE_FROM_END - i < (
            LONE_STEPS if probe is None else 1)
        if i == 0 and probe is not None:
            probe(arm, run, phase, recipe, first_step)
        elif lone and probe is not None:  # the step alone as the switch was, for comparison
            clock.lone(lambda: probe(arm, run, phase, recipe, first_step + i, "lone"))
        elif lone:
            clock.lone(lambda: train_step(arm, run, recipe, first_step + i))
        else:
            train_step(arm, run, recipe, first_step + i)
        if not lone:
            clock.stepped()
        done = first_step + i + 1
        eval_due = i == phase.steps - 1 or (args.eval_every and done % args.eval_every == 0)
        if i == 0 or eval_due or done % args.log_every == 0:
            elapsed, steps = (clock.lone_steps_ms[-1] / 1e3, 1) if lone else clock.read()
            arm.read_losses()
            _log(arm, done, run.total_steps, phase, steps * tokens_per_step / elapsed)
            if eval_due:
                evaluate(arm, run, phase, done)
            clock.restart()
    _finish_phase(arm, phase, first_step, clock, tokens_per_step, refusions_before)


PROFILED_STEPS = 3
# A phase of LONE_MIN_STEPS or more times LONE_STEPS of its steps alone, the last of them
# LONE_FROM_END from its end (``PhaseClock.lone``): their median is the yardstick of its
# first step (the switch), which one step alone, as noisy as the host, made loose.
# A profiled or traced switch (--profile-switch, --trace-switch) is measured against
# its one step alone run the same way.
LONE_MIN_STEPS, LONE_FROM_END, LONE_STEPS = 8, 2, 3


def _profiled_steps(args: argparse.Namespace, phase: Phase) -> range:
    """The steps of ``phase`` that ``--profile-phase`` profiles (empty when it names
    another phase, or the phase is too short): three in the middle, past the first
    step's switch and before the last step's evaluation."""
    if args.profile_phase != phase.name or phase.steps < PROFILED_STEPS + 2:
        return range(0)
    start = max(1, (phase.steps - PROFILED_STEPS) // 2)
    return range(start, start + PROFILED_STEPS)


def _profile_steps(arm: Arm, run: Run, phase: Phase, recipe, first: int, count: int, clock: PhaseClock) -> None:
    """``count`` training steps from step ``first`` under torch.profiler, left out of the
    phase's clock; their kernels (CUDA; CPU ops elsewhere) by time a step are printed
    and kept in the arm's record for the phase."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.args.device.type == "cuda"
    clock.commit()  # the steps so far count; the profiled steps do not
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for k in range(count):
            train_step(arm, run, recipe, first + k)
        _sync(run.args.device)
    rows, total = [], 0.0
    for event in prof.key_averages():
        if cuda:
            own = getattr(event, "self_device_time_total", None)
            own = event.self_cuda_time_total if own is None else own
            if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
                continue
        else:
            own = event.self_cpu_time_total
        rows.append((own / 1e3 / count, event.count / count, event.key))
        total += own / 1e3 / count
    rows.sort(reverse=True)
    arm.profiles[phase.name] = {"steps": count, "ms_per_step": total, "top": [
        {"name": name, "ms": ms, "calls": calls} for ms, calls, name in rows[:25]]}
    what = "GPU kernels" if cuda else "CPU ops (own time)"
    print(f"[{arm.name:<8}] {phase.name}: steps {first + 1}-{first + count} profiled: {what} {total:.2f} ms a step",
          flush=True)
    for ms, calls, name in rows[:12]:
        print(f"[{arm.name:<8}]   {ms:8.3f} ms {calls:6.1f}x  {name[:100]}", flush=True)
    clock.restart()  # after the trace is read: its processing is not the next steps' time


def _profile_switch(arm: Arm, run: Run, phase: Phase, recipe, step: int, what: str = "switch",
                    top: int = 25) -> None:
    """A step of ``phase`` under cProfile (``what``: "switch", its first step, or
    "lone", the step timed alone, for comparison), the backward on the calling
    thread so that its Python is seen; the functions with the most own time are
    printed and kept in the arm's record for the phase. At the lone step, the
    functions whose cumulative time the switch step exceeded it by most are printed
    and kept too: where the switch's extra time goes, callers and callees alike."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        train_step(arm, run, recipe, step)
        _sync(run.args.device)
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(((own * 1e3, calls, f"{name} ({file.rsplit('/', 1)[-1]}:{line})")
                   for (file, line, name), (_, calls, own, _, _) in stats.items()), reverse=True)
    total = sum(ms for ms, _, _ in rows)
    arm.profiles[f"{phase.name} {what} profile"] = {"ms_own_total": total, "top": [
        {"name": name, "ms": ms, "calls": calls} for ms, calls, name in rows[:top]]}
    print(f"[{arm.name:<8}] {phase.name}: the {what} step under cProfile, {total:.2f} ms of own time", flush=True)
    for ms, calls, name in rows[:15]:
        print(f"[{arm.name:<8}]   {ms:8.3f} ms {calls:6d}x  {name[:100]}", flush=True)
    switch_key = f"{phase.name} switch stats"
    if what == "switch":
        arm.profiles[switch_key] = stats  # read at the lone step, then dropped (not in the report)
        return
    switched = arm.profiles.pop(switch_key, None)
    if switched is None:
        return
    extra = []  # (switch - lone) cumulative ms and calls of each function the switch step ran
    for key, (_, calls, _, cum, _) in switched.items():
        _, lone_calls, _, lone_cum, _ = stats.get(key, (0, 0, 0.0, 0.0, None))
        file, line, name = key
        extra.append(((cum - lone_cum) * 1e3, calls - lone_calls, f"{name} ({file.rsplit('/', 1)[-1]}:{line})"))
    extra.sort(reverse=True)
    arm.profiles[f"{phase.name} switch extra"] = {"top": [
        {"name": name, "extra_ms": ms, "extra_calls": calls} for ms, calls, name in extra[:top]]}
    print(f"[{arm.name:<8}] {phase.name}: the switch step's cumulative time over the lone step's, by function",
          flush=True)
    for ms, calls, name in extra[:top]:
        print(f"[{arm.name:<8}]   {ms:+8.3f} ms {calls:+6d}x  {name[:100]}", flush=True)


def _trace_switch(arm: Arm, run: Run, phase: Phase, recipe, step: int, what: str = "switch", top: int = 12) -> None:
    """A step of ``phase`` under torch.profiler (``what``: "switch", its first step, or
    "lone", the step timed alone, for comparison): the time its GPU kernels take (on
    CUDA) against the step's wall time, and the host's CUDA runtime calls by time (a
    cudaMalloc or a synchronisation waits for the device), printed and kept in the
    arm's record for the phase."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.args.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step(arm, run, recipe, step)
        _sync(run.args.device)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    kernels_ms, kernels, runtime = 0.0, 0, []
    for event in prof.key_averages():
        on_device = getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type)
        if on_device:
            own = getattr(event, "self_device_time_total", None)
            kernels_ms += (event.self_cuda_time_total if own is None else own) / 1e3
            kernels += event.count
        elif event.key.startswith(("cuda", "cu")):  # the runtime's and the driver's API calls
            runtime.append((event.cpu_time_total / 1e3, event.count, event.key))
    runtime.sort(reverse=True)
    arm.profiles[f"{phase.name} {what} trace"] = {
        "wall_ms": wall_ms, "gpu_kernels_ms": kernels_ms if cuda else None, "gpu_kernels": kernels,
        "runtime": [{"name": name, "ms": ms, "calls": calls} for ms, calls, name in runtime[:top]]}
    print(f"[{arm.name:<8}] {phase.name}: the {what} step traced, {wall_ms:.2f} ms; GPU kernels {kernels_ms:.2f} ms "
          f"({kernels} launches)", flush=True)
    for ms, calls, name in runtime[:top]:
        print(f"[{arm.name:<8}]   {ms:8.3f} ms {calls:6d}x  {name[:100]}", flush=True)


def _finish_phase(arm: Arm, phase: Phase, first_step: int, clock: PhaseClock, tokens_per_step: int,
                  refusions_before: int | None) -> None:
    recipe, last_eval = arm.recipe(phase), arm.evals[-1]
    first_step_ms, tokens_per_s = clock.first_step_ms, clock.tokens_per_s(tokens_per_step)
    record = {
        "phase": phase.name, "numerics": arm.numerics(phase), "recipe": None if recipe is None else str(recipe),
        "steps": phase.steps, "first_step_ms": first_step_ms, "lone_step_ms": clock.lone_step_ms,
        "lone_steps_ms": list(clock.lone_steps_ms),
        "first_step_mallocs": clock.first_step_mallocs, "lone_step_mallocs": clock.lone_step_mallocs,
        "tokens_per_s": tokens_per_s,
        "steady_tokens_per_s": clock.steady_tokens_per_s(tokens_per_step),
        "val_bpb": last_eval["val_bpb"], "val_bpb_bf16": last_eval["val_bpb_bf16"],
    }
    if refusions_before is not None:
        record["refusions"] = arm.refusions() - refusions_before
    if phase.name in arm.profiles:
        record["profile"] = arm.profiles[phase.name]
    for what in ("switch", "lone"):
        for kind in ("profile", "trace", "extra"):
            if f"{phase.name} {what} {kind}" in arm.profiles:
                record[f"{what}_{kind}"] = arm.profiles[f"{phase.name} {what} {kind}"]
    record["weight_bytes"] = linear_weight_bytes(arm.model)  # FP8 parameters take each recipe's layout
    arm.phases.append(record)
    bf16 = "" if record["val_bpb_bf16"] is None else f", {record['val_bpb_bf16']:.4f} in bf16"
    speed = "" if tokens_per_s is None else f"; {tokens_per_s / 1e3:.1f}k tok/s"
    lone = "" if clock.lone_step_ms is None else f" (a step alone {clock.lone_step_ms:.1f} ms, the median of " \
                                                  f"{len(clock.lone_steps_ms)})"
    if clock.first_step_mallocs is not None:
        lone += f"; cudaMalloc {clock.first_step_mallocs} in the first step, {clock.lone_step_mallocs} alone"
    print(f"[{arm.name:<8}] steps {first_step + 1}-{first_step + phase.steps} {arm.numerics(phase)}: "
          f"validation {record['val_bpb']:.4f} bpb{bf16}{speed}; first step {first_step_ms:.1f} ms{lone}", flush=True)


def train_arm(arm: Arm, run: Run) -> None:
    """Make the arm's model and optimizer, train it through the schedule, record its
    memory, and drop them."""
    args = run.args
    arm.model = arm.model if arm.model is not None else arm.make()
    graphed = args.graphed and arm.name == "te"
    arm.opt = make_adamw(arm.model, args.adamw, args.lr, args.weight_decay, capturable=graphed)
    if graphed:
        arm.graphed = te.make_graphed_step(lambda windows: _loss_backward_step(arm, run, windows, arm.step_recipe),
                                           arm.model)
    start_mib = _reset_peak_memory(args.device)
    step = 0
    for phase in args.phases:
        train_phase(arm, run, phase, step)
        step += phase.steps
    arm.memory = {
        "fp8_parameters": any(type(p) is Float8Tensor for p in arm.model.parameters()),
        "weight_bytes": linear_weight_bytes(arm.model),
        "parameter_bytes": te.parameter_bytes(arm.model),
        "start_mib": start_mib,
        "peak_mib": _peak_memory(args.device),
    }
    arm.model = arm.make = arm.opt = arm.graphed = None


# -- memory ------------------------------------------------------------------------


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes the linear layers' weights hold, read from the tensors: an FP8
    parameter's FP8 data and scales, a plain weight's storage."""
    weights = [m.weight for m in model.modules() if isinstance(m, (te.ops.BasicLinear, nn.Linear))]
    return sum(w.fp8_nbytes if type(w) is Float8Tensor else w.untyped_storage().nbytes() for w in weights)


def _reset_peak_memory(device: torch.device) -> float | None:
    """Free what nothing refers to any more (a previous arm's model, the warm-up's)
    and start the peak count; the MiB allocated now. None off CUDA."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / MIB


def _peak_memory(device: torch.device) -> float | None:
    """The most MiB allocated since the reset. None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MIB


# -- the arms ----------------------------------------------------------------------


def _te_model(args: argparse.Namespace) -> GPT:
    """The te GPT; with ``--fp8-params`` its linear weights are FP8 parameters."""
    # the initial fp32 values wait on the CPU for the first step's masters: a start on the FP8 grid trains slower
    with te.quantized_model_init(enabled=args.fp8_params, recipe=args.fp8_params_recipe,
                                 preserve_high_precision_init_val=args.fp8_params):
        return GPT(args.config, args.device)


def _torchao_unavailable(args: argparse.Namespace) -> str | None:
    """Why the torchao arm cannot run here, or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return f"torchao.float8.convert_to_float8_training is not importable ({err})"
    if args.device.type != "cuda":
        return "torchao float8 training needs a CUDA device"
    return None


def _warm_up(run: Run, te_model: GPT) -> None:
    """Compile the te model's kernels and match its fusion rules for every recipe of
    the schedule in advance, as a user who knows the schedule does: ``te.warmup``
    runs the te arm's own model (a training step and an evaluation's forward under
    each recipe, and in bf16, which every phase also evaluates in) and puts its
    state back, keeping the plans' templates, so that no phase's first step pays for
    compilation and a first switch builds only its quantizers, as a switch back
    does. With ``--fp8-params`` it runs a model of its own, made as the te arm's
    (its kernels only): te.warmup re-casts FP8 parameters into each recipe it runs,
    which would move the te arm's weights."""
    recipes = list({p.name: p.recipe for p in run.args.phases}.values())
    sample = run.val_batches[0][:, :-1]  # (B, T)
    model = _te_model(run.args) if run.args.fp8_params else te_model
    with torch.autocast(run.args.device.type, dtype=torch.bfloat16):
        te.warmup(model, recipes if None in recipes else [*recipes, None], sample)


def build_arms(run: Run) -> tuple[list[Arm], dict[str, str]]:
    """The requested arms, all starting from one set of weights (the te model's,
    FP8 parameters' values included); and the skipped ones, with why. The te model
    is made on the device; the twins wait on the CPU until their arm trains."""
    args = run.args
    torch.manual_seed(args.seed)
    te_model = _te_model(args)
    twin = TorchGPT(args.config, "cpu")
    copy_weights(te_model, twin)
    arms, skipped = [], {}
    for name in args.arms:
        arm = Arm(name, torch.Generator().manual_seed(args.seed))
        if name == "te":
            arm.model = te_model
        elif name == "torch":
            arm.make = lambda: copy.deepcopy(twin).to(args.device)
        elif name == "compiled":
            arm.make = lambda: compile_blocks(copy.deepcopy(twin).to(args.device))
        else:
            skipped_why = _torchao_unavailable(args)
            if skipped_why is not None:
                skipped[name] = skipped_why
                print(f"torchao arm skipped: {skipped_why}")
                continue
            arm.make = lambda: torchao_float8(copy.deepcopy(twin).to(args.device))
        arms.append(arm)
    if "te" in args.arms:
        _warm_up(run, te_model)
    del te_model  # the te arm holds it, or nothing does
    return arms, skipped


# -- report ------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "te_fuser": te.__version__}
    revision = _source_revision()
    if revision:
        versions["te_fuser_git"] = revision
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    torchao = sys.modules.get("torchao")
    if torchao is not None:
        versions["torchao"] = getattr(torchao, "__version__", "unknown")
    return versions


def _source_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout this script is in, if it is one."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def make_report(run: Run, arms: list[Arm], skipped: dict[str, str], corpus: dict) -> dict:
    args = run.args
    settings = {k: getattr(args, k) for k in ("size", "schedule", "lr", "warmup_steps", "weight_decay", "clip",
                                               "adamw", "eval_every", "eval_batches", "seed", "backend",
                                               "fp8_params", "graphed", "backward_thread")}
    settings["fp8_params_recipe"] = None if args.fp8_params_recipe is None else str(args.fp8_params_recipe)
    return {
        "config": {**asdict(args.config), **settings, "phases": [_phase_entry(p) for p in args.phases]},
        "device": _device_name(args.device),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "corpus": corpus,
        "arms": {
            arm.name: {
                "losses": arm.losses, "phases": arm.phases, "evals": arm.evals,
                "tokens_per_s": _overall_tokens_per_s(arm.phases), "memory": arm.memory,
            }
            for arm in arms
        },
        "skipped": skipped,
    }


def _phase_entry(phase: Phase) -> dict:
    return {"name": phase.name, "steps": phase.steps, "recipe": None if phase.recipe is None else str(phase.recipe)}


def _overall_tokens_per_s(phases: list[dict]) -> float | None:
    """Over the timed steps of every phase (each phase's first step and its steps timed
    alone excluded)."""
    rates = [(p["steps"] - 1 - len(p["lone_steps_ms"]), p["tokens_per_s"]) for p in phases
             if p["tokens_per_s"]]
    if not rates:
        return None
    steps = sum(n for n, _ in rates)
    return steps / sum(n / r for n, r in rates)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_summary(arms: list[Arm]) -> None:
    print(f"\n{'arm':<8} {'phase':<11} {'numerics':<11} {'val bpb':>8} {'in bf16':>8} {'k tok/s':>8} "
          f"{'steady':>8} {'1st step ms':>11} {'alone ms':>8} {'1st/alone':>9}")
    for arm in arms:
        for p in arm.phases:
            bf16 = "-" if p["val_bpb_bf16"] is None else f"{p['val_bpb_bf16']:.4f}"
            speed, steady = ("-" if v is None else f"{v / 1e3:.1f}" for v in (p["tokens_per_s"],
                                                                              p["steady_tokens_per_s"]))
            lone = p["lone_step_ms"]
            switch = "-" if not lone else f"{p['first_step_ms'] / lone:.2f}x"
            print(f"{arm.name:<8} {p['phase']:<11} {p['numerics']:<11} {p['val_bpb']:>8.4f} {bf16:>8} {speed:>8} "
                  f"{steady:>8} {p['first_step_ms']:>11.1f} {_ms(lone):>8} {switch:>9}")
    print("(k tok/s: a phase's steps after its first; steady: its last --log-every window; 1st/alone: the "
          "phase's first step, a recipe switch, over the median of three steps timed alone; the target is 1.05x at "
          "most)")
    _print_ratios(arms)
    print(f"\n{'arm':<8} {'held as':<12} {'weights MiB':>11} {'params MiB':>10} {'start MiB':>9} {'peak MiB':>9}")
    for arm in arms:
        m = arm.memory
        held = "FP8 params" if m["fp8_parameters"] else "fp32"
        start, peak = ("-" if v is None else f"{v:.1f}" for v in (m["start_mib"], m["peak_mib"]))
        print(f"{arm.name:<8} {held:<12} {m['weight_bytes'] / MIB:>11.3f} {m['parameter_bytes'] / MIB:>10.3f} "
              f"{start:>9} {peak:>9}")
    print("(weights: the linear layers', as held; params: all parameters and buffers; start and peak: CUDA memory "
          "allocated when the arm began training and at most while it trained)")


def _print_ratios(arms: list[Arm]) -> None:
    """Per phase, the te arm's tokens/s over each other arm's in the same phase and
    the difference of their validation losses (te minus the other, bits per byte):
    the comparison a run is made for, read off the same records as the table above."""
    te_arm = next((a for a in arms if a.name == "te"), None)
    peers = [a for a in arms if a is not te_arm]
    if te_arm is None or not peers:
        return
    print(f"\n{'phase':<11} " + " ".join(f"{'te / ' + p.name:>16} {'bpb diff':>9}" for p in peers))
    for i, phase in enumerate(te_arm.phases):
        cells = []
        for peer in peers:
            other = peer.phases[i] if i < len(peer.phases) else None
            ours, theirs = phase["tokens_per_s"], other and other["tokens_per_s"]
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            diff = "-" if other is None else f"{phase['val_bpb'] - other['val_bpb']:+.4f}"
            cells.append(f"{ratio:>16} {diff:>9}")
        print(f"{phase['phase']:<11} " + " ".join(cells))


def write_png(path: str, report: dict) -> None:
    """The loss curves of every arm, with the te arm's phase boundaries; or one line saying why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        print(f"PNG not written to {path}: matplotlib is not importable ({err})")
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, arm in report["arms"].items():
        ax.plot(range(1, len(arm["losses"]) + 1), arm["losses"], label=name, linewidth=1)
    step = 0
    for phase in report["config"]["phases"]:
        ax.axvline(step, color="grey", linewidth=0.5)
        ax.text(step, 1.0, f" {phase['name']}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        step += phase["steps"]
    ax.set(xlabel="step", ylabel="training loss (bits per byte)", title="te_fuser GPT on the stdlib's source")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"PNG written to {path}")


# -- main --------------------------------------------------------------------------


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """The training split (on the device), the fixed validation batches, and a note on the corpus."""
    data = load_stdlib_corpus(args.corpus_bytes)
    train, val = split_corpus(data.to(args.device))
    val_gen = torch.Generator().manual_seed(args.seed + 1)
    batch, seq = args.config.batch_size, args.config.seq_len
    val_batches = [sample_windows(val, batch, seq, val_gen) for _ in range(args.eval_batches)]  # each (B, T+1)
    corpus = {"source": f"the .py files under {os.path.dirname(os.__file__)}", "bytes": len(data),
              "train_bytes": len(train), "val_bytes": len(val)}
    return train, val_batches, corpus


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.backend is not None:
        te.set_backend(args.backend)
    train, val_batches, corpus = load_data(args)
    run = Run(args, train, val_batches, total_steps=sum(p.steps for p in args.phases))
    print(f"GPT {args.size} on {_device_name(args.device)}: {args.config}; AdamW {args.adamw}; "
          f"corpus {corpus['bytes']} bytes; schedule {', '.join(f'{p.name}:{p.steps}' for p in args.phases)}")
    if args.fp8_params:
        print(f"te arm: linear weights as FP8 parameters, first cast under {args.fp8_params_recipe}")
    arms, skipped = build_arms(run)
    with torch.autograd.set_multithreading_enabled(args.backward_thread == "autograd"):  # this thread's setting
        for arm in arms:
            train_arm(arm, run)
    print_summary(arms)
    report = make_report(run, arms, skipped, corpus)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"JSON written to {args.json}")
    if args.png:
        write_png(args.png, report)
    return report


if __name__ == "__main__":
    main()
