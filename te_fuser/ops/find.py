"""Finding a model's fusers: the public way to reach them from any ``nn.Module`` tree.

An *owner* is a module that runs fusers: each ``Sequential`` (one fuser per group
of neighbouring ops), and each op or composite (``Linear``) that is not inside a
``Sequential`` (it runs through a fuser of its own when called). A ``Sequential``
nested in another runs itself, so it is an owner too.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from .fuser import OperationFuser
from .op import BasicOperation
from .sequential import Sequential

__all__ = ["fuser_owners", "owner_fusers", "fusers_of", "is_composite"]


def is_composite(module: nn.Module) -> bool:
    """Whether ``module`` is a composite of basic ops (``Linear``) with a fuser of its own."""
    ops = getattr(module, "basic_ops", None)
    return (isinstance(ops, list) and bool(ops) and all(isinstance(op, BasicOperation) for op in ops)
            and callable(getattr(module, "own_fuser", None)))


def fuser_owners(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(module path, owner)`` of every owner in ``model`` (see the module doc)."""
    inside: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, Sequential):
            for item in module:  # its ops and composites run through its fusers
                if isinstance(item, BasicOperation) or is_composite(item):
                    inside.update(id(m) for m in [item, *getattr(item, "basic_ops", [])])
            yield path, module
        elif isinstance(module, BasicOperation) or is_composite(module):
            inside.update(id(op) for op in getattr(module, "basic_ops", []))
            yield path, module


def owner_fusers(owner: nn.Module) -> list[OperationFuser]:
    """The fusers an owner runs (a standalone op's is made on first use)."""
    if isinstance(owner, Sequential):
        return [g for g in owner.groups() if isinstance(g, OperationFuser)]
    return [owner.own_fuser()]


def fusers_of(model: nn.Module) -> list[OperationFuser]:
    """Every fuser of ``model``, owner by owner in module order."""
    return [f for _, owner in fuser_owners(model) for f in owner_fusers(owner)]
