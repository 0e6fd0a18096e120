"""te_fuser under ``torch.compile``: each fused group is one custom op in the graph.

    compiled = torch.compile(model, fullgraph=True)
    with te.autocast(recipe=recipe):        # outside the compiled code
        loss = loss_fn(compiled(x))
    loss.backward()

Dynamo does not trace into a fuser (its plans, quantizers and kernels are Python
state and launchers, not tensor code): a group becomes the custom op
``te_fuser::run_group``, opaque to the graph, whose implementation runs at every
call exactly what the eager fuser runs: it reads te.autocast's state and the
model's own recipe then, picks or builds the plan, updates the scaling state and
launches the same kernels. So a recipe change needs no recompilation, and the
numbers are the eager ones. Its backward is ``te_fuser::run_group_backward``,
which finds the forward's saved state through a ticket (a one-element CPU tensor
the forward returns; the state is released when that tensor is, with or without
a backward). What the graph fixes at trace time, and Dynamo guards on: the
compute dtype (``torch.autocast``), the training flag, whether a backward follows.

``te.autocast`` itself is Python state: enter it around the compiled call, not
inside the compiled function. Module hooks of the ops are traced like any Python.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

__all__ = ["compiled_call"]

_FUSERS: dict[int, "weakref.ref"] = {}  # handle -> the fuser (its handle is a constant in the graph)
_HANDLES = itertools.count(1)
_SAVED: dict[int, tuple] = {}  # ticket -> what the forward saved for its backward
_TICKETS = itertools.count(1)


def register(fuser) -> int:
    """A handle for ``fuser`` that a graph may hold (the fuser stays the Python object's)."""
    handle = next(_HANDLES)
    _FUSERS[handle] = weakref.ref(fuser, lambda _, h=handle: _FUSERS.pop(h, None))
    return handle


def _fuser(handle: int):
    fuser = _FUSERS.get(handle)
    fuser = fuser() if fuser is not None else None
    if fuser is None:
        raise RuntimeError("te_fuser: a compiled graph calls a fuser that no longer exists (its model was changed "
                           "or freed); recompile")
    return fuser


def _apart(outputs: list, inputs) -> list:
    """``outputs`` with a copy of each that shares memory with an input or an earlier
    output (a custom op's outputs may alias neither)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


@torch.library.custom_op("te_fuser::run_group", mutates_args=())
def run_group(x: torch.Tensor, params: list[torch.Tensor], extras: list[torch.Tensor], handle: int, training: bool,
              needs_backward: bool, compute_dtype: torch.dtype) -> list[torch.Tensor]:
    from ..autocast import STATE_STACK
    from .fuser import run_forward

    fuser = _fuser(handle)
    if not fuser._params_current():
        fuser._refresh_params()
    raw = STATE_STACK[-1]
    state = raw if fuser.own_recipe is None else fuser.resolve(raw)
    plan = fuser.plan_for(x, training, needs_backward, compute_dtype, state, raw)
    ctxs, y, extra_outputs = run_forward(fuser, plan, x, list(extras))
    ticket = torch.tensor(next(_TICKETS), dtype=torch.int64)
    if needs_backward:
        key = int(ticket)
        _SAVED[key] = (fuser, plan, ctxs, x.dtype)
        weakref.finalize(ticket, _SAVED.pop, key, None)
    return _apart([y, *extra_outputs], [x, *params, *extras]) + [ticket]


@run_group.register_fake
def _run_group_fake(x, params, extras, handle, training, needs_backward, compute_dtype):
    shape, dtype, extra_meta = _fuser(handle).output_meta(x.shape, x.dtype, compute_dtype, [e.dtype for e in extras])
    outs = [x.new_empty(shape, dtype=dtype)] + [x.new_empty(s, dtype=d) for s, d in extra_meta]
    return outs + [torch.empty((), dtype=torch.int64)]


def _setup(ctx, inputs, output) -> None:
    x, params, extras = inputs[0], inputs[1], inputs[2]
    ctx.n_extra_out = len(output) - 2
    ctx.save_for_backward(output[-1], x, *params, *extras)
    ctx.sizes = (len(params), len(extras))


def _backward(ctx, grads):
    ticket, x, *rest = ctx.saved_tensors
    n_params, n_extras = ctx.sizes
    params, extras = rest[:n_params], rest[n_params:]
    need_x, need_params, need_extras = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    needs = [need_x, *need_params, *need_extras]
    like = [x, *params, *extras]
    outs = run_group_backward(ticket, list(grads[: 1 + ctx.n_extra_out]), needs, [t for t, n in zip(like, needs) if n])
    it = iter(outs)
    got = [next(it) if n else None for n in needs]
    return got[0], got[1 : 1 + n_params], got[1 + n_params :], None, None, None, None


torch.library.register_autograd("te_fuser::run_group", _backward, setup_context=_setup)


@torch.library.custom_op("te_fuser::run_group_backward", mutates_args=())
def run_group_backward(ticket: torch.Tensor, grads: list[Optional[torch.Tensor]], needs: list[bool],
                       like: list[torch.Tensor]) -> list[torch.Tensor]:
    from .fuser import keep_graph, run_backward

    key = int(ticket)
    saved = _SAVED.get(key) if keep_graph() else _SAVED.pop(key, None)  # retain_graph=True keeps it
    if saved is None:
        raise RuntimeError("te_fuser: this backward's forward state is gone (a second backward through the same "
                           "graph, or a forward that did not expect a backward)")
    fuser, plan, ctxs, x_dtype = saved
    flags = (needs[0], False, *needs[1:])
    dy, grad_extra_outputs = grads[0], tuple(grads[1:])
    out = run_backward(fuser, plan, ctxs, flags, x_dtype, dy, grad_extra_outputs)
    results = [out[0], *out[2:]]
    wanted = [g for g, n in zip(results, needs) if n]
    filled = [torch.zeros_like(t) if g is None else g for g, t in zip(wanted, like)]
    return _apart(filled, [*grads, *like])


@run_group_backward.register_fake
def _run_group_backward_fake(ticket, grads, needs, like):
    return [torch.empty_like(t) for t in like]


def compiled_call(fuser, x: torch.Tensor, training: bool, extra_inputs: tuple):
    """What a traced call of ``fuser`` puts in the graph: one ``te_fuser::run_group``."""
    if fuser._derived:
        _, module, name = fuser._derived[0]
        raise RuntimeError(
            f"te_fuser under torch.compile: {type(module).__name__}.{name} is pruned or parametrized "
            f"(torch.nn.utils.prune / parametrize), which a compiled te op group does not read; run the group "
            f"eagerly (leave it out of the compiled region) or remove the pruning or parametrization")
    params = [p for op in fuser.ops for p in op.parameters()]
    needs_backward = torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in params) or any(t.requires_grad for t in extra_inputs))
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    outs = run_group(x, params, list(extra_inputs), fuser.handle, training, needs_backward, dtype)
    return (outs[0], *outs[1:-1]) if len(outs) > 2 else outs[0]
