"""The CUDA rotary position embedding: one C++ call that checks the operands,
allocates the output (or writes in place) and launches ``rotary_kernels.cu``.

Same name, signature and result as the reference
(:func:`te_fuser.kernels.reference.rotary_reference`), bit for bit (a zero result
may carry the other sign, as the Triton kernel's): each product and the sum round
in fp32, with no fused multiply-add. What it saves over the Triton launcher is host
time: the operands are checked in C++, where the Triton path checks them in Python
and then binds some ten launch arguments.

``rotary.lean`` is the call the rotary op makes first: the same result, or None
for operands it does not take as they are (see ``rotary_lean`` in
``binding.cpp``), which then go through :func:`rotary` and its checks.
"""

from __future__ import annotations

import torch

from ..reference.rotary import check_rotary
from ._build import extension, stream_of_index
from .cast import HP_CODES, current_device_index, on_device

__all__ = ["rotary", "rotary_unsupported_reason"]


def rotary_unsupported_reason(x: torch.Tensor, cos: torch.Tensor) -> str | None:
    """Why :func:`rotary` would not run ``x`` (None: it runs)."""
    if not isinstance(x, torch.Tensor):
        return None  # the checks name the argument
    if x.dtype not in HP_CODES:
        return f"the cuda rotary kernel takes bf16, fp16 or fp32, not {x.dtype}"
    if not x.is_cuda:
        return f"the cuda rotary kernel needs a CUDA tensor, got a {x.device.type} tensor"
    return None


def rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place: bool = False):
    """RoPE as :func:`rotary_reference`, in one pass over ``x`` (over its rotated heads
    alone, written back into ``x``, when ``in_place``)."""
    check_rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place)
    reason = rotary_unsupported_reason(x, cos)
    if reason is not None or out_dtype not in HP_CODES:
        raise ValueError(f"rotary: {reason or f'out_dtype {out_dtype} is not bf16, fp16 or fp32'}")
    device = x.device
    with on_device(device):
        index = current_device_index()
        y = extension().rotary_lean(x if in_place else x.contiguous(), cos.contiguous(), sin.contiguous(),
                                    rotated_heads, inverse, out_dtype, in_place, index, stream_of_index(index))
    if y is None:  # every operand checked above: a size past what one launch's grid holds
        raise ValueError(f"rotary: x of shape {tuple(x.shape)} holds more token rows than one launch takes")
    return y


def _lean_rotary(x, cos, sin, rotated_heads, inverse, out_dtype, in_place: bool = False):
    """:func:`rotary` with its checks in the extension: the same result, or None for
    operands the extension does not take as they are."""
    index = current_device_index()
    return extension().rotary_lean(x, cos, sin, rotated_heads, inverse, out_dtype, in_place, index,
                                   stream_of_index(index))


rotary.lean = _lean_rotary
