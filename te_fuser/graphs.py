"""``te.make_graphed``: replay a Sequential's training step from CUDA graphs.

    model = te.make_graphed(te.ops.Sequential(te.ops.Linear(1024, 1024)))
    for x in batches:
        with te.autocast(recipe=recipe):
            y = model(x)
        loss_fn(y).backward()
        opt.step()

A small model's FP8 step is bound by the host: every op pays Python, quantizer
bookkeeping and several kernel launches, while the GPU work takes microseconds.
``make_graphed`` captures the forward and the backward of the whole model into
two CUDA graphs and replays them, so a step costs two graph launches.

When it captures, and when it runs the model as it is:

- The graphs belong to one *key*: the recipe's string, the input's shape, dtype,
  device and ``requires_grad``, the training flag and the kernel backend. The
  first training call under a new key runs the model eagerly (so the fuser
  builds the plan and delayed scaling seeds its scales, exactly as without
  graphs); the second one captures and replays; later ones replay. A recipe
  change therefore costs one eager step plus one capture, and the graphs of the
  previous key are freed.
- Calls that are not CUDA training steps (CPU tensors, ``torch.no_grad()``,
  ``te.autocast(calibrating=True)``, an amax reduction group) run eagerly.
- Replays read the parameters in place, so optimizer steps are seen; the weight
  is re-quantized inside the graph every step (no cached FP8 weight).

Numerics are those of the eager model, step for step. Delayed scaling keeps its
amax history and scales in tensors that the graphs update in place (eager steps
rebind them; the next replay adopts whatever the quantizers hold), so eager and
replayed steps can alternate.

A replayed step keeps its activations in the graphs' memory: run the backward
of one forward before the next forward (a second forward while the first one's
backward is still pending raises). A forward whose output is dropped without a
backward commits its scaling-state updates when its autograd graph is freed, as
an eager forward would have at once. The returned output is a fresh tensor.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import backend
from .autocast import current_state
from .ops.fuser import _EPOCH
from .ops.op import BasicOperation
from .ops.sequential import Sequential
from .warmup import _fusers_of

__all__ = ["make_graphed", "GraphedSequential", "GraphStats"]


@dataclass
class GraphStats:
    """What a :class:`GraphedSequential` has done: captures, replays and eager steps."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    capture_seconds: float = 0.0  # wall time of the last capture (warm-up runs included)


def make_graphed(model: Sequential, *, warmup_steps: int = 2) -> "GraphedSequential":
    """Wrap ``model`` so its CUDA training steps replay from CUDA graphs (see the module doc)."""
    return GraphedSequential(model, warmup_steps=warmup_steps)


class _StateSlot:
    """One tensor of a quantizer's scaling state, kept at a fixed address for the graphs.

    ``home`` is the tensor the graphs read; the quantizer rebinds its attribute
    whenever it updates (it never writes in place), and the captured graphs copy
    the rebound tensor back into ``home``."""

    __slots__ = ("quantizer", "name", "home", "updated")

    def __init__(self, quantizer, name: str) -> None:
        self.quantizer, self.name = quantizer, name
        self.home: torch.Tensor = getattr(quantizer, name)
        self.updated: torch.Tensor | None = None  # the tensor the forward graph writes, if any

    def adopt(self) -> None:
        """Make ``home`` hold the quantizer's current value and bind the quantizer to it."""
        live = getattr(self.quantizer, self.name)
        if live is not self.home:
            self.home.copy_(live)
            setattr(self.quantizer, self.name, self.home)

    def bound(self) -> bool:
        return getattr(self.quantizer, self.name) is self.home


class _Graphs:
    """The forward and backward graphs of one key, with their static tensors."""

    def __init__(self, key, params: tuple[torch.Tensor, ...], slots: list[_StateSlot], quantizers) -> None:
        self.key = key
        self.params = params
        self.param_ptrs = tuple(p.data_ptr() for p in params)
        self.slots = slots
        self.quantizers = quantizers  # (op, its quantizer dict) at capture time
        self.epoch = _EPOCH[0]
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd = torch.cuda.CUDAGraph()
        self.static_x: torch.Tensor | None = None
        self.static_y: torch.Tensor | None = None
        self.static_dy: torch.Tensor | None = None
        self.static_grads: tuple = ()
        self.pending = None  # weakref to the autograd node of a replayed forward awaiting its backward
        self.commit_due = False  # a replayed forward's node died without its backward while capturing
        self.forward_updates: list[tuple[torch.Tensor, torch.Tensor]] = []  # (home, forward's new value)

    def node_freed(self, ref) -> None:
        """A replayed forward's autograd node died without its backward: commit the
        forward's own state updates now, as the eager forward would have done."""
        if self.pending is not ref:
            return
        self.pending = None
        if torch.cuda.is_current_stream_capturing():
            self.commit_due = True  # not inside someone's capture: at the next replay
        else:
            self.commit_forward()

    def commit_forward(self) -> None:
        for home, updated in self.forward_updates:
            home.copy_(updated)
        self.commit_due = False

    def still_valid(self, model: Sequential) -> bool:
        if self.epoch != _EPOCH[0]:
            for op, qs in self.quantizers:
                if op._quantizers is not qs:
                    return False
            self.epoch = _EPOCH[0]
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.param_ptrs))


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: _Graphs, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if x.data_ptr() != graphs.static_x.data_ptr():
            graphs.static_x.copy_(x)
        graphs.fwd.replay()
        ctx.graphs = graphs
        graphs.pending = weakref.ref(ctx, graphs.node_freed)
        return graphs.static_y.clone()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        graphs: _Graphs = ctx.graphs
        if graphs.pending is None or graphs.pending() is not ctx:
            raise RuntimeError(
                "make_graphed: this backward belongs to a forward whose activations were overwritten by a "
                "later forward; run each forward's backward before the next forward"
            )
        graphs.static_dy.copy_(dy)
        graphs.bwd.replay()
        graphs.pending = None
        return (None, *(g.detach() if g is not None else None for g in graphs.static_grads))


class GraphedSequential(nn.Module):
    """A :class:`~te_fuser.ops.Sequential` whose CUDA training steps replay from graphs."""

    def __init__(self, model: Sequential, *, warmup_steps: int = 2) -> None:
        super().__init__()
        if not isinstance(model, Sequential):
            raise TypeError(f"make_graphed(model): must be a te_fuser.ops.Sequential, got {type(model).__name__}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"make_graphed(warmup_steps=...): must be an integer >= 1, got {warmup_steps!r}")
        self.model = model
        self.warmup_steps = warmup_steps
        self.stats = GraphStats()
        self._graphs: _Graphs | None = None
        self._eager_key = None  # the key of the last eager training step (captured on its next call)

    # -- the call -------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = self._key(x)
        graphs = self._graphs
        if key is None:  # not a capturable CUDA training step
            return self._eager(x, None)
        if graphs is not None and graphs.key == key and graphs.still_valid(self.model):
            return self._replay(graphs, x)
        if self._eager_key != key or not self._ready_to_capture():
            return self._eager(x, key)
        self._graphs = None  # free the previous key's graphs before capturing new ones
        self._graphs = self._capture(x, key)
        return self._replay(self._graphs, x)

    def _ready_to_capture(self) -> bool:
        """Every quantizer has seeded its state (a first step under a recipe seeds
        delayed scaling from the tensor itself; that step must not be replayed)."""
        for op in self.model.modules():
            if isinstance(op, BasicOperation):
                for q in op._quantizers.values():
                    if getattr(q, "seeded", True) is False:
                        return False
        return True

    def _key(self, x: torch.Tensor):
        state = current_state()
        if not (x.is_cuda and torch.is_grad_enabled() and self.model.training):
            return None
        if state.calibrating or state.amax_reduction_group is not None:
            return None
        recipe = state.active_recipe
        return (None if recipe is None else str(recipe), x.shape, x.dtype, x.device, x.requires_grad,
                backend.get_backend())

    def _eager(self, x: torch.Tensor, key) -> torch.Tensor:
        self._eager_key = key
        self.stats.eager_steps += 1
        return self.model(x)

    def _replay(self, graphs: _Graphs, x: torch.Tensor) -> torch.Tensor:
        if graphs.pending is not None and graphs.pending() is not None:
            raise RuntimeError(
                "make_graphed: forward called again before the previous forward's backward; a replayed step "
                "keeps its activations in the graphs' memory, so run the backward of each forward first"
            )
        if graphs.commit_due:
            graphs.commit_forward()
        for slot in graphs.slots:
            if not slot.bound():  # an eager step ran in between: adopt its state
                slot.adopt()
        self.stats.replays += 1
        return _Replay.apply(graphs, x, *graphs.params)

    # -- capture ----------------------------------------------------------------------
    def _capture(self, x: torch.Tensor, key) -> _Graphs:
        start = time.perf_counter()
        model = self.model
        ops = [m for m in model.modules() if isinstance(m, BasicOperation)]
        quantizers = [(op, op._quantizers) for op in ops]
        slots = [_StateSlot(q, name) for _, qs in quantizers for q in qs.values()
                 for name, value in vars(q).items() if isinstance(value, torch.Tensor)]
        for slot in slots:
            slot.adopt()
        params = tuple(p for p in model.parameters() if p.requires_grad)
        graphs = _Graphs(key, params, slots, quantizers)
        static_x = x.detach().clone().requires_grad_(x.requires_grad)

        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side), _parameter_aliases(model) as aliases:  # compile and tune every kernel
            warm_x = static_x.detach().clone().requires_grad_(x.requires_grad)
            warm_inputs = ((warm_x,) if x.requires_grad else ()) + tuple(map(aliases, params))
            for _ in range(self.warmup_steps):
                _drop_weight_caches(ops)
                y = model(warm_x)
                if not isinstance(y, torch.Tensor):
                    raise TypeError("make_graphed: the model must return one tensor")
                torch.autograd.grad(y, warm_inputs, grad_outputs=torch.ones_like(y), allow_unused=True)
                del y
        torch.cuda.current_stream(x.device).wait_stream(side)
        for slot in slots:  # the warm-up runs rebound the state; their updates are discarded
            setattr(slot.quantizer, slot.name, slot.home)

        _drop_weight_caches(ops)  # the captured forward must quantize the weight itself
        pool = torch.cuda.graph_pool_handle()
        with _parameter_aliases(model) as aliases:
            inputs = ((static_x,) if x.requires_grad else ()) + tuple(map(aliases, params))
            with torch.cuda.graph(graphs.fwd, pool=pool):
                static_y = model(static_x)
            for slot in slots:
                live = getattr(slot.quantizer, slot.name)
                slot.updated = None if live is slot.home else live
            graphs.forward_updates = [(s.home, s.updated) for s in slots if s.updated is not None]
            static_dy = torch.empty_like(static_y)
            with torch.cuda.graph(graphs.bwd, pool=pool):
                static_grads = torch.autograd.grad(static_y, inputs, grad_outputs=static_dy, allow_unused=True)
                for slot in slots:  # commit this step's state updates, forward and backward, in place
                    live = getattr(slot.quantizer, slot.name)
                    if live is not slot.home:
                        slot.home.copy_(live)
        for slot in slots:
            setattr(slot.quantizer, slot.name, slot.home)
        _drop_weight_caches(ops)

        grads = list(static_grads)
        graphs.static_x, graphs.static_y, graphs.static_dy = static_x, static_y.detach(), static_dy
        graphs.static_grads = (grads.pop(0) if x.requires_grad else None, *grads)
        self.stats.captures += 1
        self.stats.capture_seconds = time.perf_counter() - start
        return graphs


@contextlib.contextmanager
def _parameter_aliases(model: Sequential):
    """Replace every parameter of ``model`` by a fresh leaf sharing its storage.

    Autograd accumulates a leaf's gradient through a node that remembers the
    stream it was created on; a node created by an earlier eager step and still
    held by its graph (a live ``loss``) would make the captured backward wait on
    the default stream, which invalidates the capture. Fresh leaves get fresh
    nodes on the capture stream; reading the same storage, the graphs see every
    in-place optimizer update of the real parameters. Yields ``alias(parameter)``.
    """
    by_id: dict[int, nn.Parameter] = {}
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in by_id:
                by_id[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            module._parameters[name] = by_id[id(p)]
            swapped.append((module, name, p))
    fusers = _fusers_of(model)
    saved = [(f, f._params, f._flat_params) for f in fusers]
    for f in fusers:
        f._params = [[by_id[id(p)] for p in ps] for ps in f._params]
        f._flat_params = [by_id[id(p)] for p in f._flat_params]
    try:
        yield lambda p: by_id[id(p)]
    finally:
        for f, params, flat in saved:
            f._params, f._flat_params = params, flat
        for module, name, p in swapped:
            module._parameters[name] = p


def _drop_weight_caches(ops) -> None:
    for op in ops:
        op.drop_caches()
