"""Stable string keys for callables that live inside recipes.

A recipe's string is the fusion cache key, so a callable field must contribute a
string that names it. In order of preference a callable is named by:

1. its explicit key: ``@keyed("name")`` on the function, or a ``*_key=`` argument
   of the recipe. Stable across processes and checkpoints.
2. ``module:qualname`` for a plain module-level function (or a function nested in
   a class, reachable by its qualified name and without a closure).
3. a fallback token ``fallback:<module:qualname>#<n>`` for lambdas, closures, bound
   methods and callable instances. ``n`` comes from a process-wide counter, so a
   token is unique for the object's lifetime and never reused, even after the
   object is freed; memory addresses are never used.

A key containing a fallback token is valid for one process only. When a key
changes from one activation to the next *only* because of fallback tokens (a fresh
lambda per step), every step would re-fuse: :class:`FallbackChurnDetector` warns
once, naming the callable.
"""

from __future__ import annotations

import itertools
import re
import threading
import types
import warnings
import weakref
from typing import Any, Callable

__all__ = ["keyed", "callable_key", "FallbackChurnDetector", "FALLBACK_PREFIX"]

_EXPLICIT_ATTR = "__te_fuser_key__"
FALLBACK_PREFIX = "fallback:"
_FALLBACK_RE = re.compile(r"fallback:([^#,)\s]*)#\d+")

_counter = itertools.count(1)
_lock = threading.Lock()
# id(obj) -> (weakref or strong ref, token).  Entries of weak-referenceable objects
# are dropped by the weakref callback when the object dies; the token counter
# never goes back, so a new object at a reused address gets a new token.
_tokens: dict[int, tuple[Any, int]] = {}


def keyed(key: str) -> Callable[[Callable], Callable]:
    """Decorator giving a callable an explicit, process-independent key.

    >>> @keyed("amax-p99")
    ... def amax_p99(history): ...
    """
    if not isinstance(key, str) or not key or key != key.strip():
        raise ValueError(f"keyed(): key must be a non-empty string without surrounding spaces, got {key!r}")

    def mark(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"keyed({key!r}) must decorate a callable, got {type(fn).__name__}")
        try:
            setattr(fn, _EXPLICIT_ATTR, key)
        except (AttributeError, TypeError) as err:
            raise TypeError(
                f"keyed({key!r}) cannot attach a key to {fn!r}; pass the key through the "
                "recipe's *_key= argument instead"
            ) from err
        return fn

    return mark


def _lifetime_token(obj: Any) -> int:
    """A number unique to ``obj`` for as long as it lives, never handed out again."""
    oid = id(obj)
    with _lock:
        entry = _tokens.get(oid)
        if entry is not None:
            ref, token = entry
            target = ref() if isinstance(ref, weakref.ref) else ref
            if target is obj:
                return token
        token = next(_counter)
        try:
            ref = weakref.ref(obj, lambda _r, oid=oid, token=token: _forget(oid, token))
        except TypeError:
            ref = obj  # not weak-referenceable: keep it alive so the id cannot be reused
        _tokens[oid] = (ref, token)
        return token


def _forget(oid: int, token: int) -> None:
    with _lock:
        entry = _tokens.get(oid)
        if entry is not None and entry[1] == token:
            del _tokens[oid]


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}"


def _is_plain_module_function(fn: Any) -> bool:
    if not isinstance(fn, types.FunctionType):
        return False
    if fn.__closure__ or "<lambda>" in fn.__qualname__ or "<locals>" in fn.__qualname__:
        return False
    return True


def callable_key(fn: Callable, explicit: str | None = None) -> str:
    """The key a callable contributes to a recipe string."""
    if explicit is not None:
        return f"key:{explicit}"
    mark = getattr(fn, _EXPLICIT_ATTR, None)
    if isinstance(mark, str):
        return f"key:{mark}"
    if _is_plain_module_function(fn):
        return _describe(fn)
    if isinstance(fn, types.MethodType):
        return f"{FALLBACK_PREFIX}{_describe(fn.__func__)}#{_lifetime_token(fn.__self__)}"
    return f"{FALLBACK_PREFIX}{_describe(fn)}#{_lifetime_token(fn)}"


def strip_fallback_tokens(key: str) -> str:
    """``key`` with the per-object numbers of fallback tokens removed."""
    return _FALLBACK_RE.sub(lambda m: f"fallback:{m.group(1)}#*", key)


def fallback_names(key: str) -> list[str]:
    """The callables (``module:qualname``) named by fallback tokens in ``key``."""
    return sorted(set(_FALLBACK_RE.findall(key)))


class FallbackChurnDetector:
    """Warns once when a key keeps changing only because of fallback tokens.

    Call :meth:`observe` with the key of every activation whose key differs from
    the previous one. After ``threshold`` consecutive changes that vanish once
    fallback tokens are stripped, one ``UserWarning`` names the callables.
    """

    threshold = 2

    def __init__(self, where: str = "te_fuser") -> None:
        self._where = where
        self._last: str | None = None
        self._streak = 0
        self.warned = False

    def snapshot(self) -> tuple:
        """Its state now (see :meth:`restore`)."""
        return self._last, self._streak, self.warned

    def restore(self, state: tuple) -> None:
        self._last, self._streak, self.warned = state

    def observe(self, key: str) -> None:
        last, self._last = self._last, key
        if last is None or last == key:
            return
        if strip_fallback_tokens(last) != strip_fallback_tokens(key):
            self._streak = 0
            return
        self._streak += 1
        if self._streak >= self.threshold and not self.warned:
            self.warned = True
            names = ", ".join(fallback_names(key)) or "an unkeyed callable"
            warnings.warn(
                f"{self._where}: the recipe key changes at every step only because a new "
                f"unkeyed callable ({names}) is passed each time, so every step re-fuses. "
                "Create the callable once, or give it a stable key with "
                "@te_fuser.recipe.keyed('name') or the recipe's *_key= argument.",
                UserWarning,
                stacklevel=3,
            )
