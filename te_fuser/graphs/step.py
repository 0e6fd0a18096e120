"""``te.make_graphed_step``: replay a whole training step from one CUDA graph.

    def train_step(x, target):
        loss = loss_fn(model(x), target)
        loss.backward()
        opt.step()                       # torch.optim.SGD, or Adam/AdamW(capturable=True)
        return loss

    step = te.make_graphed_step(train_step, model)
    for x, target in batches:
        with te.autocast(recipe=recipe):  # the recipe is read here, around the call
            loss = step(x, target)

``te.make_graphed`` replays a model's forward and backward but leaves the step's
glue to eager PyTorch: autograd's engine, the loss, the optimizer, a copy of every
tensor that crosses the graph boundary. For a small model that glue is the step.
``make_graphed_step`` captures everything the step function launches (forward,
loss, backward, optimizer) into one graph, so a replayed step costs a copy of
each tensor argument, one graph launch and a copy of each returned tensor.

The contract, which is stricter than an eager step's:

- **Each call is one whole step, and it starts with no gradients.** Before every
  call the model's parameters get ``.grad = None``, as ``optimizer.zero_grad()``
  leaves them; a replay writes fresh gradients into the graph's memory and binds
  them as ``.grad`` again. Gradient accumulation over micro-batches belongs inside
  the step function.
- **The step must be capturable**: CUDA tensors only, no host synchronisation
  (``.item()``, printing a tensor, data-dependent Python branches), optimizers
  that keep their state on the GPU (``capturable=True`` for Adam and AdamW; SGD
  needs nothing). Python in the step runs at eager steps and at the capture, not
  at replays: a learning rate given as a Python float is frozen into the graph.
- **``model`` holds every te_fuser op the step runs**: the graph carries their
  scaling state from replay to replay; a capture that ran other ops is refused.
- **The recipe comes from the ``te.autocast`` around the call.** A ``te.autocast``
  inside the step must not change its recipe between calls: replays do not run
  Python, so they would not see it.
- Tensor arguments are copied into the graph's inputs (skipped when the caller
  passes the graph's own); other arguments must be hashable and are part of the
  key. Tensors in the result (a tensor, or tuples, lists and dicts of them) are
  returned as fresh copies without autograd history.

When it captures: the *key* is the recipe's string, the kernel backend, the
arguments (shape, dtype, device and ``requires_grad`` of the tensors, the values
of the others), every module's training flag, the grad mode and ``torch.autocast``'s
CUDA state. The first ``warmup_steps`` calls
under a new key run eagerly (the fuser builds its plan, delayed scaling seeds its
state, kernels compile, the optimizer creates its state); the next call captures
and replays, and later ones replay. The previous key's graph is freed. A change
that the graph would read stale (a parameter's storage or ``requires_grad``, the
installed quantizers, a frozen weight written in place) starts the key afresh.
Calls with CPU tensors, ``te.autocast(calibrating=True)`` or an amax reduction
group always run eagerly.

Numerics are those of the eager step, step for step: the graph runs the same
kernels on the same addresses. The graph casts every weight on every call, as
eager steps do outside ``te.reuse_quantized_weights()`` (a step inside that scope
runs its micro-batches' reuse within the graph). A replay bumps the trainable
parameters' version counters (its optimizer writes them where autograd cannot
see), so a cast kept by the model called directly is not reused after it. Delayed scaling's state is captured reading fixed
tensors and ends by copying the step's updates into them, so eager calls (after
a key change, or interleaved by the caller) and replays can alternate.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version

from .. import backend
from ..autocast import current_state
from ..epoch import APPLIED as _APPLIED
from ..ops.fuser import RUN_WATCH
from ..quantization.amax_reduction import discard_pending, flush_amax_reductions
from .core import (CaptureGuard, GraphStats, drop_weight_caches, quantizers_seeded, reduces_amax, state_slots,
                   weight_casting_ops)

__all__ = ["make_graphed_step", "GraphedStep"]


def make_graphed_step(step: Callable, model: nn.Module, *, warmup_steps: int = 2) -> "GraphedStep":
    """Wrap a training-step function so its CUDA steps replay from one graph (see the module doc).

    ``model`` is the module (or a module holding every module) whose parameters
    the step trains: its parameters' gradients, its ops' quantizers and its
    cached FP8 weights are what the graph reads and writes."""
    return GraphedStep(step, model, warmup_steps=warmup_steps)


class _StepGraph(CaptureGuard):
    """The graph of one key, its static inputs and outputs, and what it read."""

    def __init__(self, key, all_params, slots, quantizers) -> None:
        super().__init__(key, all_params, slots, quantizers)
        self.graph = torch.cuda.CUDAGraph()
        self.static_args: list[torch.Tensor] = []  # the tensor arguments, in order
        self.inputs: list[torch.Tensor] = []  # the same storage without autograd, for the copies in
        self.static_out: Any = None
        self.grads: tuple = ()  # each parameter's ``.grad`` as the captured step left it


class GraphedStep:
    """A training-step function whose CUDA calls replay from a CUDA graph."""

    def __init__(self, step: Callable, model: nn.Module, *, warmup_steps: int = 2) -> None:
        if not callable(step):
            raise TypeError(f"make_graphed_step(step): must be callable, got {type(step).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"make_graphed_step(model): must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"make_graphed_step(warmup_steps=...): must be an integer >= 1, got {warmup_steps!r}")
        self.step = step
        self.model = model
        self.warmup_steps = warmup_steps
        self.stats = GraphStats()
        self._graph: _StepGraph | None = None
        self._modules = tuple(model.modules())
        self._params = tuple(model.parameters())
        self._eager_key = None  # the key of the last eager steps, and how many ran under it
        self._eager_count = 0

    def __call__(self, *args):
        key = self._key(args)
        graph = self._graph
        if key is None or graph is None or graph.key != key or not graph.still_valid():
            if key is None or self._eager_key != key or self._eager_count < self.warmup_steps \
                    or not quantizers_seeded(self.model):
                return self._eager(args, key)
            self._graph = None  # free the previous key's graph before capturing
            graph = self._graph = self._capture(args, key)
        return self._replay(graph, args)

    def _key(self, args: tuple):
        state = current_state()
        if state.calibrating or reduces_amax(state):
            return None
        parts, on_gpu = [], True
        for a in args:
            if isinstance(a, torch.Tensor):
                on_gpu = on_gpu and a.is_cuda
                parts.append((a.shape, a.dtype, a.device, a.requires_grad))
            else:
                try:
                    hash(a)
                except TypeError:
                    raise TypeError(
                        f"make_graphed_step: a non-tensor argument is part of the graph's key and must be hashable, "
                        f"got {type(a).__name__}"
                    ) from None
                parts.append(a)
        if not on_gpu:
            return None
        recipe = state.active_recipe  # with the model's own recipes (te.apply_recipe), which resolve from it
        amp = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        return (None if recipe is None else str(recipe), state.named, state.override_pinned, _APPLIED[0],
                backend.get_backend(), tuple(parts),
                tuple(m.training for m in self._modules), torch.is_grad_enabled(), amp)

    # -- eager steps ----------------------------------------------------------------
    def _eager(self, args: tuple, key):
        """One step as the caller wrote it; before a capture, on a side stream, so the
        lazy set-up of libraries and autograd happens off the stream being captured."""
        if key != self._eager_key:
            self._eager_key, self._eager_count = key, 0
        for p in self._params:
            p.grad = None
        self.stats.eager_steps += 1
        if key is None:
            return _fresh(self.step(*args))
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = _fresh(self.step(*args))
        current.wait_stream(side)
        self._eager_count += 1
        return out

    # -- capture and replay --------------------------------------------------------------
    def _capture(self, args: tuple, key) -> _StepGraph:
        start = time.perf_counter()
        # The graph casts every weight on every replay, as an eager step outside
        # te.reuse_quantized_weights() does: it cannot see whether a weight changed.
        drop_weight_caches(weight_casting_ops(self.model))
        quantizers, slots = state_slots(self.model)
        graph = _StepGraph(key, self._params, slots, quantizers)
        graph.static_args = [a.detach().clone().requires_grad_(a.requires_grad)
                             for a in args if isinstance(a, torch.Tensor)]
        graph.inputs = [t.detach() for t in graph.static_args]
        inputs = iter(graph.static_args)
        call_args = [next(inputs) if isinstance(a, torch.Tensor) else a for a in args]
        saved_grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        ran: set = set()
        RUN_WATCH.append(ran)
        try:
            flush_amax_reductions()  # a capture's flush may hold only what it recorded itself: not another model's
            with torch.cuda.graph(graph.graph):
                out = self.step(*call_args)
                for slot in slots:  # the step's scaling-state updates, into the tensors the next replay reads
                    if not slot.bound():
                        slot.home.copy_(slot.live())
        except Exception as err:
            self._undo_capture(slots, saved_grads)
            raise RuntimeError(
                f"make_graphed_step: the step could not be captured into a CUDA graph ({type(err).__name__}: {err}). "
                "A graphed step must be capturable: CUDA tensors only, no host synchronisation, optimizers with "
                "their state on the GPU (capturable=True for Adam and AdamW); the model is as it was before this call"
            ) from err
        finally:
            RUN_WATCH.pop()
        mine = {id(m) for m in self._modules}
        strangers = [op.describe() for fuser in ran for op in fuser.ops if id(op) not in mine]
        if strangers:  # their scaling state would be read at its capture-time value by every replay
            self._undo_capture(slots, saved_grads)
            raise RuntimeError(
                f"make_graphed_step: the step ran te_fuser ops that are not in its model ({', '.join(strangers[:4])}); "
                "pass make_graphed_step a module that holds every model the step trains"
            )
        for slot in slots:
            slot.rebind()
        graph.static_out = _detached(out)
        graph.grads = tuple(p.grad for p in self._params)
        # FP8 weights kept in the capture live in the graph's memory, which every
        # replay rewrites: an eager step must not find them.
        drop_weight_caches(weight_casting_ops(self.model))
        self.stats.captures += 1
        self.stats.capture_seconds = time.perf_counter() - start
        return graph

    def _undo_capture(self, slots, saved_grads) -> None:
        """A failed capture ran nothing on the GPU: put back what its Python changed."""
        discard_pending()  # the capture's amaxes were never computed
        for slot in slots:
            slot.rebind()
        for p, g in zip(self._params, saved_grads):
            p.grad = g
        drop_weight_caches(weight_casting_ops(self.model))
        self._eager_key, self._eager_count = None, 0

    def _replay(self, graph: _StepGraph, args: tuple):
        graph.adopt_rebound()  # an eager step ran in between: adopt its state
        inputs = iter(graph.inputs)
        for a in args:
            if isinstance(a, torch.Tensor):
                static = next(inputs)
                if a.data_ptr() != static.data_ptr():
                    static.copy_(a)
        graph.graph.replay()
        # The graph writes the weights (the optimizer) behind autograd's back: bump
        # their version counters, so cached FP8 weights and autograd's checks see it.
        increment_version(graph.params)
        for p, g in zip(self._params, graph.grads):
            if p.grad is not g:
                p.grad = g
        self.stats.replays += 1
        return _fresh(graph.static_out)


def _detached(out):
    return _map_tensors(out, lambda t: t.detach())


def _fresh(out):
    return _map_tensors(out, lambda t: t.detach().clone())


def _map_tensors(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    if isinstance(out, dict):
        return {k: _map_tensors(v, fn) for k, v in out.items()}
    return out
