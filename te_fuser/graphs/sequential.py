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
CUDA graphs and replays them, so a step costs two graph launches.

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
- Replays read the parameters in place, so optimizer steps are seen. The eager
  model casts its weights in every forward, and reuses a cast only inside
  ``te.reuse_quantized_weights()`` while nothing changed (see
  ``ops/weight_cache.py``); the graphs do the same with two pairs: one that casts
  the weights, and one that reads the FP8 weights of the previous forward,
  replayed only where the eager model would reuse them (inside that scope, no
  optimizer step and no weight write since).

Numerics are those of the eager model, step for step. Delayed scaling keeps its
amax history and scales in tensors that the graphs update in place (eager steps
rebind them; the next replay adopts whatever the quantizers hold), so eager and
replayed steps can alternate.

A replayed step keeps its activations in the graphs' memory: run the backward
of one forward before the next forward (a second forward while the first one's
backward is still pending raises). A forward whose output is dropped without a
backward commits its scaling-state updates when its autograd graph is freed, as
an eager forward would have at once. The returned output and the gradients handed
to autograd are fresh tensors (the gradients: views of one buffer per dtype).
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch import nn

from .. import backend
from ..autocast import current_state
from ..epoch import APPLIED as _APPLIED
from ..epoch import CHANGES as _EPOCH
from ..kernels.operand import ScaledOperand
from ..ops.fuser import compute_dtype
from ..ops.sequential import Sequential
from ..ops.weight_cache import optimizer_steps, reuse_quantized_weights, scope_token
from ..quantization.amax_reduction import discard_pending, flush_amax_reductions
from ..quantization.tensor import QuantizedTensor
from .core import (CaptureGuard, GraphStats, StateSlot, drop_weight_caches, quantizers_seeded, reduces_amax,
                   state_slots, weight_casting_ops)

__all__ = ["make_graphed", "GraphedSequential"]


def make_graphed(model: Sequential, *, warmup_steps: int = 2) -> "GraphedSequential":
    """Wrap ``model`` so its CUDA training steps replay from CUDA graphs (see the module doc)."""
    return GraphedSequential(model, warmup_steps=warmup_steps)


class _Pair:
    """One captured forward graph and its backward graph, with their outputs."""

    def __init__(self) -> None:
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd = torch.cuda.CUDAGraph()
        self.static_y: torch.Tensor | None = None
        self.static_dy: torch.Tensor | None = None
        # the gradients packed by dtype into flat buffers the backward graph fills:
        # (flat, sizes, ((input index, shape), ...)); each replay hands autograd views
        # of one fresh copy per buffer, never the graph's own memory
        self.grad_packs: list[tuple[torch.Tensor, list[int], tuple]] = []
        self.forward_updates: list[tuple[torch.Tensor, torch.Tensor]] = []  # (home, forward's new value)


class _Graphs(CaptureGuard):
    """The graphs of one key: a pair that casts the weights, one that reuses the
    FP8 weights of the previous forward, and what they share."""

    def __init__(self, key, all_params: tuple[torch.Tensor, ...], slots: list[StateSlot], quantizers) -> None:
        super().__init__(key, all_params, slots, quantizers)
        self.static_x: torch.Tensor | None = None
        self.cast = _Pair()
        self.cached = _Pair()
        self.cast_weights: list[tuple] = []  # (op, dtype, columnwise, FP8 weight the cast pair writes)
        self.pending = None  # weakref to the autograd node of a replayed forward awaiting its backward
        self.pending_pair: _Pair | None = None
        self.commit_due: _Pair | None = None  # a forward to commit at the next replay (node freed while capturing)

    def node_freed(self, ref) -> None:
        """A replayed forward's autograd node died without its backward: commit the
        forward's own state updates now, as the eager forward would have done."""
        if self.pending is not ref:
            return
        pair, self.pending, self.pending_pair = self.pending_pair, None, None
        if torch.cuda.is_current_stream_capturing():
            self.commit_due = pair  # not inside someone's capture: at the next replay
        else:
            _commit_forward(pair)

    def load_eager_weights(self) -> bool:
        """Copy each op's eager FP8 weight cache into the tensors the cached pair reads;
        False when a cache does not hold the current weight."""
        sources = []
        for op, dtype, columnwise, _ in self.cast_weights:
            cached = op.cached_weight(dtype)
            if cached is None or (columnwise and not cached[0]):
                return False
            sources.append(cached[1])
        for (_, _, _, w_q), src in zip(self.cast_weights, sources):
            for dst_op, src_op in ((w_q.rowwise, src.rowwise), (w_q.columnwise, src.columnwise)):
                if dst_op is not None:
                    dst_op.data.copy_(src_op.data)
                    dst_op.scale_inv.copy_(src_op.scale_inv)
        return True

    def give_weights_to_eager(self) -> None:
        """Put a copy of the FP8 weights of the last replay into each op's cache, for
        an eager forward under the same weights (the graphs overwrite their own)."""
        for op, dtype, columnwise, w_q in self.cast_weights:
            op.cache_weight(_copy_quantized(w_q), columnwise, dtype)


def _commit_forward(pair: _Pair) -> None:
    for home, updated in pair.forward_updates:
        home.copy_(updated)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: _Graphs, pair: _Pair, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if x.data_ptr() != graphs.static_x.data_ptr():
            graphs.static_x.copy_(x)
        pair.fwd.replay()
        ctx.graphs, ctx.pair = graphs, pair
        graphs.pending, graphs.pending_pair = weakref.ref(ctx, graphs.node_freed), pair
        return pair.static_y.clone()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        graphs, pair = ctx.graphs, ctx.pair
        if graphs.pending is None or graphs.pending() is not ctx:
            raise RuntimeError(
                "make_graphed: this backward belongs to a forward whose activations were overwritten by a "
                "later forward; run each forward's backward before the next forward"
            )
        pair.static_dy.copy_(dy)
        pair.bwd.replay()
        graphs.pending = graphs.pending_pair = None
        # Autograd keeps a returned gradient as ``.grad`` without copying it when no one
        # else holds it: a gradient in the graphs' memory would be overwritten by the
        # next replay (and doubled by accumulation). One copy per dtype, then views.
        grads = [None] * (1 + len(graphs.params))  # the input's, then the trainable parameters'
        for flat, sizes, places in pair.grad_packs:
            for (index, shape), part in zip(places, flat.clone().split(sizes)):
                grads[index] = part.view(shape)
        return (None, None, *grads)


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
        self._casting_ops: list | None = None  # the ops that cast a weight (found once per capture)
        self._last_replayed: _Graphs | None = None  # the graphs of the last forward, if it was replayed
        self._replayed_stamp = None  # the reuse stamp at that replay (see _reuse_stamp)

    # -- the call -------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = self._key(x)
        if self._casting_ops is None:
            self._casting_ops = weight_casting_ops(self.model)
        stamp = self._reuse_stamp()
        since_replay = self._last_replayed is not None and stamp is not None and stamp == self._replayed_stamp
        if key is None:  # not a capturable CUDA training step
            return self._eager(x, None, since_replay)
        graphs = self._graphs
        if graphs is None or graphs.key != key or not graphs.still_valid():
            if self._eager_key != key or not quantizers_seeded(self.model):
                return self._eager(x, key, since_replay)
            self._graphs = None  # free the previous key's graphs before capturing new ones
            graphs = self._graphs = self._capture(x, key)
        # The eager model would reuse its FP8 weights where they hold the current
        # weights inside te.reuse_quantized_weights(): after our own replay with
        # nothing changed since, or after an eager forward that cast and kept them.
        if (since_replay and self._last_replayed is graphs) or graphs.load_eager_weights():
            return self._replay(graphs, graphs.cached, x, stamp)
        return self._replay(graphs, graphs.cast, x, stamp)

    def _reuse_stamp(self):
        """What must not change between two forwards for the second to reuse the
        first one's FP8 weights (None outside ``te.reuse_quantized_weights()``)."""
        token = scope_token()
        if token == 0:
            return None
        return (token, optimizer_steps(), tuple(op.weight._version for op in self._casting_ops))

    def _key(self, x: torch.Tensor):
        state = current_state()
        if not (x.is_cuda and torch.is_grad_enabled() and self.model.training):
            return None
        if state.calibrating or reduces_amax(state):
            return None
        recipe = state.active_recipe  # with the model's own recipes (te.apply_recipe), which resolve from it
        return (None if recipe is None else str(recipe), state.named, state.override_pinned, _APPLIED[0], x.shape,
                x.dtype, x.device, x.requires_grad, backend.get_backend())

    def _eager(self, x: torch.Tensor, key, since_replay: bool) -> torch.Tensor:
        if since_replay:  # the weights are those of the last replay: so are their FP8 copies
            self._last_replayed.give_weights_to_eager()
        self._eager_key = key
        self._last_replayed = None
        self.stats.eager_steps += 1
        return self.model(x)

    def _replay(self, graphs: _Graphs, pair: _Pair, x: torch.Tensor, stamp) -> torch.Tensor:
        if graphs.pending is not None and graphs.pending() is not None:
            raise RuntimeError(
                "make_graphed: forward called again before the previous forward's backward; a replayed step "
                "keeps its activations in the graphs' memory, so run the backward of each forward first"
            )
        if graphs.commit_due is not None:
            _commit_forward(graphs.commit_due)
            graphs.commit_due = None
        graphs.adopt_rebound()  # an eager step ran in between: adopt its state
        self.stats.replays += 1
        self._last_replayed, self._replayed_stamp = graphs, stamp
        return _Replay.apply(graphs, pair, x, *graphs.params)

    # -- capture ----------------------------------------------------------------------
    def _capture(self, x: torch.Tensor, key) -> _Graphs:
        start = time.perf_counter()
        model = self.model
        # From here on the pending list holds only this capture's amaxes: a capture's own
        # flush must not take another model's updates into its graph.
        flush_amax_reductions()
        quantizers, slots = state_slots(model)
        graphs = _Graphs(key, tuple(model.parameters()), slots, quantizers)
        graphs.static_x = x.detach().clone().requires_grad_(x.requires_grad)
        self._casting_ops = linears = weight_casting_ops(model)
        dtype = compute_dtype(x)
        eager_casts = [(op, op.cached_weight(dtype)) for op in linears]  # kept by an eager forward: put back after
        # Captured inside a reuse scope: the cast pair's forward keeps the FP8 weights
        # it writes, which the cached pair then reads in place.
        with reuse_quantized_weights():
            try:
                self._warm_up(graphs, linears)
                drop_weight_caches(linears)  # the cast pair casts the weights itself
                pool = torch.cuda.graph_pool_handle()
                self._capture_pair(graphs, graphs.cast, pool,
                                   after_forward=lambda: _keep_weights(graphs, linears, dtype))
                self._capture_pair(graphs, graphs.cached, pool, before_forward=lambda: [
                    op.cache_weight(w_q, columnwise, w_dtype) for op, w_dtype, columnwise, w_q in graphs.cast_weights])
            except BaseException:
                discard_pending()  # amaxes of a capture that failed were never computed
                for slot in slots:
                    slot.rebind()
                raise
            finally:
                drop_weight_caches(linears)  # the graphs' memory is rewritten by every replay: eager must not read it
        for op, kept in eager_casts:  # (kept only inside the caller's own reuse scope)
            if kept is not None:
                op.cache_weight(kept[1], kept[0], dtype)

        self.stats.captures += 1
        self.stats.capture_seconds = time.perf_counter() - start
        return graphs

    def _warm_up(self, graphs: _Graphs, linears: list) -> None:
        """Run the step a few times on a side stream, outside any capture, so every
        kernel is compiled and tuned; the scaling state is put back afterwards."""
        model, x = self.model, graphs.static_x
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side), _parameter_aliases(model) as aliases:
            warm_x = x.detach().clone().requires_grad_(x.requires_grad)
            inputs = ((warm_x,) if x.requires_grad else ()) + tuple(map(aliases, graphs.params))
            for _ in range(self.warmup_steps):
                drop_weight_caches(linears)
                y = model(warm_x)
                if not isinstance(y, torch.Tensor):
                    raise TypeError("make_graphed: the model must return one tensor")
                torch.autograd.grad(y, inputs, grad_outputs=torch.ones_like(y), allow_unused=True)
                del y
            flush_amax_reductions()  # the warm-up's own updates, on its stream
        torch.cuda.current_stream(x.device).wait_stream(side)
        for slot in graphs.slots:  # the warm-up runs rebound the state; their updates are discarded
            slot.rebind()

    def _capture_pair(self, graphs: _Graphs, pair: _Pair, pool, after_forward=None, before_forward=None) -> None:
        """Capture one forward and its backward; the backward graph also copies every
        scaling-state update of the step into the tensors the next replay reads.
        ``before_forward`` runs with the parameter aliases in place (a kept cast
        belongs to the Parameter object that the capture reads)."""
        model, static_x, slots = self.model, graphs.static_x, graphs.slots
        with _parameter_aliases(model) as aliases:
            if before_forward is not None:
                before_forward()
            inputs = ((static_x,) if static_x.requires_grad else ()) + tuple(map(aliases, graphs.params))
            with torch.cuda.graph(pair.fwd, pool=pool):
                static_y = model(static_x)
                if after_forward is not None:
                    after_forward()
                flush_amax_reductions()  # the forward's state updates, inside its graph
            if not isinstance(static_y, torch.Tensor):
                raise TypeError("make_graphed: the model must return one tensor")
            pair.forward_updates = [(s.home, s.live()) for s in slots if not s.bound()]
            static_dy = torch.empty_like(static_y)
            with torch.cuda.graph(pair.bwd, pool=pool):
                static_grads = torch.autograd.grad(static_y, inputs, grad_outputs=static_dy, allow_unused=True)
                packs = self._pack_grads(static_grads, static_x.requires_grad)
                for slot in slots:  # commit this step's state updates, forward and backward, in place
                    if not slot.bound():
                        slot.home.copy_(slot.live())
        for slot in slots:
            slot.rebind()
        pair.static_y, pair.static_dy = static_y.detach(), static_dy
        pair.grad_packs = packs

    @staticmethod
    def _pack_grads(static_grads, x_requires_grad: bool) -> list:
        """Inside the backward capture: the gradients copied into one flat buffer per dtype."""
        ordered = list(static_grads) if x_requires_grad else [None, *static_grads]  # input first, then parameters
        by_dtype: dict[torch.dtype, list] = {}
        for index, g in enumerate(ordered):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append((index, g))
        packs = []
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for _, g in group])
            packs.append((flat, [g.numel() for _, g in group], tuple((i, g.shape) for i, g in group)))
        return packs


def _keep_weights(graphs: _Graphs, linears: list, dtype: torch.dtype) -> None:
    """Inside the cast pair's forward capture: keep each FP8 weight it wrote, for the
    cached pair, with its scales copied at this point. A delayed-scaling weight's
    FP8 copy shares the quantizer's ``scale_inv`` tensor, which the backward graph
    overwrites with the next scale; the eager cache keeps the old tensor instead."""

    def frozen(o: ScaledOperand | None) -> ScaledOperand | None:
        return None if o is None else ScaledOperand(o.data, o.scale_inv.clone(), o.scaling)

    kept = []
    for op in linears:
        cached = op.cached_weight(dtype)
        if cached is not None:
            columnwise, w_q = cached
            kept.append((op, dtype, columnwise,
                         QuantizedTensor(frozen(w_q.rowwise), frozen(w_q.columnwise), w_q.shape, w_q.dtype)))
    graphs.cast_weights = kept


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
    _EPOCH[0] += 1  # written into the dicts directly: the fusers' guards must look again
    try:
        yield lambda p: by_id[id(p)]  # the fusers read the parameters live: they run with the aliases
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
        _EPOCH[0] += 1


def _copy_quantized(q: QuantizedTensor) -> QuantizedTensor:
    def copy(op: ScaledOperand | None) -> ScaledOperand | None:
        return None if op is None else ScaledOperand(op.data.clone(), op.scale_inv.clone(), op.scaling)

    return QuantizedTensor(copy(q.rowwise), copy(q.columnwise), q.shape, q.dtype)
