"""The CUDA backward of ``Bias -> activation``: ``dact_dbias`` for the unary kinds
(gelu, relu, silu, qgelu, srelu) as one C++ call that checks the operands, allocates
dx and the bias gradient and launches ``activation_kernels.cu`` and the sum of its
tiles' partial rows.

Same name, signature and results as the reference
(:func:`te_fuser.kernels.reference.dact_dbias_reference`) within the activation
tolerances: the derivative in fp32 as the reference writes it, dx rounded once, the
bias gradient the fp32 sum of that rounded dx over the rows (tile by tile in order,
then the tiles in order: the same bits on every run). The gated and parametrized
kinds, a dy of another dtype than x and another output dtype go to the Triton kernel,
which takes them all. ``dact_dbias.lean`` is the call the activation ops make first:
the same result, or None for operands it does not take as they are.
"""

from __future__ import annotations

import torch

from ..formats import ACTIVATION_CODES, activation_params
from ._build import extension, stream_of_index
from .cast import HP_CODES, check_cuda_tensor, current_device_index, on_device

__all__ = ["dact_dbias", "dact_dbias_unsupported_reason"]

# The kinds the CUDA kernel computes, by their code (formats.ACTIVATION_CODES)
UNARY_CODES = {kind: ACTIVATION_CODES[kind] for kind in ("gelu", "relu", "silu", "qgelu", "srelu")}


def dact_dbias_unsupported_reason(dy: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why :func:`dact_dbias` would not run these operands (None: it runs, or hands
    the kinds and dtypes it does not compute to the Triton kernel itself)."""
    if not isinstance(x, torch.Tensor) or not isinstance(dy, torch.Tensor):
        return None  # the checks name the argument
    if x.dtype not in HP_CODES or dy.dtype not in HP_CODES:
        return f"the cuda dact_dbias kernel takes bf16, fp16 or fp32, got dy {dy.dtype} and x {x.dtype}"
    if not x.is_cuda:
        return f"the cuda dact_dbias kernel needs CUDA tensors, got a {x.device.type} tensor"
    return None


def _triton(dy, x, kind, out_dtype, params, amax_out):
    from ..triton.activation import dact_dbias as triton_dact_dbias  # here: importing this backend loads no triton

    return triton_dact_dbias(dy, x, kind, out_dtype, params, amax_out)


def dact_dbias(dy: torch.Tensor, x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
               params: tuple | None = None, amax_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dbias)`` as :func:`dact_dbias_reference`: dx of x's shape rounded to
    ``out_dtype`` (default x's dtype), dbias the fp32 sums of the rounded dx; with
    ``amax_out``, the Triton kernel's, which reduces dx's amax as it writes it."""
    code = UNARY_CODES.get(kind)
    if (code is None or activation_params(kind, params) or dy.dtype is not x.dtype
            or (out_dtype is not None and out_dtype is not x.dtype) or amax_out is not None):
        return _triton(dy, x, kind, out_dtype, params, amax_out)  # its checks name what is wrong
    for name, t in (("dy", dy), ("x", x)):
        check_cuda_tensor(t, "dact_dbias", name)
    if x.dim() == 0:
        raise ValueError("dact_dbias: x must have at least one dimension, got a 0-d tensor")
    if dy.shape != x.shape:
        raise ValueError(f"dact_dbias: dy must have shape {tuple(x.shape)} for x of shape {tuple(x.shape)} and "
                         f"kind {kind!r}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"dact_dbias: dy is on {dy.device} but x is on {x.device}")
    with on_device(x.device):
        index = current_device_index()
        out = extension().dact_dbias_lean(dy.contiguous(), x.contiguous(), code, index, stream_of_index(index))
    if out is None:  # every operand checked above: more row tiles than one launch takes
        raise ValueError(f"dact_dbias: x of shape {tuple(x.shape)} holds more rows than one launch takes")
    return out


def _lean_dact_dbias(dy: torch.Tensor, x: torch.Tensor, kind: str, out_dtype: torch.dtype | None = None,
                     params: tuple | None = None, amax_out: torch.Tensor | None = None):
    """:func:`dact_dbias` with its checks in the extension: the same result, or None
    for operands it does not take as they are (then the checked call decides)."""
    code = UNARY_CODES.get(kind)
    if code is None or params or (out_dtype is not None and out_dtype is not x.dtype) or amax_out is not None:
        return None
    index = current_device_index()
    return extension().dact_dbias_lean(dy, x, code, index, stream_of_index(index))


dact_dbias.lean = _lean_dact_dbias
