"""The guard: when a call may run the published plan without deciding afresh.

Each :class:`~te_fuser.ops.fuser.OperationFuser` calls its ops through a guard
(``fuser.entry``): the compiled one of ``hot_guard.c`` when it loads. The
fuser's miss path, ``OperationFuser.run``, decides which plan a call runs
(building one when none applies) and then *arms* the guard with that decision,
a :class:`Decision`. ``guard(x, training)`` runs the armed plan when every
condition below holds, and otherwise hands the call to the miss path, which
decides afresh and arms the guard again. A hit is therefore always a call that
the miss path would also have run, with the same plan.

What a guard reads on every call is fixed when it is made (:class:`Reads`). The
conditions, in the order they are checked, and what the miss path does when one
fails (it checks the same state, then re-validates what the guard compares by
identity only):

    a call hits when                                  armed field      on a miss, ``OperationFuser.run``
 1  a decision is armed and ``training`` is its bool  training         rebuilds
 2  ``x`` is a ``torch.Tensor``                       -                raises its TypeError
 3  te.autocast's state in force (``stack[-1]``) is   state            re-validates: the same recipe (object or
    the armed state object                                             string), calibrating flag and amax group
                                                                       select the plan again; else rebuilds
 4  torch's global forward-hook dicts are empty       -                runs the hooks around the same plan
 5  a backward follows (grad mode on and ``x`` or     needs_backward,  rebuilds
    one of ``params`` requires grad) iff armed so     params
 6  the compute dtype (torch.autocast's for ``x``     dtype            rebuilds
    when one is active, else ``x.dtype``) is armed
 7  ``x.is_cuda`` is armed                            is_cuda          rebuilds
 8  ``x.shape`` equals the armed shape                in_shape         re-validates the shape against the plan's
                                                                       ops and quantizers (remembered per plan)
 9  te_fuser.epoch's change counter equals the        epoch            re-validates: re-reads the parameters from
    armed value                                                        the ops' dicts, runs the ops' module hooks;
                                                                       rebuilds when the kernel backend or the
                                                                       ops' installed quantizers changed

On a hit the guard counts one (:meth:`take_hits` hands the count to the fuser's
statistics) and returns ``apply(x, plan_arg, *params)``.

A call with extra inputs (a residual, ``seq(x, x)``) takes the same decision
through ``OperationFuser.entry_with_extras``: ``matches(x, training)`` (conditions
1-9, read from ``x`` and the parameters alone), then the extra inputs' share of
condition 5 (one that requires grad needs an armed plan with a backward), and
``apply(x, plan_arg, *params, *extra_inputs)``; its miss path arms the guard as
the other's does. Nothing else of a decision reads the extra inputs: the ops
check their shapes when they run.

Condition 9 stands for everything the guard does not read itself: the counter is
bumped when any op installs quantizers (another model sharing the op, or
``te.warmup``), when a Parameter or module hook of an op is registered or removed
through ``nn.Module``'s methods (a replaced Parameter, a new hook), by
``module.to()`` and by a change of kernel backend (``te.set_backend``,
``te.autocast(backend=...)``), and by any write into an op's ``_parameters``
dict (a dict that bumps it on every write: FSDP2's swaps, hand-made tying): the
guard never reads the parameter dicts, only the miss path does.

The miss path arms only when the call ran without hooks and outside
``te.apply_recipe``'s probe, and the fuser disarms the guard whenever it
publishes another plan, re-reads its parameters or has its own recipe changed.

:class:`ReferenceGuard` is the guard in Python, the conditions above in their
order; ``hot_guard.c`` is the same guard in C (``tests/test_hot_guard.py`` runs
one table of conditions through both and the miss path alone).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Reads", "Decision", "ReferenceGuard"]


class Reads(NamedTuple):
    """What a guard reads on every call, fixed when it is made (its constructor's arguments)."""

    miss: Callable  # (x, training) -> output: the fuser's miss path, which arms the guard again
    stack: list  # te.autocast's states, the innermost last (autocast.STATE_STACK)
    epoch: list  # [int]: te_fuser.epoch's change counter
    grad_enabled: Callable  # torch.is_grad_enabled
    any_autocast: Callable  # torch._C._is_any_autocast_enabled
    compute_dtype: Callable  # x -> the dtype torch.autocast computes x's ops in
    tensor_type: type  # torch.Tensor
    hook_dicts: tuple  # dicts that must be empty: torch's global forward hooks


class Decision(NamedTuple):
    """What an armed guard holds (``arm``'s argument): the conditions a call must
    repeat, in the order they are checked, then what a hit runs."""

    state: Any  # te.autocast's state object that selected the plan (compared by identity)
    training: bool
    needs_backward: bool
    params: tuple  # the fuser's flat parameters: read for requires_grad, passed to the plan
    dtype: torch.dtype  # the compute dtype
    is_cuda: bool
    in_shape: torch.Size  # an input shape the plan has validated
    epoch: int  # the change counter when the plan was last found valid
    apply: Callable  # apply(x, plan_arg, *params): runs the plan (the fuser's autograd Function)
    plan_arg: tuple  # (fuser, plan)


def _check_decision(decision) -> Decision:
    if not isinstance(decision, tuple) or len(decision) != len(Decision._fields):
        raise TypeError(f"hot guard: arm() takes a guard.Decision (a tuple of {len(Decision._fields)} fields)")
    decision = Decision(*decision)
    if not isinstance(decision.params, tuple):
        raise TypeError("hot guard: arm(): the decision's params must be a tuple")
    if any(v is not True and v is not False for v in (decision.training, decision.needs_backward, decision.is_cuda)):
        raise TypeError("hot guard: arm(): the decision's training, needs_backward and is_cuda must be True or False")
    return decision


class ReferenceGuard:
    """The guard in Python: ``guard(x, training)`` runs the armed plan when the
    module doc's conditions hold, else the miss path. Same interface as
    ``hot_guard.c``'s ``Guard``: ``arm(decision)``, ``disarm()``, ``matches(x,
    training)`` (the hit check alone), ``take_hits()``, ``armed``."""

    __slots__ = ("_reads", "_decision", "_hits")

    def __init__(self, miss, stack, epoch, grad_enabled, any_autocast, compute_dtype, tensor_type, hook_dicts):
        if not isinstance(stack, list) or not isinstance(epoch, list):
            raise TypeError("hot guard: stack and epoch must be lists")
        if len(epoch) != 1:
            raise ValueError("hot guard: epoch must be a list of one int")
        if not isinstance(tensor_type, type):
            raise TypeError("hot guard: tensor_type must be a type")
        if not isinstance(hook_dicts, tuple) or not all(isinstance(d, dict) for d in hook_dicts):
            raise TypeError("hot guard: hook_dicts must be a tuple of dicts")
        self._reads = Reads(miss, stack, epoch, grad_enabled, any_autocast, compute_dtype, tensor_type, hook_dicts)
        self._decision: Decision | None = None
        self._hits = 0

    @property
    def armed(self) -> bool:
        """Whether a decision is armed."""
        return self._decision is not None

    def arm(self, decision: Decision) -> None:
        """Hold ``decision``: the calls that repeat its conditions run its plan."""
        self._decision = _check_decision(decision)

    def disarm(self) -> None:
        """Forget the armed decision: the next call takes the miss path."""
        self._decision = None

    def take_hits(self) -> int:
        """The hits counted since the last call, and reset to 0."""
        hits, self._hits = self._hits, 0
        return hits

    def matches(self, x, training) -> bool:
        """Whether the armed plan applies to ``guard(x, training)`` (conditions 1-9)."""
        d, r = self._decision, self._reads
        if d is None or training is not d.training or not isinstance(x, r.tensor_type):  # 1, 2
            return False
        if not r.stack or r.stack[-1] is not d.state:  # 3
            return False
        if any(r.hook_dicts):  # 4
            return False
        needs_backward = r.grad_enabled() is True and (
            x.requires_grad is True or any(p.requires_grad is True for p in d.params))
        if needs_backward is not d.needs_backward:  # 5
            return False
        if (r.compute_dtype(x) if r.any_autocast() is True else x.dtype) is not d.dtype:  # 6
            return False
        if x.is_cuda is not d.is_cuda:  # 7
            return False
        if not x.shape == d.in_shape:  # 8
            return False
        return r.epoch[0] == d.epoch  # 9

    def __call__(self, x, training):
        if not self.matches(x, training):
            return self._reads.miss(x, training)
        self._hits += 1
        d = self._decision
        return d.apply(x, d.plan_arg, *d.params)
