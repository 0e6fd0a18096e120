"""The one place te_fuser reads environment variables.

It sits in the kernel layer, the lowest one: the kernels read some of the
variables too, and they import nothing from above them.

Each variable is read when the object that needs it is *constructed* (never on
the hot path) and its value is stored in an explicit field, so the recipe string
shows it. The one exception, ``TE_FUSER_EXACT_FP8``, selects no numerics (both FP8
encodings give the same bytes): it is read once, when the Triton kernels are
imported, into ``te_fuser.kernels.triton._common.EXACT_FP8``.

| variable | read by | meaning |
|---|---|---|
| ``TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES`` | ``Float8BlockScaling()`` with ``power_2_scales`` left unset | ``1``: fp32 block scales; otherwise power-of-2 |
| ``TE_FUSER_BACKEND`` | the first kernel dispatch of the process | default backend (``reference``, ``triton``, ``cuda``, ``auto``) |
| ``TE_FUSER_EXACT_FP8`` | the import of ``te_fuser.kernels.triton`` | ``1``: compiled Triton kernels also write FP8 with the exact integer encoding, not the GPU's conversion instruction (same bytes, slower; a fallback) |
| ``TORCH_EXTENSIONS_DIR`` | the first build of the CUDA kernels | where they are built (default ``~/.cache/te_fuser/torch_extensions``) |
| ``TE_FUSER_HOT_GUARD`` | the first op fuser made in the process | ``0``: fusers check their plan in Python instead of the compiled hot path (same decisions, slower) |
| ``TE_FUSER_CACHE_DIR`` | the first build of the compiled hot path | where it is built (default ``~/.cache/te_fuser``) |
| ``TRITON_INTERPRET`` | each kernel resolution for CPU tensors | ``1``: Triton kernels may run on CPU tensors (Triton's interpreter) |
"""

from __future__ import annotations

import os

__all__ = [
    "block_scaling_power_2_scales_default",
    "backend_default",
    "extensions_dir",
    "hot_guard_enabled",
    "cache_dir",
    "triton_interpreted",
    "triton_exact_fp8",
]


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")


def block_scaling_power_2_scales_default() -> bool:
    return not _flag("TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES")


def backend_default() -> str | None:
    value = os.environ.get("TE_FUSER_BACKEND", "").strip().lower()
    return value or None


def extensions_dir() -> str | None:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or None


def hot_guard_enabled() -> bool:
    return os.environ.get("TE_FUSER_HOT_GUARD") is None or _flag("TE_FUSER_HOT_GUARD")


def cache_dir() -> str:
    return os.environ.get("TE_FUSER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "te_fuser")


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_exact_fp8() -> bool:
    return _flag("TE_FUSER_EXACT_FP8")
