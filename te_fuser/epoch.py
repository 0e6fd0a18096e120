"""One counter of the changes that may make a published plan stale.

Bumped when an op installs quantizers, when a Parameter or a module hook of an op
is registered or removed, and when the kernel backend in force changes
(``te.set_backend``, ``te.autocast(backend=...)``). A plan remembers the value it
was last found valid at; the fuser's compiled guard compares that one integer on
every call, and only a changed value sends a call to the Python path, which then
checks what the counter stands for. A quantizer's kept prepared casts
(``Quantizer._caster``) look the backend's choice up again only when it moved, so
every change of what a kernel name resolves to bumps it (``set_auto_entry`` too).
"""

from __future__ import annotations

__all__ = ["CHANGES", "APPLIED", "bump"]

CHANGES = [0]
# Bumped by every te.apply_recipe: keys that cache work per recipe (CUDA graphs) include it.
APPLIED = [0]


def bump() -> None:
    CHANGES[0] += 1
