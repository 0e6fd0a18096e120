"""The one place te_fuser reads environment variables.

Each variable is read when the object that needs it is *constructed* (never at
import, never on the hot path) and its value is stored in an explicit field, so
the recipe string shows it.

| variable | read by | meaning |
|---|---|---|
| ``TE_FUSER_FP8_BLOCK_SCALING_FP32_SCALES`` | ``Float8BlockScaling()`` with ``power_2_scales`` left unset | ``1``: fp32 block scales; otherwise power-of-2 |
| ``TE_FUSER_BACKEND`` | the first kernel dispatch of the process | default backend (``reference``, ``triton``, ``cuda``, ``auto``) |
"""

from __future__ import annotations

import os

__all__ = ["block_scaling_power_2_scales_default", "backend_default"]


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
