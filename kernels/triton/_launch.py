"""Launching compiled Triton kernels without the JIT's per-call work.

``kernel[grid](*args, **meta)`` binds the arguments, derives their
specialization, builds a cache key (a string of the options), checks the globals
the kernel read, computes launch metadata and only then calls the compiled
kernel's launcher: about 24 µs of host time a call on an H200 host, against about
6 µs for the launcher alone (run 82). :func:`launch` does that work once per
specialization: the first call of a kernel with given argument types, alignments
and constexprs goes through the JIT (compiling if need be) and keeps the
compiled kernel it returns; later calls that agree on all of them call its
launcher directly, with the arguments in the kernel's own order.

Agreeing means what Triton specializes on, or more finely: a tensor's dtype and
whether its address is 16-byte aligned; an integer's width class, whether it is 1
and whether 16 divides it; a bool's value; the value of every other argument and
of every keyword (constexprs and launch options such as ``num_warps``); the
current device. Arguments of any other kind, kernels that are not plain
``@triton.jit`` functions (autotuned ones, the interpreter's), and a set launch
hook take the JIT's own path every time. The same compiled code runs either
way, so the results are the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["launch", "direct_launches", "set_direct", "forget"]

try:  # the JIT's function class and its runtime knobs (launch hooks)
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    JITFunction = None
try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton before 3.4
    _knobs = None

_Tensor = torch.Tensor
_I32 = 2**31
_U64 = 2**63
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)

# (kernel, argument key, keywords, device) -> (compiled kernel, keyword values in the kernel's order)
_kept: dict = {}
_state = {"on": JITFunction is not None and _raw_stream is not None, "direct": 0}


def set_direct(on: bool) -> bool:
    """Turn the direct path on or off (for tests and comparisons); returns the old setting."""
    old = _state["on"]
    _state["on"] = bool(on) and JITFunction is not None and _raw_stream is not None
    return old


def direct_launches() -> int:
    """How many launches took the direct path so far (for tests and reports)."""
    return _state["direct"]


def _arg_key(args: tuple):
    """What Triton specializes the positional ``args`` on (or finer); None: an
    argument of another kind, for which only the JIT decides. An integer is a code:
    1 for the value 1, else its width class (i32, i64, u64) and whether 16 divides it."""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is int:
            if a == 1:
                add(1)
            elif -_I32 <= a < _I32:
                add(2 if a % 16 == 0 else 3)
            elif a < _U64:
                add(4 if a % 16 == 0 else 5)
            else:
                add(6 if a % 16 == 0 else 7)
        elif t is _Tensor:
            add((a.dtype, a.data_ptr() % 16 == 0))
        elif t is float:
            add(0)
        elif t is bool or a is None:
            add((t, a))
        elif isinstance(a, _Tensor):  # a Parameter
            add((a.dtype, a.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(key)


def _set(hook) -> bool:
    """A launch hook is set: not None and, for Triton's chains of hooks
    (``HookChain``, always present in newer Triton), holding at least one."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _hooked() -> bool:
    runtime = getattr(_knobs, "runtime", None)
    return runtime is not None and (_set(runtime.launch_enter_hook) or _set(runtime.launch_exit_hook))


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``: the JIT's path the first time a
    specialization is seen, the compiled kernel's launcher directly after that (see
    the module doc). ``args`` are the kernel's leading parameters in order; ``meta``
    holds the rest by name (constexprs) and the launch options."""
    if not _state["on"] or type(kernel) is not JITFunction:
        kernel[grid](*args, **meta)
        return
    arg_key = _arg_key(args)
    if arg_key is None or _hooked():
        kernel[grid](*args, **meta)
        return
    device = _get_device()
    key = (kernel, arg_key, tuple(meta.items()), device)
    try:
        kept = _kept.get(key)
    except TypeError:  # a keyword value that cannot be hashed
        kernel[grid](*args, **meta)
        return
    if kept is None:
        compiled = kernel[grid](*args, **meta)
        _keep(key, kernel, compiled, len(args), meta)
        return
    compiled, tail = kept
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, _raw_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    _state["direct"] += 1


def _keep(key, kernel, compiled, positional: int, meta: dict) -> None:
    """Keep ``compiled`` for ``key`` with the values of the kernel's parameters after
    the positional ones (from ``meta``, else their defaults), when that is possible."""
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return
    tail = []
    for param in kernel.params[positional:]:
        name = param.name
        if name in meta:
            tail.append(meta[name])
        elif getattr(param, "has_default", False):
            tail.append(param.default)
        else:
            return  # a parameter this call leaves to the JIT's own defaults handling
    _kept[key] = (compiled, tuple(tail))


def forget() -> None:
    """Drop the kept kernels (the next launch of each goes through the JIT again)."""
    _kept.clear()
