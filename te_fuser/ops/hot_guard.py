"""Builds and loads the op fuser's compiled hot path (``hot_guard.c``).

The unchanged-plan check of :meth:`OperationFuser.run` costs about a microsecond
in Python, most of it in the interpreter rather than in the reads it makes. The
compiled guard makes the guard's reads and comparisons (the conditions of
``ops/guard.py``, whose ``ReferenceGuard`` is the same guard in Python) in C and
calls the plan directly; the Python path handles every miss. The module is
loaded only when its field lists (``READS``, ``DECISION``) are those of
``guard.Reads`` and ``guard.Decision``.

It is a plain CPython extension, compiled with the C compiler Python was built
with the first time a fuser is made in a process (about a second), into

- ``$TE_FUSER_CACHE_DIR/hot_guard`` when that variable is set,
- ``~/.cache/te_fuser/hot_guard`` otherwise,

under a name that carries a digest of the source and the Python ABI, so later
processes only load it (a per-user temporary folder when the cache cannot be
written). Without a compiler or Python's headers, or with
``TE_FUSER_HOT_GUARD=0``, fusers run the Python path: the same decisions,
about twice the overhead per call. :func:`unavailable_reason` says which.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from ..kernels import env as _env
from .guard import Decision, Reads

__all__ = ["guard_module", "unavailable_reason", "SOURCE"]

_log = logging.getLogger("te_fuser.ops.hot_guard")

SOURCE = Path(__file__).resolve().with_name("hot_guard.c")
_MODULE_NAME = "te_fuser.ops._hot_guard"  # the C file's PyInit__hot_guard
_state: dict = {"tried": False, "module": None, "reason": None}


def _library_paths() -> list[Path]:
    """Where the built module is looked for and built: the cache, then (when the
    cache cannot be written) a per-user temporary folder."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:16]
    name = f"_hot_guard_{digest}{suffix}"
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [Path(_env.cache_dir()) / "hot_guard" / name,
            Path(tempfile.gettempdir()) / f"te_fuser_hot_guard_{user}" / name]


def _compile(target: Path) -> None:
    """Compile the C file into ``target`` (atomically: a concurrent build is harmless)."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"Python's headers are missing (no Python.h in {include})")
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:  # Python built elsewhere: this machine's cc
        cc = ["cc"]
    flags = ["-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def guard_module():
    """The compiled module (built on the first call of the process), or None."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if not _env.hot_guard_enabled():
        _state["reason"] = "disabled by TE_FUSER_HOT_GUARD=0"
        return None
    t0 = time.perf_counter()
    try:
        paths = _library_paths()
        path = next((p for p in paths if p.exists()), None)
        if path is None:
            for path in paths:
                try:
                    _compile(path)
                    break
                except OSError:  # an unwritable folder: the next one
                    if path == paths[-1]:
                        raise
        module = _load(path)
        if (module.READS, module.DECISION) != (Reads._fields, Decision._fields):
            raise RuntimeError(f"hot_guard.c's fields {module.READS}, {module.DECISION} are not guard.py's "
                               f"{Reads._fields}, {Decision._fields}")
        _state["module"] = module
    except Exception as err:  # no compiler, no headers, nowhere to write: the Python path runs
        _state["reason"] = f"{type(err).__name__}: {err}"
        _log.info("te_fuser: the compiled hot path is unavailable (%s); fusers use the Python path", _state["reason"])
        return None
    _log.info("te_fuser: compiled hot path loaded in %.2f s", time.perf_counter() - t0)
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why fusers run the Python hot path (``None`` when the compiled one loads)."""
    guard_module()
    return _state["reason"]
