"""The op fuser: plans keyed by the recipe string, rebuilt when the key changes.

Key = :class:`PlanKey` (recipe string, whether a backward is needed, compute
dtype, training, calibrating, device type, kernel backend). The hot path compares
the recipe *object* with the last one, then the cached strings, then the few other
fields (the backend through the change counter of ``te_fuser.epoch``). On a change:

1. build a candidate: fresh quantizers for every role (``quantizer_for`` or the
   recipe's ``qfactory``), carrying delayed-scaling state over from the old ones;
   forward and backward fusion passes over the rule table;
2. validate it fully: every op's shapes against its quantizers' block sizes,
   every quantizer's device needs, a backward plan covering every op;
3. publish it atomically (install the quantizers, drop cached quantized weights).

Any failure in 1-2 raises before anything is published: the previous plan, its
quantizers and caches stay exactly as they were. A backward always runs with the
plan captured by its forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize as _parametrize
from torch.nn.utils.prune import BasePruningMethod as _PruningMethod
from torch.utils.checkpoint import CheckpointFunction as _TorchCheckpointFunction

from .. import backend
from ..autocast import STATE_STACK as _AUTOCAST_STACK
from ..callable_key import FallbackChurnDetector
from ..quantization import quantizer_for
from ..quantization.base import Quantizer
from ..quantization.block import Float8BlockQuantizer
from ..quantization.current import Float8CurrentScalingQuantizer
from ..quantization.identity import IdentityQuantizer
from ..quantization.mxfp8 import MXFP8Quantizer
from ..quantization.rowwise import Float8RowwiseQuantizer
from ..quantization.amax_reduction import WORLD
from ..quantization.delayed import EVALUATING as _EVALUATING
from ..quantization.delayed import carry_states, place_states
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.recompute import ACTIVE as _CHECKPOINT_FRAMES
from ..quantization.tensor import QuantizedTensor
from ..recipe_agreement import casts_beside_collectives, check_ranks_agree
from . import compiled, hot_guard
from ..epoch import CHANGES as _EPOCH
from .basic.extra import resolve_channels
from .guard import Decision, Reads
from .op import BasicOperation, OpContext, RunConfig
from .rules import BuildContext, MatchResult, PlanStep, RuleTable, fusion_rule_table, match
from .saved import stow_saved, unstow_saved

__all__ = ["OperationFuser", "FusionPlan", "FusionStats", "PlanKey"]

# _EPOCH (ops/op.py) is bumped whenever any op installs quantizers or has a
# Parameter or hook registered; a plan remembers the value it saw, so an op used
# by another fuser (or on its own) in between is noticed cheaply.

# Sets that a caller pushes to learn which fusers ran (``te.make_graphed_step``
# checks that a captured step ran only ops of the model it was given).
RUN_WATCH: list[set] = []

# Attributes whose assignment disarms a fuser's guard: the armed decision
# (guard.Decision) was derived from them.
_DISARMING = frozenset({"_plan", "_params", "_flat_params", "own_recipe"})

# While te.apply_recipe probes a model's shapes: fuser -> the recipe it would get,
# ("plans", fuser) -> the plan its calls need (see OperationFuser._probe).
_PROBE: dict = {}


@contextlib.contextmanager
def probing(recipes: dict):
    """Inside the block, the fusers in ``recipes`` (fuser -> recipe) do not run their
    ops: each call builds, without publishing, the plan it would need under its
    recipe and answers zeros of the output's shape (``te.apply_recipe``'s shape
    probe). Yields ``(plans, failed)``: a dict fuser -> plan, filled as calls come,
    and a one-item list holding the fuser whose plan could not be built, if any."""
    if _PROBE:
        raise RuntimeError("apply_recipe: called while another apply_recipe probes a model")
    _PROBE.update(recipes)
    for fuser in recipes:
        if fuser._guard is not None:
            fuser._guard.disarm()
    plans, failed = {}, [None]
    try:
        yield plans, failed
    finally:
        failed[0] = _PROBE.get("failed")
        plans.update({key[1]: plan for key, plan in _PROBE.items() if isinstance(key, tuple) and key[0] == "plans"})
        _PROBE.clear()

_BASE_CHECK_DEVICE = Quantizer.check_device
HIGH_PRECISION_KEY = "high_precision"  # the recipe part of a plan's key without a recipe
_FLOATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_SHAPES = 64  # input shapes a plan (and a plan template) remembers as validated
_MAX_TEMPLATES = 8  # plan templates a fuser keeps (recipe keys and build contexts seen last)

# torch's global forward hooks, which run for the ops as for any module's call.
_GLOBAL_HOOK_DICTS = (_module_hooks._global_forward_pre_hooks, _module_hooks._global_forward_hooks)


@dataclass
class FusionStats:
    """Counters of one fuser (or the sum over a Sequential's fusers)."""

    builds: int = 0
    hits: int = 0
    key: str | None = None
    build_seconds: float = 0.0
    last_build_phases: dict[str, float] = field(default_factory=dict)

    def add(self, other: "FusionStats") -> None:
        """Count ``other``'s figures in (a Sequential's or a model's sum)."""
        self.builds += other.builds
        self.hits += other.hits
        self.build_seconds += other.build_seconds
        self.key = other.key if other.key is not None else self.key
        for phase, secs in other.last_build_phases.items():
            self.last_build_phases[phase] = self.last_build_phases.get(phase, 0.0) + secs


class FuserSnapshot(NamedTuple):
    """What :meth:`OperationFuser.restore` puts back: the published plan, the recipe
    last matched to it, the counters and the fallback-churn detector's state."""

    plan: "FusionPlan | None"
    last_recipe: object
    stats: FusionStats
    churn: tuple


class PlanKey(NamedTuple):
    """Everything that selects a plan: what the hot path (Python and compiled)
    compares, what the report shows."""

    recipe: str  # the recipe's string, or "high_precision"
    needs_backward: bool
    dtype: torch.dtype  # the compute dtype
    training: bool
    calibrating: bool
    device_type: str
    backend: str  # the kernel backend in force (its fusion decisions and kernel notes read it)


@dataclass
class FusionPlan:
    key: PlanKey
    recipe_key: str
    run: RunConfig
    quantizers: list[dict]
    forward: list[PlanStep]
    backward: list[PlanStep]
    declined: list[str]
    notes: list[str]
    out_shape: torch.Size | None = None
    amax_reduction_group: object = None  # te.autocast's group: delayed-scaling amaxes are all-reduced over it
    epoch: int = -1
    build_phases: dict = field(default_factory=dict)  # seconds per phase of the candidate's build
    in_shape: torch.Size | None = None  # the input shape of the last call (validated)
    shapes: dict = field(default_factory=dict)  # validated input shape -> output shape (bounded)
    # forward and backward as run_forward and run_backward run them, made at the first call
    forward_steps: tuple | None = field(default=None, repr=False, compare=False)
    backward_steps: tuple | None = field(default=None, repr=False, compare=False)
    # An evaluation plan published while the ops hold another recipe's quantizers: it
    # casts with its own and leaves theirs, and their scaling state, as they are
    private: bool = False
    # Whether none of its quantizers keeps scaling state (see _keepable)
    stateless: bool = True

    def __post_init__(self) -> None:  # the key's fields, unpacked for the hot path
        key = self.key
        self.needs_backward, self.dtype, self.training = key.needs_backward, key.dtype, key.training
        self.calibrating, self.device_type, self.backend = key.calibrating, key.device_type, key.backend
        self.is_cuda = self.device_type == "cuda"

    @property
    def installs(self) -> bool:
        """Whether the plan's quantizers are the ops' own (not for high precision)."""
        return self.run.recipe is not None


@dataclass
class PlanTemplate:
    """What plans for one recipe key and build context share (see
    ``OperationFuser._template``): the rule table matched, both passes' steps, the
    kernel notes, and the input shapes validated (-> output shape, bounded)."""

    table: object  # the RuleTable matched (None: fusion off)
    forward: MatchResult
    backward: MatchResult
    notes: list[str]
    shapes: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)  # PlanKey -> the last plan built from it (see _may_publish_again)


_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_any_autocast = torch._C._is_any_autocast_enabled


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = "cuda" if x.is_cuda else x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class OperationFuser:
    """Runs a list of basic ops through a fused plan."""

    def __init__(self, ops: Sequence[BasicOperation], fuse: bool = True,
                 hook_modules: Sequence[torch.nn.Module] = (), rules: "RuleTable | None" = None) -> None:
        self.ops = list(ops)
        self.fuse = fuse
        self.rules = rules  # the fusion rules of its plans (None: the table in force at each build)
        # Parameters are read live from the ops' dicts (each op's and its submodules',
        # _refresh_params), so a replaced Parameter (tying, assign-loads, FSDP2) is what
        # runs and trains; a pruned or parametrized one through its module's attribute.
        self._param_dicts: tuple = ()
        # The modules whose forward hooks this fuser runs around its ops (those not
        # called through their own ``__call__``), and the hook dicts that must be
        # empty for a call to skip them.
        self.hook_modules = tuple(hook_modules)
        self._hook_dicts = tuple(d for m in self.hook_modules for d in (
            m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks))
        self._n_extra_in = [op.num_extra_inputs for op in self.ops]
        self._n_extra_out = [op.num_extra_outputs for op in self.ops]
        self._has_extra_outputs = sum(self._n_extra_out) > 0
        self._branches = sum(self._n_extra_in) > 0 or self._has_extra_outputs
        # Extra tensors on named channels stay inside (ops/basic/extra.py): routes is None
        # when no op binds one; else the call's extra inputs and outputs are the public slots.
        self.routes = resolve_channels(self.ops)
        self.channel_problem = None if self.routes is None else self.routes.problem  # raised at plan build
        self._n_public_in = self._n_extra_in if self.routes is None else [
            sum(i == j for j, _ in self.routes.public_inputs) for i in range(len(self.ops))]
        self._num_extra_inputs = sum(self._n_public_in)
        self._num_extra_outputs = (sum(self._n_extra_out) if self.routes is None
                                   else len(self.routes.public_outputs))
        # (op, slot) of each extra input, in call order, where a residual seq(x, x) may hand
        # its gradient to the first op's backward (_input_as_extra); () where none may
        residual = self.routes is None and not self._has_extra_outputs and self.ops[0].adds_input_grad
        self._residual_slots = tuple((i, k) for i, n in enumerate(self._n_extra_in) for k in range(n)) \
            if residual else ()
        self._refresh_params()
        self._plan: FusionPlan | None = None
        self._last_recipe = None
        self._last_state = None  # the autocast state last matched to the published plan
        # The model's own recipe (te.apply_recipe): (recipe or None, pinned), or None;
        # with the autocast state it resolves to the state the plan is chosen for.
        self.own_recipe: tuple | None = None
        self._resolved: tuple = (None, None)  # (autocast state, the state it resolved to)
        self._stats = FusionStats()
        self.handle = compiled.register(self)  # what a torch.compile graph calls it by
        self._churn = FallbackChurnDetector(f"te_fuser ({', '.join(op.describe() for op in self.ops[:3])}...)")
        self._make_entry()

    def _make_entry(self, guard_type=None) -> None:
        """``self.entry(x, training)``: the hot path for calls without extra inputs,
        a guard (``ops/guard.py``): the compiled one (``hot_guard.c``) unless
        ``guard_type`` names another (``guard.ReferenceGuard``), else, when the
        compiled one does not load, :meth:`run` itself."""
        if guard_type is None:
            module = hot_guard.guard_module()
            guard_type = module.Guard if module is not None else None
        if guard_type is None:
            self._guard, self.entry = None, self.run
            return
        self._guard = guard_type(*Reads(self._run_and_arm, _AUTOCAST_STACK, _EPOCH, _grad_enabled, _any_autocast,
                                        compute_dtype, torch.Tensor, _GLOBAL_HOOK_DICTS))
        self.entry = self._guard

    def __setattr__(self, name: str, value) -> None:
        if name in _DISARMING:  # the armed decision read these: it no longer holds
            guard = self.__dict__.get("_guard")
            if guard is not None:
                guard.disarm()
            if name == "own_recipe":
                object.__setattr__(self, "_resolved", (None, None))
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict:  # copies and pickles get a guard (and plan templates) of their own
        self.stats  # noqa: B018 (takes the guard's hits into the statistics)
        return {k: v for k, v in self.__dict__.items() if k not in ("_guard", "entry", "_templates")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._templates = {}
        self.handle = compiled.register(self)
        self._make_entry()

    @property
    def stats(self) -> FusionStats:
        """The fuser's counters (the compiled guard's hits taken in first)."""
        guard = self.__dict__.get("_guard")
        if guard is not None:
            self._stats.hits += guard.take_hits()
        return self._stats

    @property
    def plan(self) -> FusionPlan | None:
        return self._plan

    def snapshot(self) -> FuserSnapshot:
        """The fuser's plan and counters as they are now (see :meth:`restore`)."""
        stats = self.stats
        return FuserSnapshot(self._plan, self._last_recipe,
                             dataclasses.replace(stats, last_build_phases=dict(stats.last_build_phases)),
                             self._churn.snapshot())

    def restore(self, snapshot: FuserSnapshot) -> None:
        """Publish ``snapshot``'s plan again with its counters (te.warmup's undo). The
        next call re-checks its ops' quantizers (they may have been restored too)."""
        self.stats  # noqa: B018 (takes the guard's hits in before they are replaced)
        self._plan, self._last_recipe, self._last_state = snapshot.plan, snapshot.last_recipe, None
        self._stats = dataclasses.replace(snapshot.stats, last_build_phases=dict(snapshot.stats.last_build_phases))
        self._churn.restore(snapshot.churn)

    @property
    def num_extra_inputs(self) -> int:
        """The extra inputs a call takes (those not read from a channel)."""
        return self._num_extra_inputs

    @property
    def num_extra_outputs(self) -> int:
        """The extra outputs a call returns (those not kept on a channel)."""
        return self._num_extra_outputs

    # -- the hot path ---------------------------------------------------------
    def __call__(self, x: torch.Tensor, *extra_inputs: torch.Tensor, training: bool | None = None):
        training = self.ops[0].training if training is None else training
        return self.call(x, training, extra_inputs)

    def call(self, x: torch.Tensor, training: bool, extra_inputs: tuple = ()):
        """Run the ops on ``x``: the compiled guard or :meth:`run`, or, while
        ``torch.compile`` traces, the custom op that stands for them (``ops/compiled.py``)."""
        if _is_compiling():
            if self.hook_modules and self._hooks_present():
                return self._run_hooked(x, training, extra_inputs, compiled.compiled_call)
            return compiled.compiled_call(self, x, training, extra_inputs)
        return self.entry_with_extras(x, training, extra_inputs) if extra_inputs else self.entry(x, training)

    def entry_with_extras(self, x: torch.Tensor, training: bool, extra_inputs: tuple):
        """The hot path of a call with extra inputs (a residual ``seq(x, x)``): the
        guard's check of ``x`` and the parameters (``guard.matches``), then the extra
        inputs' share of condition 5 (one that requires grad needs a plan with a
        backward), and the plan runs; anything else goes to the miss path, which
        arms the guard with its decision. Nothing of the guard's decision reads the
        extra inputs but their ``requires_grad``: the ops check their shapes."""
        guard = self._guard
        if guard is not None and guard.matches(x, training):
            plan = self._plan  # the armed plan: publishing another disarms the guard
            if plan.needs_backward or not _any_requires_grad(extra_inputs):
                self._stats.hits += 1
                return apply_plan(x, (self, plan), *self._flat_params, *extra_inputs)
        return self._run_and_arm(x, training, extra_inputs) if guard is not None else self.run(x, training, extra_inputs)

    def output_meta(self, shape, dtype: torch.dtype, compute: torch.dtype, extra_dtypes: list):
        """``(output shape, output dtype, [(shape, dtype) of each extra output])`` for an
        input of ``shape`` and ``dtype``, without running anything (a graph's fake outputs)."""
        shape, extras_in = torch.Size(shape), iter(extra_dtypes)
        routes, written = self.routes, {}  # (op, slot) -> (shape, dtype) of an extra output
        for i, op in enumerate(self.ops):
            if routes is None:
                mine = [next(extras_in) for _ in range(op.num_extra_inputs)]
            else:
                mine = [next(extras_in) if src is None else written[src][1] for src in routes.sources[i]]
            for o in range(op.num_extra_outputs):
                written[(i, o)] = (shape, dtype)
            out_shape = torch.Size(op.check_shapes(shape, {}))
            dtype, shape = op.output_dtype(dtype, compute, mine), out_shape
        public = [written[slot] for slot in routes.public_outputs] if routes is not None else list(written.values())
        return shape, dtype, public

    def run(self, x: torch.Tensor, training: bool, extra_inputs: tuple = ()):
        """Run the ops on ``x``: the fuser's reference path (the compiled guard
        makes the same decisions); positional arguments only, for speed."""
        if self.hook_modules and self._hooks_present():
            return self._run_hooked(x, training, extra_inputs, OperationFuser._run)
        return self._run(x, training, extra_inputs)

    def _run(self, x: torch.Tensor, training: bool, extra_inputs: tuple):
        # The guard's conditions (ops/guard.py), read as the guard reads them; plan_for compares them.
        if not isinstance(x, torch.Tensor):  # 2
            if isinstance(x, QuantizedTensor):  # a quantizer's own output (TransformerEngine's usage): as a Float8Tensor
                return self._run(Float8Tensor.from_quantized(x), training, extra_inputs)
            raise TypeError(f"op fuser ({self.ops[0].describe()}...): input must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if not self._params_current():  # behind 9: the ops' dicts, which the guard does not read
            self._refresh_params()
        if self._derived:
            if self._parametrized and not _parametrize._cache_enabled:
                with _parametrize.cached():  # the ops read the value evaluated here, with its graph
                    return self._run(x, training, extra_inputs)
            self._read_derived()
        raw = _AUTOCAST_STACK[-1]  # 3: te.autocast's state (see autocast.current_state)
        state = raw if self.own_recipe is None else self.resolve(raw)
        if _PROBE:
            return self._probe(x, training, extra_inputs, state)
        needs_backward = _grad_enabled() and (  # 5
            x.requires_grad or self._params_require_grad() or any(t.requires_grad for t in extra_inputs)
        )
        if not needs_backward and state.recipe is not None and not state.calibrating:
            refuse_reentrant_checkpoint(self, x, extra_inputs)  # before a plan is built
        dtype = compute_dtype(x) if _any_autocast() else x.dtype  # 6
        plan = self.plan_for(x, training, needs_backward, dtype, state, raw)
        return apply_plan(x, (self, plan), *self._flat_params, *extra_inputs)

    def plan_for(self, x: torch.Tensor, training: bool, needs_backward: bool, dtype: torch.dtype, state, raw):
        """The plan a call with these conditions runs: the published one when it
        applies (a hit), else a new one built and published. ``state`` is what
        te.autocast's ``raw`` state resolved to (see :meth:`resolve`).

        The guard's conditions (``ops/guard.py``, numbered as there), with the
        re-validation this path adds where the guard compares by identity."""
        plan = self._plan
        if (
            plan is not None  # 1
            and plan.needs_backward is needs_backward  # 5
            and plan.dtype is dtype  # 6
            and plan.training is training  # 1
            and plan.is_cuda is x.is_cuda  # 7
            and (raw is self._last_state or self._same_config(plan, state, raw))  # 3
            and (plan.epoch == _EPOCH[0] or self._still_installed(plan))  # 9
        ):
            if x.shape != plan.in_shape:  # 8
                self._accept_shape(plan, x.shape)
            self._stats.hits += 1
            return plan
        plan = self.build(state.recipe, state.calibrating, x.shape, dtype, x.device, needs_backward, training,
                          state.amax_reduction_group)
        self._last_state = raw
        return plan

    def resolve(self, state):
        """The state a call under te.autocast's ``state`` runs with, given the
        model's own recipe (see ``te.apply_recipe``): a pinned recipe holds unless
        the region overrides pinned ones; an applied one yields to a region that
        names a recipe or disables FP8."""
        raw, resolved = self._resolved
        if state is raw:
            return resolved
        recipe, pinned = self.own_recipe
        if (pinned and not state.override_pinned) or not (pinned or state.named):
            resolved = type(state)(recipe is not None, recipe, state.calibrating and recipe is not None,
                                   state.amax_reduction_group, True, False)
        else:
            resolved = state
        self._resolved = (state, resolved)
        return resolved

    def _run_and_arm(self, x: torch.Tensor, training: bool, extra_inputs: tuple = ()):
        """The guard's miss: :meth:`run` decides (building if needed) and runs; the
        guard is then armed with its decision (a ``guard.Decision``), for the calls
        that repeat it (with extra inputs, through :meth:`entry_with_extras`)."""
        out = self.run(x, training, extra_inputs)
        plan, state, guard = self._plan, self._last_state, self._guard
        if plan is not None and state is not None and guard is not None and not _PROBE and not self._derived and not (
                self.hook_modules and self._hooks_present()):  # hooks, derived parameters: every call takes this path
            guard.arm(Decision(state, plan.training, plan.needs_backward, tuple(self._flat_params), plan.dtype,
                               plan.is_cuda, plan.in_shape, plan.epoch, plan_entry(), (self, plan)))
        return out

    # -- parameters, read live -------------------------------------------------------
    def _params_current(self) -> bool:
        """Whether the ops' parameter dicts still hold what :meth:`_refresh_params` read
        (``_flat_params`` itself unless a parameter is derived), under the same names
        (looked at once a te_fuser.epoch change: pruning renames a Parameter)."""
        flat, i = self._read_params, 0
        for params in self._param_dicts:
            for p in params.values():
                if p is not None:
                    if i == len(flat) or flat[i] is not p:
                        return False
                    i += 1
        if i != len(flat):
            return False
        if self._names_epoch != _EPOCH[0]:
            if self._param_names != _parameter_names(self._param_dicts):
                return False
            self._names_epoch = _EPOCH[0]
        return True

    def _refresh_params(self) -> None:
        """Read the parameters the ops hold now, per op its slots in the order it
        registered them (:func:`_parameter_slots`): a Parameter, or for a pruned or
        parametrized one the tensor its module's attribute gives now (``_derived``:
        read again every call, :meth:`_read_derived`)."""
        dicts, read, params, derived, flat_index = [], [], [], [], 0
        for op in self.ops:
            mine = []
            for m in _parameter_modules(op):
                dicts.append(m._parameters)
                read.extend(p for p in m._parameters.values() if p is not None)
                for name, p in _parameter_slots(m):
                    if p is None:  # read again with its graph by each call (a read here would save tensors)
                        derived.append((flat_index, m, name))
                        with torch.no_grad():
                            p = getattr(m, name)
                    mine.append(p)
                    flat_index += 1
            params.append(mine)
        self._param_dicts = tuple(dicts)
        self._param_names, self._names_epoch = _parameter_names(self._param_dicts), _EPOCH[0]
        self._params = params
        self._flat_params = [p for ps in params for p in ps]
        self._read_params = self._flat_params if not derived else read
        self._derived = tuple(derived)
        self._parametrized = any(_parametrize.is_parametrized(m, name) for _, m, name in derived)
        # Per op: its slice of the autograd inputs (x, fuser and plan, *params, *extra inputs)
        # and of the flat parameter gradients, computed once for every backward.
        self._grad_slices = _grad_slices([len(ps) for ps in params], self._n_public_in)
        self._grad_flag_memo: dict = {}  # autograd's flags -> each op context's (see _grad_flags)
        self._templates: dict = {}  # the plan templates (see _template): their validated shapes read the parameters

    # -- forward hooks of the ops ------------------------------------------------------
    def _hooks_present(self) -> bool:
        if _GLOBAL_HOOK_DICTS[0] or _GLOBAL_HOOK_DICTS[1]:
            return True
        for hooks in self._hook_dicts:
            if hooks:
                return True
        return False

    def _run_hooked(self, x: torch.Tensor, training: bool, extra_inputs: tuple, run_ops):
        """Run the ops' forward hooks around ``run_ops(self, x, training, extra_inputs)``,
        as one module's: every pre-hook (module order) sees the fuser's input and may
        replace it, then the ops run, then every post-hook sees that input and the
        output and may replace the output (see ``Sequential``'s doc)."""
        for module in self.hook_modules:
            if module._backward_hooks or module._backward_pre_hooks:
                raise RuntimeError(
                    f"op fuser: {type(module).__name__} has module backward hooks, which cannot run inside a fused "
                    "group (its own input and output gradients are never formed); register them on the Sequential "
                    "or on the tensors instead"
                )
            x = _pre_hooks(module, x)
        out = run_ops(self, x, training, extra_inputs)
        for module in self.hook_modules:
            out = _post_hooks(module, x, out)
        return out

    def _accept_shape(self, plan: FusionPlan, shape: torch.Size) -> None:
        """Validate an input of another shape against the plan (the ops' own checks
        and their quantizers' block sizes), then let the plan take it."""
        if shape not in plan.shapes:
            _remember_shape(plan.shapes, shape, self._check_shapes(shape, plan.quantizers))
        plan.in_shape = shape

    def _same_config(self, plan: FusionPlan, state, raw) -> bool:
        """Whether ``state`` (resolved from ``raw``, an autocast state other than the
        last one seen) selects ``plan``: the same recipe object or string,
        calibration flag and group (the re-validation of the guard's condition 3)."""
        recipe = state.recipe
        if not (
            (recipe is self._last_recipe or (recipe is not None and plan.recipe_key == recipe.key))
            and plan.calibrating is state.calibrating
            and plan.amax_reduction_group is state.amax_reduction_group
        ):
            return False
        self._last_recipe, self._last_state = recipe, raw
        return True

    def _read_derived(self) -> None:
        """The derived parameters' tensors as their modules give them now (a pruning
        hook has just set the attribute; a parametrization is evaluated, under grad
        mode as the call runs, so its gradient reaches the parametrization's own)."""
        flat = self._flat_params
        for i, m, name in self._derived:
            flat[i] = getattr(m, name)

    def _params_require_grad(self) -> bool:
        for p in self._flat_params:
            if p.requires_grad:
                return True
        return False

    def _still_installed(self, plan: FusionPlan) -> bool:
        """Whether the plan still holds after a change somewhere (te_fuser.epoch, the
        guard's condition 9): its kernel backend is the one in force and the ops
        still hold its quantizers (a high-precision plan holds none and depends on none)."""
        if plan.backend != backend.get_backend():
            return False
        if plan.private:  # its quantizers are its own while the ops hold another recipe's
            if not self._holds_another_recipe(plan.recipe_key):
                return False
            plan.epoch = _EPOCH[0]
            return True
        if plan.installs and not self._holds_quantizers_of(plan):
            return False
        plan.epoch = _EPOCH[0]
        return True

    def _holds_quantizers_of(self, plan: FusionPlan) -> bool:
        """Whether every op holds exactly ``plan``'s quantizers, installed under its recipe key."""
        for op, qs in zip(self.ops, plan.quantizers):
            if op.installed_quantizers is not qs or op.quantizer_key != plan.recipe_key:
                return False
        return True

    def _holds_another_recipe(self, recipe_key: str) -> bool:
        """Whether the ops hold quantizers built for a recipe other than ``recipe_key``."""
        for op in self.ops:
            key = op.quantizer_key
            if key is not None and key != recipe_key:
                return True
        return False

    # -- building a plan --------------------------------------------------------
    def build(self, recipe, calibrating, shape, dtype, device, needs_backward, training,
              amax_reduction_group=None) -> FusionPlan:
        """Build, validate and publish the plan for these conditions (the slow path)."""
        plan = self.candidate(recipe, calibrating, shape, dtype, device, needs_backward, training,
                              amax_reduction_group)
        self.publish(plan)
        return plan

    def candidate(self, recipe, calibrating, shape, dtype, device, needs_backward, training,
                  amax_reduction_group=None) -> FusionPlan:
        """Build and validate the plan for these conditions without publishing it:
        on any failure it raises and nothing of the fuser or its ops has changed."""
        device = torch.device(device)
        if self.channel_problem is not None:
            raise ValueError(f"op fuser ({', '.join(op.describe() for op in self.ops[:3])}...): "
                             f"{self.channel_problem}")
        t0 = time.perf_counter()
        phases = {}
        self._check_dtype(dtype, recipe is not None and not calibrating)
        recipe_key = str(recipe) if recipe is not None else HIGH_PRECISION_KEY
        if recipe is not None and needs_backward:
            check_ranks_agree(recipe_key)  # a recipe's first training plan: every rank builds one (or an error)
        if recipe is not None:
            casts_beside_collectives(device)
        plan_recipe = recipe if (recipe is not None and not calibrating) else None
        key = PlanKey(recipe_key, needs_backward, dtype, training, calibrating, device.type, backend.get_backend())
        template = self._template(plan_recipe, recipe_key, needs_backward, device)
        kept = template.plans.get(key)
        if kept is not None and kept.amax_reduction_group is amax_reduction_group and self._may_publish_again(kept):
            shape = torch.Size(shape)
            if shape not in kept.shapes:  # the plan's checks of another shape (raising leaves it as it was)
                _remember_shape(kept.shapes, shape, self._check_shapes(shape, kept.quantizers))
            kept.in_shape = shape
            kept.build_phases = {"kept": time.perf_counter() - t0}
            return kept
        t1 = time.perf_counter()
        phases["fusion"] = t1 - t0
        if recipe is None:  # high precision reads no quantizer and leaves the installed ones (their state) alone
            quantizers = [{} for _ in self.ops]
        elif all(op.quantizer_key == recipe_key for op in self.ops):
            # Quantizers are rebuilt iff the recipe key changed: a plan for another grad
            # mode or dtype under the same recipe shares the installed ones.
            quantizers = [op.installed_quantizers for op in self.ops]
        else:
            quantizers = self._build_quantizers(recipe, recipe_key, borrow_state=True)
            place_states([q for qs in quantizers for q in qs.values()], device)  # fresh ones share one state
        t2 = time.perf_counter()
        phases["quantizers"] = t2 - t1
        shape = torch.Size(shape)
        out_shape = template.shapes.get(shape)
        if out_shape is None:
            out_shape = self._validate(shape, device, quantizers, template.backward.steps if needs_backward else None)
            _remember_shape(template.shapes, shape, out_shape)
        else:  # the shapes checked under this recipe before; the fresh quantizers' device needs again
            self._check_devices(device, quantizers)
        fwd, bwd, notes = template.forward, template.backward, template.notes
        t3 = time.perf_counter()
        phases["validation"] = t3 - t2
        run = RunConfig(recipe, calibrating, dtype, needs_backward, training, recipe_key)
        plan = FusionPlan(key, recipe_key, run, quantizers, fwd.steps, bwd.steps, fwd.declined + bwd.declined, notes,
                          out_shape=out_shape, amax_reduction_group=amax_reduction_group,
                          in_shape=shape, shapes=template.shapes)  # a shape one plan takes, all of its template take
        plan.build_phases = phases
        plan.stateless = _keepable(quantizers)
        template.plans[key] = plan
        return plan

    def _may_publish_again(self, kept: FusionPlan) -> bool:
        """Whether ``kept`` (the last plan built for its key, published before) may
        be published for its key again instead of a new one. A plan whose quantizers
        hold no state may, unless the ops hold quantizers of its recipe key already
        that are not its own, as where another plan of that key was built since (the
        plans of one recipe key share the installed quantizers; see
        :meth:`candidate`). A plan whose quantizers keep scaling state (delayed
        scaling) may only while the ops hold exactly its quantizers, whose state is
        then the live one: a training step after a validation under the same recipe
        (and back) publishes its plan again; after a switch away, or where it was an
        evaluation's own (private) plan, a new plan continues the state installed."""
        if not kept.installs:
            return True
        if not kept.stateless:
            return self._holds_quantizers_of(kept)
        for op, qs in zip(self.ops, kept.quantizers):
            if op.quantizer_key == kept.recipe_key and op.installed_quantizers is not qs:
                return False
        return True

    def _template(self, plan_recipe, recipe_key: str, needs_backward: bool, device: torch.device) -> PlanTemplate:
        """The parts of a plan that the recipe's key, the build context, the kernel
        backend (and what its choices are) and the rule table decide: the fusion
        passes' steps, the kernel notes and the input shapes validated (the plans
        built from it share them). Matched once and kept (a few, see
        ``_MAX_TEMPLATES``), so a switch back to a recipe seen before builds only
        its quantizers. A rule's predicate answers from the ops' configuration, the
        recipe and the build context, which is what makes its answer reusable."""
        table = (self.rules or fusion_rule_table()) if self.fuse else None
        key = (recipe_key if plan_recipe is not None else None, needs_backward, device, backend.get_backend(),
               backend.choices_version(), id(table))
        template = self._templates.get(key)
        if template is not None and template.table is table:
            return template
        context = BuildContext(needs_backward, device)
        links = () if self.routes is None else self.routes.links
        fwd = match(self.ops, "forward", plan_recipe, enabled=self.fuse, context=context, table=table, links=links)
        bwd = match(self.ops if needs_backward else [], "backward", plan_recipe, enabled=self.fuse, context=context,
                    table=table, links=links)
        template = PlanTemplate(table, fwd, bwd, self._kernel_notes(plan_recipe, device))
        if len(self._templates) >= _MAX_TEMPLATES:
            del self._templates[next(iter(self._templates))]  # the oldest
        self._templates[key] = template
        return template

    def publish(self, plan: FusionPlan) -> None:
        """Make a :meth:`candidate` the published plan (installing its quantizers)."""
        t0 = time.perf_counter()
        self._publish(plan)
        phases = dict(plan.build_phases)
        phases["publish"] = time.perf_counter() - t0
        stats = self.stats
        stats.builds += 1
        stats.key = plan.recipe_key
        stats.build_seconds += sum(phases.values())
        stats.last_build_phases = phases
        self._churn.observe(plan.recipe_key)
        self._last_recipe = plan.run.recipe
        self._last_state = None  # the state that selected the published plan (set by run)

    def _probe(self, x: torch.Tensor, training: bool, extra_inputs: tuple, state):
        """``te.apply_recipe``'s shape probe: build (never publish) the plan this call
        would need under the recipe being applied, record it, and return zeros of
        the output's shape instead of running the ops."""
        recipe = _PROBE[self] if self in _PROBE else state.recipe
        dtype = compute_dtype(x) if _any_autocast() else x.dtype
        seen = _PROBE.get(("plans", self))
        _PROBE["failed"] = self  # the fuser an error comes from, for apply_recipe's message
        if seen is None:
            seen = self.candidate(recipe, False, x.shape, dtype, x.device, True, training)
            _PROBE[("plans", self)] = seen
        elif x.shape != seen.in_shape:
            self._accept_shape(seen, x.shape)
        del _PROBE["failed"]
        y = torch.zeros(seen.shapes[x.shape], dtype=dtype, device=x.device)
        extras = [torch.zeros(x.shape, dtype=dtype, device=x.device) for _ in range(self._num_extra_outputs)]
        return (y, *extras) if extras else y

    def _build_quantizers(self, recipe, recipe_key: str, borrow_state: bool = False) -> list[dict]:
        """Fresh quantizers for every role, continuing the scaling state of the
        installed ones (or of a loaded checkpoint). Nothing installed is touched.
        ``borrow_state``: fresh states are borrowed until ``place_states``, which the
        caller runs on them next (see ``quantizer_for``)."""
        out, pairs = [], []
        for op in self.ops:
            qs = {}
            if recipe is not None:
                for role in op.roles():
                    q = quantizer_for(recipe, role, borrow_state=borrow_state)
                    pairs.append((q, op.installed_quantizers.get(role.tensor_type)))
                    qs[role.tensor_type] = q
            out.append(qs)
        carry_states(pairs)  # each q continues its predecessor (many delayed ones together)
        for op, qs in zip(self.ops, out):
            for tensor_type, q in qs.items():
                op.restore_loaded_state(q, tensor_type, recipe_key)
        return out

    def _validate(self, shape, device, quantizers: list[dict], backward_steps: list[PlanStep] | None) -> torch.Size:
        out_shape = self._check_shapes(shape, quantizers)
        self._check_devices(device, quantizers)
        if backward_steps is not None:
            covered = sorted(i for step in backward_steps for i in step.indices)
            if covered != list(range(len(self.ops))):
                raise RuntimeError(
                    f"op fuser: the backward plan covers ops {covered}, expected all of 0..{len(self.ops) - 1}")
        return out_shape

    @staticmethod
    def _check_devices(device, quantizers: list[dict]) -> None:
        """Each quantizer's device needs (its ``check_device``), asked once per need
        where the check is the base class's: the first quantizer with a compute
        capability not yet checked raises for it; one of its own is always asked."""
        checked = {None}
        for qs in quantizers:
            for q in qs.values():
                need = q.min_compute_capability
                if type(q).check_device is not _BASE_CHECK_DEVICE:
                    q.check_device(device)
                elif need not in checked:
                    q.check_device(device)
                    checked.add(need)

    def _check_shapes(self, shape, quantizers: list[dict]) -> torch.Size:
        """Each op's checks of its input shape (and its quantizers' block sizes); the output shape."""
        shape = torch.Size(shape)
        if self.routes is not None and self.routes.links:  # a channel's reader gets the writer's shape
            in_shapes = []
            for op, qs in zip(self.ops, quantizers):
                in_shapes.append(shape)
                shape = torch.Size(op.check_shapes(shape, qs))
            self.routes.check_shapes(self.ops, in_shapes)
            return shape
        for op, qs in zip(self.ops, quantizers):
            shape = torch.Size(op.check_shapes(shape, qs))
        return shape

    def _check_dtype(self, dtype: torch.dtype, quantizing: bool) -> None:
        allowed = _QUANTIZABLE_DTYPES if quantizing else _FLOATING_DTYPES
        if dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(
                f"op fuser ({', '.join(op.describe() for op in self.ops[:3])}): input dtype must be one of "
                f"{names}{' under an FP8 recipe' if quantizing else ''}, got {str(dtype).replace('torch.', '')}"
            )

    @staticmethod
    def _kernel_notes(recipe, device: torch.device) -> list[str]:
        """Which backend runs each kernel this recipe uses (and any fallback)."""
        if recipe is None:
            return []
        names = ["gemm", "dequantize"]
        if recipe.delayed():
            names += ["quantize_tensorwise", "quantize_tensorwise_column_sums", "delayed_scale_update"]
        elif recipe.float8_current_scaling():
            names += ["quantize_current", "quantize_current_column_sums"]  # the latter for a bias gradient with the cast
        elif recipe.float8_rowwise_scaling():
            names.append("quantize_rowwise")
        elif recipe.float8_block_scaling():
            names.append("quantize_block")
        elif recipe.mxfp8():
            names.append("quantize_mxfp8")
        notes = []
        for name in names:
            choice = backend.resolve(name, device)
            notes.append(f"{name}: {choice.backend}" + (f" ({choice.note})" if choice.note else ""))
        return notes

    def _publish(self, plan: FusionPlan) -> None:
        self._plan = plan
        if not plan.installs:
            plan.epoch = _EPOCH[0]
            return
        # a delayed-scaling recipe with reduce_amax reduces over te.autocast's group, or
        # over the default process group (looked up at each cast) when none is given
        reduce = plan.run.recipe is not None and getattr(plan.run.recipe, "reduce_amax", False)
        group = (plan.amax_reduction_group if plan.amax_reduction_group is not None else WORLD) if reduce else None
        for qs in plan.quantizers:
            for q in qs.values():
                if hasattr(q, "amax_reduction_group"):
                    q.amax_reduction_group, q.recipe_key = group, plan.recipe_key
        # a validation under another recipe: training's quantizers stay installed (a
        # calibration installs: recording into the ops' quantizers is what it is for)
        plan.private = not plan.training and not plan.calibrating and self._holds_another_recipe(plan.recipe_key)
        if plan.private:
            plan.epoch = _EPOCH[0]
            return
        changed = False
        for op, qs in zip(self.ops, plan.quantizers):
            if op.installed_quantizers is not qs or op.quantizer_key != plan.recipe_key:
                op.install_quantizers(qs, plan.recipe_key)
                changed = True
        if changed:
            _EPOCH[0] += 1
        plan.epoch = _EPOCH[0]


# Quantizer classes whose quantizers hold no scaling state: one built for a recipe
# key casts as a fresh one of that key does, whatever it cast before (its prepared
# casts are constants of its configuration). Exactly these classes: a subclass
# may keep state of its own.
_STATELESS = (Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, Float8RowwiseQuantizer,
              IdentityQuantizer)


def _keepable(quantizers: list[dict]) -> bool:
    """Whether a plan with ``quantizers`` may be published again for its key later
    instead of a new one (``PlanTemplate.plans``): none of them keeps state."""
    for qs in quantizers:
        for q in qs.values():
            if type(q) not in _STATELESS:
                return False
    return True


def _remember_shape(shapes: dict, shape: torch.Size, out_shape: torch.Size) -> None:
    """Keep ``shape -> out_shape`` as validated (at most ``_MAX_SHAPES``: past that, start over)."""
    if len(shapes) >= _MAX_SHAPES:
        shapes.clear()
    shapes[shape] = out_shape


def _pre_hooks(module: torch.nn.Module, x):
    """``module``'s forward pre-hooks (torch's global ones first) on ``(x,)``, as
    ``nn.Module.__call__`` runs them; the input they leave."""
    args, kwargs = (x,), {}
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for hook_id, hook in (*_GLOBAL_HOOK_DICTS[0].items(), *module._forward_pre_hooks.items()):
        if hook_id in with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result}.")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args[0]


def _post_hooks(module: torch.nn.Module, x, out):
    """``module``'s forward hooks (torch's global ones first) on ``((x,), out)``; the output they leave."""
    args = (x,)
    with_kwargs = module._forward_hooks_with_kwargs
    for hook_id, hook in (*_GLOBAL_HOOK_DICTS[1].items(), *module._forward_hooks.items()):
        if hook_id in with_kwargs or hook_id in _module_hooks._global_forward_hooks_with_kwargs:
            result = hook(module, args, {}, out)
        else:
            result = hook(module, args, out)
        if result is not None:
            out = result
    return out


def _any_requires_grad(tensors: tuple) -> bool:
    for t in tensors:
        if t.requires_grad:
            return True
    return False


def _split(items: Sequence, counts: Sequence[int]) -> list[list]:
    out, i = [], 0
    for n in counts:
        out.append(list(items[i : i + n]))
        i += n
    return out


def _grad_slices(param_counts: Sequence[int], extra_counts: Sequence[int]) -> list[tuple[slice, slice, int]]:
    """Per op: (its parameters' slice of ``needs_input_grad``, its extra inputs' slice
    of it, the offset of its first parameter among the flat parameters)."""
    out, p, e = [], 2, 2 + sum(param_counts)
    for n_p, n_e in zip(param_counts, extra_counts):
        out.append((slice(p, p + n_p), slice(e, e + n_e), p - 2))
        p, e = p + n_p, e + n_e
    return out


class _ForwardStep(NamedTuple):
    """One forward step as :func:`run_forward` runs it (``FusionPlan.forward_steps``)."""

    executor: object  # BasicOperation | FusedOperation
    lo: int  # the step's ops are fuser.ops[lo:hi]
    hi: int
    plain_input: bool  # its first op's kernels read plain tensors (a Float8Tensor input is dequantized first)
    extras: tuple  # without channels: per op, its (start, stop) among the call's extra inputs
    basic: bool  # a basic op with the base class's fuser_forward: its op_forward is called directly


class _BackwardStep(NamedTuple):
    """One backward step as :func:`run_backward` runs it, in the order it runs."""

    executor: object
    lo: int
    hi: int
    no_extras: tuple  # the steps' output-gradient lists when the fuser has no extra outputs
    basic: bool  # a basic op with the base class's fuser_backward: its op_backward is called directly


def _forward_steps(fuser: OperationFuser, plan: FusionPlan) -> tuple:
    offsets, start = [], 0
    for n in fuser._n_extra_in:
        offsets.append((start, start + n))
        start += n
    steps = tuple(_ForwardStep(step.executor, step.indices[0], step.indices[-1] + 1,
                               not fuser.ops[step.indices[0]].accepts_fp8_input,
                               tuple(offsets[i] for i in step.indices),
                               type(step.executor).fuser_forward is BasicOperation.fuser_forward)
                  for step in plan.forward)
    plan.forward_steps = steps
    return steps


def _backward_steps(plan: FusionPlan) -> tuple:
    steps = tuple(_BackwardStep(step.executor, step.indices[0], step.indices[-1] + 1, _NO_EXTRAS[len(step.indices)],
                                type(step.executor).fuser_backward is BasicOperation.fuser_backward)
                  for step in reversed(plan.backward))
    plan.backward_steps = steps
    return steps


def _unrecorded(run, *args):
    """``run(*args)`` of a plan in evaluation mode, its forward or its backward, with
    delayed scaling's recording off (its casts take the scale as it stands:
    ``quantization/delayed.py``)."""
    _EVALUATING[0] = True
    try:
        return run(*args)
    finally:
        _EVALUATING[0] = False


def run_forward(fuser: OperationFuser, plan: FusionPlan, x, extra_inputs):
    """The plan's forward steps on ``x``: ``(contexts, output, extra outputs)``."""
    if not plan.training and not _EVALUATING[0]:
        return _unrecorded(run_forward, fuser, plan, x, extra_inputs)
    run = plan.run
    ctxs = [OpContext(op, qs, run) for op, qs in zip(fuser.ops, plan.quantizers)]
    steps = plan.forward_steps or _forward_steps(fuser, plan)
    if not fuser._branches:  # no extra inputs or outputs: the common case, kept short
        if extra_inputs:
            raise ValueError(f"op fuser: expected 0 extra input(s), got {len(extra_inputs)}")
        for executor, lo, hi, plain_input, _, basic in steps:
            if plain_input and type(x) is Float8Tensor:
                x = x.dequantize()  # its kernels read plain tensors
            if basic:
                x, _ = executor.op_forward(ctxs[lo], x, ())
            else:
                x, _ = executor.fuser_forward(ctxs[lo:hi], x, _NO_EXTRAS[hi - lo])
        return ctxs, x, []
    if len(extra_inputs) != fuser._num_extra_inputs:
        raise ValueError(f"op fuser: expected {fuser.num_extra_inputs} extra input(s), got {len(extra_inputs)}")
    routes = fuser.routes
    if routes is None and not fuser._has_extra_outputs:  # extra inputs only (a residual add): kept short
        for executor, lo, hi, plain_input, extras, basic in steps:
            if plain_input and type(x) is Float8Tensor:
                x = x.dequantize()
            if basic:
                a, b = extras[0]
                x, _ = executor.op_forward(ctxs[lo], x, extra_inputs[a:b])
            else:
                x, _ = executor.fuser_forward(ctxs[lo:hi], x, [extra_inputs[a:b] for a, b in extras])
        return ctxs, x, []
    extras_in = _split(extra_inputs, fuser._n_extra_in) if routes is None else \
        routes.place_inputs(fuser._n_extra_in, extra_inputs)
    extras_out: list[list] = [[] for _ in fuser.ops]
    for executor, lo, hi, plain_input, _, _ in steps:
        if routes is not None:  # channel reads: the writers ran in earlier steps (rules.match keeps them apart)
            for i in range(lo, hi):
                for k, w, o in routes.reads[i]:
                    extras_in[i][k] = extras_out[w][o]
        if plain_input and type(x) is Float8Tensor:
            x = x.dequantize()  # its kernels read plain tensors
        x, outs = executor.fuser_forward(ctxs[lo:hi], x, extras_in[lo:hi])
        for i, o in zip(range(lo, hi), outs):
            extras_out[i] = o
    if routes is not None:
        return ctxs, x, [extras_out[i][o] for i, o in routes.public_outputs]
    return ctxs, x, [t for o in extras_out for t in o]


class _NoExtras(dict):
    """``_NO_EXTRAS[n]``: a tuple of ``n`` empty tuples, the extra inputs (or their
    gradients) of a step of ``n`` ops without branches; built once per ``n``."""

    def __missing__(self, n: int) -> tuple:
        value = self[n] = ((),) * n
        return value


_NO_EXTRAS = _NoExtras()


_GRAPH_TOKEN = torch.empty(0)


def keep_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else keep()


_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # (pack, unpack) in force, or None
_HOOKS_WARNED: list = []


def _parameter_names(dicts: tuple) -> tuple:
    return tuple(tuple(d) for d in dicts)


def _parameter_modules(op: BasicOperation):
    """The modules whose parameters are ``op``'s: the op and its submodules, but not
    what a parametrization keeps (its originals and its own parameters are reached
    through the parametrized tensor's graph)."""
    skipped: set = set()
    for m in op.modules():
        if id(m) in skipped:
            continue
        held = m._modules.get("parametrizations") if _parametrize.is_parametrized(m) else None
        if held is not None:
            skipped.update(id(sub) for sub in held.modules())
        yield m


def pruned_names(m: torch.nn.Module) -> set:
    """The names of ``m``'s tensors that ``torch.nn.utils.prune`` masks (each kept as
    ``<name>_orig``, the masked tensor set as an attribute by a forward pre-hook)."""
    return {h._tensor_name for h in m._forward_pre_hooks.values() if isinstance(h, _PruningMethod)}


def _parameter_slots(m: torch.nn.Module) -> list:
    """``[(name, Parameter or None)]``: ``m``'s parameters in the order it registered
    them (``WatchedModule._param_order``, then any other in its dict's order), None
    where the op must read the module's attribute instead: a parametrized name
    (``torch.nn.utils.parametrize``: weight_norm, LoRA-like reparametrizations) or a
    pruned one (``torch.nn.utils.prune``, whose ``<name>_orig`` it stands for)."""
    params = m._parameters
    pruned = pruned_names(m)
    parametrized = m._modules["parametrizations"] if _parametrize.is_parametrized(m) else {}
    order = m.__dict__.get("_param_order", ())
    names = [*order, *(n for n in params if n not in order), *(n for n in parametrized if n not in order)]
    slots = []
    for name in names:
        if name in parametrized or name in pruned:
            slots.append((name, None))
        elif name.endswith("_orig") and name[:-5] in pruned:
            continue
        elif params.get(name) is not None:
            slots.append((name, params[name]))
    return slots


_EVAL_BACKWARD_WARNED: list = []


def _warn_eval_backward() -> None:
    """Once a process: parameter gradients from ops in evaluation mode under a recipe
    whose scaling keeps a history, which moves in training mode only."""
    _EVAL_BACKWARD_WARNED.append(True)
    warnings.warn(
        "te_fuser: parameter gradients from ops in evaluation mode (model.eval()) under delayed scaling: like "
        "the forward, the backward of an evaluation records no amax, so the scaling histories stay as training "
        "left them. To train, call model.train() (to train without dropout, set its probability to 0)", stacklevel=3)


def _warn_hooks_unseen() -> None:
    """Once a process: a fuser ran under autograd's saved-tensor hooks outside
    te.checkpoint, where its ops keep their saved state on the node."""
    _HOOKS_WARNED.append(True)
    warnings.warn(
        "te_fuser: a fused group ran under autograd's saved-tensor hooks (torch.utils.checkpoint, "
        "torch.autograd.graph.save_on_cpu, ...) outside te.checkpoint: its ops keep what they saved on the autograd "
        "node, out of the hooks' reach, so nothing of theirs is dropped or moved, and torch.utils.checkpoint's "
        "recomputation of them runs under the te.autocast state of the backward and is thrown away. "
        "For activation checkpointing of te ops call te.checkpoint(function, *args)", stacklevel=2)


# The code of torch's reentrant checkpoint's forward (torch.utils.checkpoint.checkpoint(use_reentrant=True))
_REENTRANT_CHECKPOINT_FORWARD = _TorchCheckpointFunction.forward.__code__
_STACK_DEPTH_SEARCHED = 64


def _reentrant_checkpoint_above() -> "str | None":
    """The name of a reentrant checkpoint whose forward runs further up the stack:
    torch's ``CheckpointFunction``, or an ``autograd.Function`` of another library
    whose class name says checkpoint (DeepSpeed's, Megatron's); None if none."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH_SEARCHED):
        if frame is None:
            return None
        code = frame.f_code
        if code is _REENTRANT_CHECKPOINT_FORWARD:
            return "torch.utils.checkpoint.checkpoint(..., use_reentrant=True)"
        if code.co_name == "forward" and code.co_argcount:
            ctx = frame.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, torch.autograd.function.BackwardCFunction) and "checkpoint" in type(ctx).__name__.lower():
                return type(ctx).__name__.removesuffix("Backward")
        frame = frame.f_back
    return None


def refuse_reentrant_checkpoint(fuser: "OperationFuser", x: torch.Tensor, extra_inputs: tuple) -> None:
    """A fused group running under an FP8 recipe without autograd although an input
    requires grad: the signature of a reentrant checkpoint's forward, whose backward
    runs the region again outside this te.autocast (its gradients would be a
    high-precision forward's, and delayed scaling's scales move in between). Raises
    there, naming the checkpoint; elsewhere (no_grad around a leaf that requires
    grad) returns."""
    if not (x.requires_grad or _any_requires_grad(extra_inputs)):
        return
    name = _reentrant_checkpoint_above()
    if name is not None:
        raise RuntimeError(
            f"op fuser ({fuser.ops[0].describe()}...): runs inside {name} under an FP8 recipe. A reentrant "
            f"checkpoint runs its region again in the backward, outside this forward's te.autocast, so the "
            f"gradients would be those of a high-precision forward and delayed scaling's scales would move between "
            f"the two runs. Checkpoint te ops with te.checkpoint(function, *args), which replays the forward's "
            f"recipe and scales, or with use_reentrant=False (without an FP8 recipe the reentrant checkpoint is fine)")


class _FuserFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, fuser_and_plan, *tensors):
        fuser, plan = fuser_and_plan
        if not plan.needs_backward and plan.installs and (x.requires_grad or len(tensors) > len(fuser._flat_params)):
            refuse_reentrant_checkpoint(fuser, x, tensors[len(fuser._flat_params):])  # a guard's hit in a checkpoint?
        if RUN_WATCH:
            RUN_WATCH[-1].add(fuser)
        extra_inputs = tensors[len(fuser._flat_params):]
        ctxs, y, extra_outputs = run_forward(fuser, plan, x, extra_inputs)
        if _CHECKPOINT_FRAMES[0] is None and _CHECKPOINT_FRAMES[1] is None:
            stowed = False
            fctx.save_for_backward(_GRAPH_TOKEN)  # autograd frees it with the graph: a second backward then raises
            if _saved_tensor_hooks(False) is not None and not _HOOKS_WARNED:
                _warn_hooks_unseen()
        else:  # inside te.checkpoint: autograd's saved-tensor hooks see (drop, then rebuild) every saved tensor
            stowed = True
            fctx.save_for_backward(_GRAPH_TOKEN, *stow_saved(ctxs))
        fctx.state = (fuser, plan, ctxs, x.dtype, _input_as_extra(fuser, x, extra_inputs), stowed)
        if not extra_outputs:
            return y
        seen = {id(x), id(y), *(id(t) for t in tensors)}
        fixed = []
        for t in extra_outputs:  # an output must not alias an input or another output
            fixed.append(t.clone() if id(t) in seen else t)
            seen.add(id(fixed[-1]))
        return (y, *fixed)

    @staticmethod
    def backward(fctx, dy, *grad_extra_outputs):
        if _grad_enabled():  # create_graph=True: the gradients are made, but not differentiable again
            with torch.no_grad():
                grads = _FuserFunction.backward(fctx, dy, *grad_extra_outputs)
            return _not_differentiable_again(grads)
        saved = fctx.saved_tensors  # raises, as torch does, when the graph was freed by an earlier backward
        fuser, plan, ctxs, x_dtype, input_as_extra, stowed = fctx.state
        if stowed:  # the tensors autograd kept (or te.checkpoint's recomputation rebuilt) back in place
            unstow_saved(ctxs, saved[1:])
        if not keep_graph():
            fctx.state = None  # the saved tensors go with this backward, as autograd's own do
        return run_backward(fuser, plan, ctxs, fctx.needs_input_grad, x_dtype, dy, grad_extra_outputs,
                            input_as_extra)


_TWICE = (b"te_fuser: a second derivative through te ops is not supported (a gradient made with "
          b"create_graph=True, e.g. for a gradient penalty, then differentiated again): a fused group's backward "
          b"is not differentiable. The gradient itself is right; leave the te ops out of what is differentiated twice")


def _not_differentiable_again(grads: tuple) -> tuple:
    """A fused group's gradients under ``create_graph=True``: each an alias that requires
    grad through a node that raises if a backward reaches it (torch's
    ``once_differentiable``, but whether or not the incoming gradients require grad,
    since the second derivative also runs through the saved input and weights)."""
    aliases = []
    for g in grads:
        if g is not None:
            g = g.detach().requires_grad_()
        aliases.append(g)
    return torch._C._functions.DelayedError(_TWICE, len(aliases))(*aliases)


# torch's C entry of Function.apply, bound to _FuserFunction (torch's Python apply ends in it)
_function_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _FuserFunction)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_OWN_ATTRIBUTES = _FuserFunction.__dict__  # a live view: shows an ``apply`` assigned to the class


def plan_entry():
    """What runs a plan, ``entry(x, (fuser, plan), *parameters, *extra_inputs)``:
    torch's C entry of ``Function.apply`` without its Python wrapper, whose work
    the function does not need (it has no ``setup_context``; under functorch's
    transforms the C entry refuses it as the wrapper would), or a stand-in
    assigned to ``_FuserFunction.apply`` (a benchmark's plan that does nothing).
    A guard is armed with it."""
    return _FuserFunction.apply if "apply" in _OWN_ATTRIBUTES else _function_apply


def apply_plan(x, fuser_and_plan, *tensors):
    """:func:`plan_entry`'s call, with ``x`` and the extra inputs (after the
    parameters) unwrapped when they are tensors of a finished functorch transform,
    as ``Function.apply`` does (the parameters are the ops' own). Under a
    transform, ``Function.apply`` itself, which says why it refuses."""
    if "apply" in _OWN_ATTRIBUTES or _functorch_active():
        return _FuserFunction.apply(x, fuser_and_plan, *tensors)
    n = len(fuser_and_plan[0]._flat_params)
    if len(tensors) > n:
        try:
            tensors = tensors[:n] + tuple(map(_unwrap_if_dead, tensors[n:]))
        except TypeError:  # an extra input that is not a tensor: torch's own entry, which passes it on
            return _FuserFunction.apply(x, fuser_and_plan, *tensors)
    return _function_apply(_unwrap_if_dead(x), fuser_and_plan, *tensors)


def _grad_flags(fuser: OperationFuser, needs: tuple) -> tuple:
    """Per op, ``(needs_input_grad, param_needs_grad)`` of its context for a backward
    whose autograd flags are ``needs``: an op needs its input's gradient when
    anything before it (the input, a parameter, an extra input) needs one.
    Remembered per ``needs`` (a few distinct values per fuser)."""
    flags = fuser._grad_flag_memo.get(needs)
    if flags is None:
        out, upstream = [], needs[0]
        for p_slice, e_slice, _ in fuser._grad_slices:
            p_need = needs[p_slice]
            out.append((upstream, p_need))
            upstream = upstream or any(p_need) or any(needs[e_slice])
        if len(fuser._grad_flag_memo) >= _MAX_SHAPES:
            fuser._grad_flag_memo.clear()
        flags = fuser._grad_flag_memo[needs] = tuple(out)
    return flags


def _input_as_extra(fuser: OperationFuser, x: torch.Tensor, extra_inputs) -> "tuple[int, int] | None":
    """``(op, slot)`` of the one extra input that is ``x`` itself (a residual,
    ``seq(x, x)``) when the first op can add its gradient into its own input
    gradient: a plain residual fuser whose first op ``adds_input_grad``
    (``fuser._residual_slots``) and an fp32 ``x`` (the sum then rounds once, as
    autograd's own addition of the two would). Else None, and autograd adds the
    two gradients."""
    slots = fuser._residual_slots
    if not slots or x.dtype is not torch.float32:
        return None
    found = None
    for slot, t in zip(slots, extra_inputs):
        if t is x:
            if found is not None:
                return None  # two uses: autograd adds them in its own order
            found = slot
    return found if found is not None and found[0] > 0 else None


def run_backward(fuser: OperationFuser, plan: FusionPlan, ctxs: list, needs: tuple, x_dtype: torch.dtype, dy,
                 grad_extra_outputs, input_as_extra: "tuple[int, int] | None" = None) -> tuple:
    """The plan's backward steps from ``dy``: ``(dx, None, *parameter gradients,
    *extra-input gradients)`` aligned with ``needs``, the needs-input-grad flags of
    ``(x, fuser and plan, *parameters, *extra inputs)``. ``input_as_extra``: the
    (op, slot) of an extra input that is x itself (:func:`_input_as_extra`); its
    gradient is added into dx by the first op's backward, and none is returned for it.
    The backward of an evaluation plan records no more than its forward did
    (:func:`_unrecorded`)."""
    if not plan.training and not _EVALUATING[0]:  # a backward in evaluation mode (saliency, input attacks)
        if not _EVAL_BACKWARD_WARNED and not plan.stateless and any(needs[2:2 + len(fuser._flat_params)]):
            _warn_eval_backward()
        return _unrecorded(run_backward, fuser, plan, ctxs, needs, x_dtype, dy, grad_extra_outputs, input_as_extra)
    needs = tuple(needs)
    for ctx, (need_input, p_need) in zip(ctxs, _grad_flags(fuser, needs)):
        ctx.needs_input_grad = need_input
        ctx.param_needs_grad = p_need
    branches, routes = fuser._branches, fuser.routes
    if routes is None:
        d_extra_out = _split(grad_extra_outputs, fuser._n_extra_out) if fuser._has_extra_outputs else None
    else:
        d_extra_out = routes.place_output_grads(fuser._n_extra_out, grad_extra_outputs)
        channel_grads: dict = {}  # writer's (op, slot) -> the sum of its readers' gradients so far
    d_extra_in: list[list] | None = [[None] * n for n in fuser._n_extra_in] if branches else None
    pgrads: list = [None] * len(fuser._flat_params)
    slices = fuser._grad_slices
    dx = dy
    for executor, lo, hi, no_extras, basic in plan.backward_steps or _backward_steps(plan):
        if routes is not None and channel_grads:  # a writer's step: its readers' backward steps ran before
            _take_channel_grads(range(lo, hi), channel_grads, d_extra_out)
        step_d_extra = no_extras if d_extra_out is None else d_extra_out[lo:hi]
        if basic and lo == 0 and input_as_extra is not None and needs[0] \
                and d_extra_in[input_as_extra[0]][input_as_extra[1]] is not None:
            i, k = input_as_extra
            dx, g = executor.op_backward_adding(ctxs[0], dx, d_extra_in[i][k])
            d_extra_in[i][k] = None  # in dx now
            step_pgrads, step_dextra = (g,), ([],)
        elif basic:
            dx, g, d = executor.op_backward(ctxs[lo], dx, step_d_extra[0])
            step_pgrads, step_dextra = (g,), (d,)
        else:
            dx, step_pgrads, step_dextra = executor.fuser_backward(ctxs[lo:hi], dx, step_d_extra)
        for i, g, d in zip(range(lo, hi), step_pgrads, step_dextra):
            if g:
                p_slice, _, first = slices[i]
                for j, (need, grad) in enumerate(zip(needs[p_slice], g), first):
                    pgrads[j] = grad if need else None
            if d:
                d_extra_in[i] = list(d)
                if routes is not None:
                    for k, w, o in routes.reads[i]:  # a reader's gradient goes to the channel's writer
                        g = d_extra_in[i][k]
                        if g is not None:
                            prev = channel_grads.get((w, o))
                            channel_grads[(w, o)] = g if prev is None else prev + g
        if not ctxs[lo].needs_input_grad:  # nothing before this step needs a gradient: the earlier steps are idle
            break
    if dx is not None and needs[0]:
        if dx.dtype is not x_dtype:
            dx = dx.to(x_dtype)
    else:
        dx = None
    if not branches:
        return (dx, None, *pgrads)
    if routes is not None:
        return (dx, None, *pgrads, *[d_extra_in[i][k] for i, k in routes.public_inputs])
    return (dx, None, *pgrads, *[g for gs in d_extra_in for g in gs])


def _take_channel_grads(idx, channel_grads: dict, d_extra_out: list) -> None:
    """Before the backward step over ops ``idx``: each channel written there takes its
    readers' summed gradient, added to the caller's gradient of it if also returned."""
    for i in idx:
        for o, cur in enumerate(d_extra_out[i]):
            g = channel_grads.pop((i, o), None)
            if g is not None:
                d_extra_out[i][o] = g if cur is None else cur + g
