"""FP8 copies of weights, reused only where they cannot be stale.

A linear op casts its weight to FP8 in every forward, once for the forward GEMM
and the backward GEMMs of that step together. Reusing the cast across forwards
would save that pass, but only if the weight is known not to have changed, and
torch cannot always tell: a fused optimizer (``AdamW(fused=True)``) and writes
through ``.data`` (EMA, master-weight copies) change a weight without bumping
its version counter. So a cast is kept across forwards only inside a scope
the caller declared:

    with te.reuse_quantized_weights():           # weights stay as they are in here
        for micro_batch in batch.chunk(4):
            with te.autocast(recipe=recipe):
                loss = loss_fn(model(micro_batch))
            loss.backward()
    optimizer.step()

Inside the scope, a weight's cast is reused while all of these stay the same:
the scope (a new outermost entry starts afresh), the number of optimizer steps
taken by any ``torch.optim.Optimizer`` (counted through torch's global
step hook, so fused, foreach, for-loop and capturable steps all count), the
Parameter object, its version counter and storage, the quantizer and the
high-precision dtype it was cast from. What the scope asks of the caller is
only that nothing writes a weight behind torch's back (``.data``, a hand-written
optimizer that is not a ``torch.optim.Optimizer``) inside it. On leaving the
outermost scope every cast kept in it is dropped.

Outside a scope nothing is kept: a forward after any change, tracked or not,
casts the weight it reads. Gradient accumulation and repeated inference
forwards are what the scope is for.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["WeightCache", "reuse_quantized_weights", "optimizer_steps", "scope_token", "reuse_scope_open"]

# Optimizer steps taken in this process, by any torch optimizer.
_OPTIMIZER_STEPS = [0]


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


_STEP_HOOK = register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """How many ``torch.optim.Optimizer`` steps this process has taken."""
    return _OPTIMIZER_STEPS[0]


def scope_token() -> int:
    """The token of the outermost ``reuse_quantized_weights()`` in force (0: none)."""
    return _Scope.token


def reuse_scope_open() -> bool:
    """Whether a ``reuse_quantized_weights()`` is in force (outside one, a lookup
    finds nothing and a store keeps nothing)."""
    return _Scope.token != 0


class _Scope:
    """The state of ``reuse_quantized_weights``: its depth, the token of the
    outermost entry in force (0: none) and the caches filled under it."""

    depth = 0
    token = 0
    next_token = 1
    filled: "weakref.WeakSet[WeightCache]" = weakref.WeakSet()


class reuse_quantized_weights:  # noqa: N801 (a context manager used like a function)
    """Keep each linear's FP8 weight across forwards while the weight is unchanged
    (see the module doc). Nestable; the outermost exit drops what was kept."""

    __slots__ = ()

    def __enter__(self) -> None:
        if _Scope.depth == 0:
            _Scope.token = _Scope.next_token
            _Scope.next_token += 1
        _Scope.depth += 1

    def __exit__(self, *exc) -> None:
        _Scope.depth -= 1
        if _Scope.depth == 0:
            _Scope.token = 0
            for cache in list(_Scope.filled):
                cache.clear()
            _Scope.filled = weakref.WeakSet()


class WeightCache:
    """One linear's cast weight, held under the rules of the module doc.

    ``lookup`` returns the kept cast of ``weight`` by ``quantizer`` (with a
    column-wise copy when asked) or ``None``; ``store`` keeps a cast, inside a
    scope only. Graph replay (``te.make_graphed``) hands casts in and out through
    the same two calls."""

    __slots__ = ("_weight", "_quantizer", "_stamp", "_columnwise", "_value", "__weakref__")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._weight: torch.Tensor | None = None  # the weight and quantizer are compared by identity
        self._quantizer = None
        self._stamp: tuple | None = None
        self._columnwise = False
        self._value: Any = None

    def __reduce__(self):  # copies and pickles start empty
        return (WeightCache, ())

    @staticmethod
    def _stamp_of(weight: torch.Tensor, dtype: torch.dtype | None) -> tuple | None:
        """What must stay the same for a kept cast to be reused (None: an inference
        tensor, which has no version counter, so a change cannot be seen)."""
        try:
            version = weight._version
        except RuntimeError:
            return None
        return (_Scope.token, _OPTIMIZER_STEPS[0], version, weight.data_ptr(), dtype)

    def lookup(self, quantizer, weight: torch.Tensor, dtype: torch.dtype, need_columnwise: bool):
        if self._weight is not weight or self._quantizer is not quantizer or _Scope.token == 0:
            return None
        stamp = self._stamp
        if (need_columnwise and not self._columnwise) or stamp is None or stamp != self._stamp_of(weight, dtype):
            return None
        return self._value

    def holds(self, quantizer, weight: torch.Tensor, dtype: torch.dtype) -> "tuple[bool, Any] | None":
        """``(has a column-wise copy, the cast)`` when a kept cast is reusable now."""
        value = self.lookup(quantizer, weight, dtype, False)
        return None if value is None else (self._columnwise, value)

    def store(self, quantizer, weight: torch.Tensor, dtype: torch.dtype, columnwise: bool, value) -> None:
        stamp = self._stamp_of(weight, dtype) if _Scope.token else None
        if stamp is None:
            return
        self._weight, self._quantizer, self._stamp = weight, quantizer, stamp
        self._columnwise, self._value = columnwise, value
        _Scope.filled.add(self)

    @property
    def empty(self) -> bool:
        return self._value is None
