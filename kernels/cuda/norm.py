"""Launchers of the CUDA LayerNorm forward and backward: check, then one C++ call
that allocates the outputs and launches (``norm_kernels.cu``; the backward's two
kernels and the sum of its partial parameter gradients).

Same names, signatures and results as the reference
(:func:`te_fuser.kernels.reference.layer_norm_reference`, ``layer_norm_grad_reference``)
within the norm tolerances: the row sums add in another (fixed) order. What a
C++ launch saves over Triton's launcher is host time (15 against 43 µs a forward
on the H200's host, ``benchmarks/RESULTS.md`` run 76), which a model that waits
on its host gets back.
"""

from __future__ import annotations

import torch

from ..reference.norm import check_grad_add, check_layer_norm
from ._build import extension, raw_stream, stream_of_index
from .cast import HP_CODES, aligned_contiguous, check_cuda_tensor, current_device_index, on_device

__all__ = ["layer_norm", "layer_norm_grad"]


def _fp32_param(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype is torch.float32 else t.float()
    return t if t.is_contiguous() else t.contiguous()


def _check_operands(kernel: str, x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in (("x", x), ("weight", weight), *others.items()):
        check_cuda_tensor(t, kernel, name)
        if t.dtype not in HP_CODES:
            raise TypeError(f"{kernel}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{kernel}: {name} is on {t.device} but x is on {x.device}")


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y (rows, N) in out_dtype (default x.dtype), mean (rows,), rstd (rows,))``;
    see the reference."""
    check_layer_norm(x, weight, "layer_norm")
    _check_operands("layer_norm", x, weight, bias=bias)
    if bias.shape != weight.shape:
        raise ValueError(f"layer_norm: bias must have shape {tuple(weight.shape)}, got {tuple(bias.shape)}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in HP_CODES:
        raise ValueError(f"layer_norm: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    device = x.device
    with on_device(device):
        return extension().layer_norm(aligned_contiguous(x), _fp32_param(weight), _fp32_param(bias), float(eps),
                                      out_dtype, raw_stream(device))


def layer_norm_grad(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    grad_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx (rows, N) in x.dtype, dweight (N,), dbias (N,))`` from the forward's
    ``mean`` and ``rstd``, ``grad_add`` added to dx in fp32; see the reference."""
    check_layer_norm(x, weight, "layer_norm_grad", mean, rstd)
    check_grad_add(grad_add, x, "layer_norm_grad")
    added = {} if grad_add is None else {"grad_add": grad_add}
    _check_operands("layer_norm_grad", x, weight, dy=dy, mean=mean, rstd=rstd, **added)
    if dy.shape != x.shape:
        raise ValueError(f"layer_norm_grad: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if grad_add is not None:
        grad_add = aligned_contiguous(grad_add)
    device = x.device
    with on_device(device):
        return extension().layer_norm_grad(aligned_contiguous(dy), aligned_contiguous(x), _fp32_param(weight),
                                           mean.contiguous(), rstd.contiguous(), grad_add, raw_stream(device))


def _lean_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None):
    """:func:`layer_norm` with its operands checked in C++ (``layer_norm_lean`` in
    ``binding.cpp``): the same result, or None for a case it does not take as it is
    (x not a contiguous, 16-byte aligned CUDA tensor of two or more dims and a
    high-precision dtype on the current device, parameters not aligned fp32 (N,)
    there), which then goes through :func:`layer_norm` and its checks. x of more
    dims is normalized over its last as its 2-D flattening, y of x's shape. The
    norm ops call it first (``layer_norm.lean``)."""
    index = current_device_index()
    return extension().layer_norm_lean(x, weight, bias, float(eps), out_dtype, index, stream_of_index(index))


def _lean_layer_norm_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                          rstd: torch.Tensor, grad_add: torch.Tensor | None = None):
    """:func:`layer_norm_grad` with its operands checked in C++, or None (see
    :func:`_lean_layer_norm`): dy and grad_add of x's shape (dx then of it too), the
    statistics fp32 (rows,), everything contiguous on the current device."""
    index = current_device_index()
    return extension().layer_norm_grad_lean(dy, x, weight, mean, rstd, grad_add, index, stream_of_index(index))


layer_norm.lean = _lean_layer_norm
layer_norm_grad.lean = _lean_layer_norm_grad
