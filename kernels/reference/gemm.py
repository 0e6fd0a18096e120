"""Reference FP8 GEMMs: dequantize, then an fp32 matmul.

``out = a @ b.T (+ bias)`` with both operands quantized along their last
dimension (see :mod:`te_fuser.kernels.operand`). Any mix of scalings works here;
the fast backends support the pairs a recipe produces (tensor x tensor,
row x row, block_1x128 x block_128x128, block_1x128 x block_1x128, mx_32 x mx_32).
A plain high-precision tensor may stand in for either operand.
"""

from __future__ import annotations

import torch

from ..formats import EPILOGUE_ACTIVATIONS
from ..operand import ScaledOperand
from .activation import activation_reference
from .cast import dequantize_reference, quantize_tensorwise_reference

__all__ = ["gemm_reference", "gemm_fp8_out_reference"]


def _as_fp32(op: ScaledOperand | torch.Tensor) -> torch.Tensor:
    if isinstance(op, ScaledOperand):
        return dequantize_reference(op, torch.float32)
    return op.float()


def check_epilogue_activation(activation: str | None) -> None:
    """The check every backend's GEMM runs: its epilogue applies only
    :data:`EPILOGUE_ACTIVATIONS` (the fusion rules run the other kinds as ops)."""
    if activation is not None and activation not in EPILOGUE_ACTIVATIONS:
        raise ValueError(f"gemm: the epilogue applies {', '.join(EPILOGUE_ACTIVATIONS)}, not {activation!r}")


def gemm_reference(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``activation(a (P, R) @ b (Q, R).T + bias (Q,)) + residual (P, Q')`` in fp32.

    The epilogue of a fused Linear: bias, then the activation (``swiglu`` halves
    the columns), then the residual add; the result is cast to ``out_dtype``.
    ``fast_accum`` (a tensor-core accumulation mode of the fast backends) does not
    apply here: the reference always accumulates in fp32.
    """
    del fast_accum
    check_epilogue_activation(activation)
    a32, b32 = _as_fp32(a), _as_fp32(b)
    if a32.shape[1] != b32.shape[1]:
        raise ValueError(f"gemm: reduction dims differ: a is {tuple(a32.shape)}, b is {tuple(b32.shape)}")
    out = a32 @ b32.t()
    if bias is not None:
        out = out + bias.float()
    if activation is not None:
        out = activation_reference(out, activation)
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)


def gemm_fp8_out_reference(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    out_scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    round_to: torch.dtype | None = None,
    fast_accum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM result (rounded to ``round_to`` when given, else fp32) cast to
    ``fp8_dtype`` with ``out_scale`` as the delayed-scaling cast does; returns
    ``(out (P, Q'), amax)`` (``amax_out`` filled when given)."""
    out = gemm_reference(a, b, round_to or torch.float32, bias, activation, residual, fast_accum)
    data, _, amax = quantize_tensorwise_reference(out, out_scale, fp8_dtype, amax_out=amax_out)
    return data, amax
