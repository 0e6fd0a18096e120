"""The ops' saved state handed to autograd, for te.checkpoint.

An op keeps what its backward needs in its context's ``saved`` dict: tensors,
FP8 copies (``QuantizedTensor`` and its ``ScaledOperand``s), shapes, flags. The
fuser's autograd function keeps those contexts on its node, out of autograd's
sight. Inside a checkpointed region autograd must see every tensor, to drop it
after the forward and have the recomputation rebuild it: :func:`stow_saved`
takes each tensor out of the contexts (into ``save_for_backward``), leaving its
index in its place, and :func:`unstow_saved` puts back the tensors autograd hands
the backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.operand import ScaledOperand
from ..quantization.tensor import QuantizedTensor

__all__ = ["stow_saved", "unstow_saved"]


class _Stowed:
    """A tensor of an op's saved state handed to autograd: its index among the
    function's saved tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _StowedOperand(NamedTuple):
    """A ``ScaledOperand`` whose tensors were handed to autograd (it checks its
    fields, which an index is not)."""

    data: object
    scale_inv: object
    scaling: str


def _stow(value, tensors: list):
    """``value`` with each tensor in it, also inside tuples, lists, dicts, quantized
    tensors and their operands, appended to ``tensors`` and replaced by its index;
    other objects stay as they are."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Stowed(len(tensors) - 1)
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_stow(v, tensors) for v in value)
    if kind is dict:
        return {k: _stow(v, tensors) for k, v in value.items()}
    if kind is QuantizedTensor:
        return QuantizedTensor.of_cast(_stow(value.rowwise, tensors), _stow(value.columnwise, tensors), value.shape,
                                       value.dtype)
    if kind is ScaledOperand:
        return _StowedOperand(_stow(value.data, tensors), _stow(value.scale_inv, tensors), value.scaling)
    return value


def _unstow(value, tensors: tuple):
    """:func:`_stow` undone with the tensors autograd hands back."""
    kind = type(value)
    if kind is _Stowed:
        return tensors[value.index]
    if kind is tuple or kind is list:
        return kind(_unstow(v, tensors) for v in value)
    if kind is dict:
        return {k: _unstow(v, tensors) for k, v in value.items()}
    if kind is QuantizedTensor:
        return QuantizedTensor.of_cast(_unstow(value.rowwise, tensors), _unstow(value.columnwise, tensors),
                                       value.shape, value.dtype)
    if kind is _StowedOperand:
        return ScaledOperand(_unstow(value.data, tensors), _unstow(value.scale_inv, tensors), value.scaling)
    return value


def stow_saved(ctxs: list) -> list:
    """Every tensor the ops of ``ctxs`` saved, in order, each replaced in its context
    by its index: what the fuser's function hands ``save_for_backward``."""
    tensors: list = []
    for ctx in ctxs:
        saved = ctx.saved
        for key, value in saved.items():
            saved[key] = _stow(value, tensors)
    return tensors


def unstow_saved(ctxs: list, tensors: tuple) -> None:
    """Put the tensors autograd hands back (``saved_tensors``, the token left out)
    where :func:`stow_saved` took them from; tensors already in place stay."""
    for ctx in ctxs:
        ctx.saved = {key: _unstow(value, tensors) for key, value in ctx.saved.items()}
