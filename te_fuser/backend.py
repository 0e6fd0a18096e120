"""Kernel backends: ``reference`` (plain torch), ``triton``, ``cuda``, and ``auto``.

Every backend implements the kernels of ``kernels/contract.py``'s ``KERNELS``
under the same names and signatures (those of :mod:`te_fuser.kernels.reference`,
without the ``_reference`` suffix), or lacks some.

``set_backend(name)`` chooses globally; ``te.autocast(backend=...)`` overrides it
inside a region. ``auto`` (the default) uses ``reference`` on CPU tensors and, on
a GPU, the backend measured fastest for each kernel (``kernels/auto_table.json``).
A backend that lacks a kernel falls back to ``triton`` where it runs, else to
``reference``, and says so in :class:`KernelChoice` (``fusion_plan()`` shows it). An
``auto`` entry may also split by size, ``{"small": "cuda", "large": "triton",
"min_elements": N}``: calls whose first tensor has N elements or more go to the
``large`` backend (a cast measured faster there once bandwidth dominates), smaller
ones to ``small`` (cheaper to launch). A
backend module may also expose ``<kernel>_unsupported_reason(a, b)``: operands it
names a reason for go to the fallback per call (cuBLASLt has no MXFP8 path on
Hopper, for example); the others go to ``<kernel>.when_supported`` when the
kernel has that attribute (the kernel without its own second check), else to
``<kernel>``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import epoch
from .kernels import env as _env
from .kernels.contract import KERNELS  # the kernel layer's table: what every backend owes

__all__ = ["BACKENDS", "KERNELS", "KernelChoice", "set_backend", "get_backend", "use_backend", "resolve",
           "push_override", "pop_override", "check_name", "set_auto_entry", "choices_version"]

BACKENDS = ("reference", "triton", "cuda", "auto")
_MODULES = {
    "reference": "te_fuser.kernels.reference",
    "triton": "te_fuser.kernels.triton",
    "cuda": "te_fuser.kernels.cuda",
}

# "backend": None until resolved from the environment; "choices": how many times
# what a backend name resolves to changed (set_auto_entry), which plan templates read
_state: dict[str, Any] = {"backend": None, "choices": 0}
_override: list[str] = []
_resolved: dict[tuple[str, str, torch.device], "KernelChoice"] = {}
# (kernel, device as given) -> the choice under the global backend, no autocast override in force
_global_choices: dict[tuple, "KernelChoice"] = {}
_auto_table: dict[str, Any] | None = None


@dataclass(frozen=True)
class KernelChoice:
    """The function that runs ``kernel`` and the backend it came from."""

    kernel: str
    backend: str
    fn: Callable
    note: str = ""


def check_name(name: str) -> str:
    """``name`` when it is a backend, else a ValueError listing them."""
    if name not in BACKENDS:
        raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Choose the kernel backend for the whole process (published plans made for
    another one are rebuilt at their next call)."""
    _state["backend"] = check_name(name)
    _global_choices.clear()
    epoch.bump()


def push_override(name: str) -> None:
    """Make ``name`` the backend in force until :func:`pop_override` (``te.autocast(backend=...)``)."""
    _override.append(check_name(name))
    epoch.bump()


def pop_override() -> None:
    _override.pop()
    epoch.bump()


def get_backend() -> str:
    """The backend in force here (an autocast override wins over the global one)."""
    if _override:
        return _override[-1]
    if _state["backend"] is None:
        _state["backend"] = check_name(_env.backend_default() or "auto")
    return _state["backend"]


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Use backend ``name`` inside the block (``None``: no change)."""
    if name is None:
        yield
        return
    push_override(name)
    try:
        yield
    finally:
        pop_override()


def _module(backend: str):
    return importlib.import_module(_MODULES[backend])


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None if "triton" not in sys.modules \
        else sys.modules["triton"] is not None


def _unavailable_reason(backend: str, device: torch.device) -> str | None:
    if backend == "triton":
        if not _triton_installed():
            return "triton is not installed (pip install triton; CUDA builds of torch bring it)"
        if device.type == "cpu" and not _env.triton_interpreted():
            return "the triton backend runs on CPU tensors only under TRITON_INTERPRET=1 (set before import)"
        if device.type not in ("cpu", "cuda"):
            return f"the triton backend does not run on {device.type} tensors"
    if backend == "cuda":
        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors, got a {device.type} tensor"
        if not torch.cuda.is_available():
            return "the cuda backend needs a GPU, and torch.cuda.is_available() is False"
    return None


def _load_auto_table() -> dict:
    global _auto_table
    if _auto_table is None:
        path = Path(_module("reference").__file__).parent.parent / "auto_table.json"
        _auto_table = json.loads(path.read_text()) if path.exists() else {}
    return _auto_table


def set_auto_entry(kernel: str, entry: str | dict) -> str | dict | None:
    """Make ``entry`` ``auto``'s choice for ``kernel`` on a GPU in this process (a
    backend name, or a split by size as in ``kernels/auto_table.json``) and return
    the entry it replaces: one kernel's A/B in a benchmark, without editing the
    table. Published plans are rebuilt at their next call."""
    if kernel not in KERNELS:
        raise ValueError(f"set_auto_entry(kernel=...): must be one of {list(KERNELS)}, got {kernel!r}")
    names = [entry] if isinstance(entry, str) else None
    if isinstance(entry, dict) and set(entry) == {"small", "large", "min_elements"} and \
            isinstance(entry["min_elements"], int) and not isinstance(entry["min_elements"], bool) and \
            entry["min_elements"] > 0:
        names = [entry["small"], entry["large"]]
    if names is None or any(name not in ("reference", "triton", "cuda") for name in names):
        raise ValueError(f"set_auto_entry(entry=...): a backend of ['reference', 'triton', 'cuda'] or "
                         f"{{'small': ..., 'large': ..., 'min_elements': N > 0}}, got {entry!r}")
    table = _load_auto_table()
    previous = table.get(kernel)
    table[kernel] = dict(entry) if isinstance(entry, dict) else entry  # the caller's dict may change later
    for key in [k for k in _resolved if k[0] == kernel]:
        del _resolved[key]
    _global_choices.clear()
    _state["choices"] += 1
    epoch.bump()
    return previous


def choices_version() -> int:
    """A number that changes whenever ``auto`` may resolve a kernel otherwise
    (:func:`set_auto_entry`): what a plan template decided under one value (its
    fusion decisions read the backends' choices) is not reused under another."""
    return _state["choices"]


def _auto_entry(kernel: str, device: torch.device) -> str | dict:
    """The auto table's entry: a backend name, or a split by size (see the module doc)."""
    if device.type != "cuda":
        return "reference"
    return _load_auto_table().get(kernel, "triton")


def _by_size(kernel: str, device: torch.device, split: dict) -> "KernelChoice":
    """One function that sends each call to the small or the large backend's kernel."""
    small = resolve(kernel, device, backend=split["small"])
    large = resolve(kernel, device, backend=split["large"])
    limit = int(split["min_elements"])
    small_fn, large_fn = small.fn, large.fn

    def dispatch(x, *args, **kwargs):
        return (large_fn if x.numel() >= limit else small_fn)(x, *args, **kwargs)

    dispatch.__name__ = getattr(large_fn, "__name__", "dispatch")
    small_lean, large_lean = getattr(small_fn, "lean", None), getattr(large_fn, "lean", None)
    if small_lean is not None or large_lean is not None:  # the lean entry of the kernel the size picks

        def lean(x, *args, **kwargs):
            entry = large_lean if x.numel() >= limit else small_lean
            return None if entry is None else entry(x, *args, **kwargs)

        dispatch.lean = lean
    note = f"tensors of {limit} elements or more go to {large.backend}, smaller ones to {small.backend}"
    return KernelChoice(kernel, large.backend, dispatch, note)


def _fallback(kernel: str, failed: str, device: torch.device) -> "KernelChoice":
    """The next backend for ``kernel`` after ``failed``: triton where it runs (sending
    the operands its kernel names a reason for on to the reference, as triton's own
    choice does), else reference."""
    reference = getattr(_module("reference"), f"{kernel}_reference")
    if failed != "triton" and _unavailable_reason("triton", device) is None:
        module = _module("triton")
        fn = getattr(module, kernel, None)
        if fn is not None:
            reason = getattr(module, f"{kernel}_unsupported_reason", None)
            if reason is not None:
                fn = _per_call_fallback(getattr(fn, "when_supported", fn), reason, reference, lean_from=fn)
            return KernelChoice(kernel, "triton", fn)
    return KernelChoice(kernel, "reference", reference)


# A kernel's lean entries, which hand any case they do not take back to the kernel
# itself: ``prepare`` (the constant arguments checked once, a call that does the
# rest), ``tensorwise`` (the GEMM of two per-tensor scaled operands, or None) and
# ``lean`` (the kernel's own call with the launch's checks only, or None).
LEAN_ENTRIES = ("prepare", "tensorwise", "lean")


def lean_first(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, through the kernel's ``lean`` entry where it has one and
    takes the call (an answer that is not None), else through ``fn`` and its checks."""
    lean = getattr(fn, "lean", None)
    out = None if lean is None else lean(*args, **kwargs)
    return fn(*args, **kwargs) if out is None else out


def _per_call_fallback(fn: Callable, unsupported_reason: Callable, fallback_fn: Callable,
                       lean_from: Callable | None = None) -> Callable:
    """``fn`` where ``unsupported_reason(*args)`` is None, else ``fallback_fn``; the
    lean entries of ``lean_from`` (see :data:`LEAN_ENTRIES`) are kept on it."""

    def dispatch(*args, **kwargs):
        if unsupported_reason(*args[:2]) is None:
            return fn(*args, **kwargs)
        return fallback_fn(*args, **kwargs)

    dispatch.__name__ = getattr(fn, "__name__", "dispatch")
    for name in LEAN_ENTRIES:
        entry = getattr(lean_from, name, None)
        if entry is not None:
            setattr(dispatch, name, entry)
    return dispatch


def resolve(kernel: str, device: torch.device | str, backend: str | None = None) -> KernelChoice:
    """The implementation of ``kernel`` for tensors on ``device``.

    Raises ``RuntimeError`` naming the backend and the missing requirement when an
    explicitly chosen backend cannot run there.
    """
    if backend is None and not _override:  # the hot path: the global backend's choice, one look-up
        hit = _global_choices.get((kernel, device))
        if hit is not None:
            return hit
        choice = _resolve(kernel, device, None)
        _global_choices[(kernel, device)] = choice
        return choice
    return _resolve(kernel, device, backend)


def _resolve(kernel: str, device: torch.device | str, backend: str | None) -> KernelChoice:
    if not isinstance(device, torch.device):
        device = torch.device(device)
    requested = backend or (_override[-1] if _override else _state["backend"]) or get_backend()
    cache_key = (kernel, requested, device)  # the choice depends on device.type only; hashing
    hit = _resolved.get(cache_key)  # the device is cheaper than reading its type
    if hit is not None:  # the hot path: one dict look-up
        return hit
    check_name(requested)
    if kernel not in KERNELS:
        raise ValueError(f"kernel: must be one of {list(KERNELS)}, got {kernel!r}")
    chosen = _auto_entry(kernel, device) if requested == "auto" else requested
    if isinstance(chosen, dict):
        choice = _by_size(kernel, device, chosen)
        _resolved[cache_key] = choice
        return choice
    reason = _unavailable_reason(chosen, device)
    if reason is not None:
        if requested == "auto":
            chosen, reason = "reference", None
        else:
            raise RuntimeError(f"backend {chosen!r} cannot run kernel {kernel!r}: {reason}")
    note = ""
    if chosen == "reference":
        fn = getattr(_module("reference"), f"{kernel}_reference")
    else:
        module = _module(chosen)
        fn = getattr(module, kernel, None)
        if fn is None:
            fallback = _fallback(kernel, chosen, device)
            note = f"{chosen} has no {kernel} kernel; using {fallback.backend}"
            chosen, fn = fallback.backend, fallback.fn
        elif hasattr(module, f"{kernel}_unsupported_reason"):
            fallback = _fallback(kernel, chosen, device)
            dispatch = _per_call_fallback(
                getattr(fn, "when_supported", fn), getattr(module, f"{kernel}_unsupported_reason"), fallback.fn,
                lean_from=fn,
            )
            dispatch.__name__ = getattr(fn, "__name__", "dispatch")
            fn = dispatch
            note = f"operand pairs {chosen} cannot run go to {fallback.backend}"
    choice = KernelChoice(kernel, chosen, fn, note)
    _resolved[cache_key] = choice
    return choice
