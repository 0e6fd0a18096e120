"""Launcher of the CUDA delayed-scaling state update: check, then one C++ call
that allocates the new state and launches one block (``scaling_kernels.cu``).

Same name, signature and results as the reference
(:func:`te_fuser.kernels.reference.delayed_scale_update_reference`), bit for bit.
"""

from __future__ import annotations

import torch

from ..formats import fp8_max
from ..reference.scaling import AMAX_ALGOS, check_update_arguments
from ._build import extension, raw_stream
from .cast import on_device

__all__ = ["delayed_scale_update"]

_MARGIN_STEPS = 6  # after 6 divisions by 2**64 any fp32 is 0, inf or NaN: more change nothing


def delayed_scale_update(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
    nonfinite_count: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(history (L,), scale, scale_inv, nonfinite_count)`` after recording ``amax``
    into ``amax_history``, as new tensors; see the reference."""
    try:  # the hot path: one test of what every call passes; the details only on failure
        device = amax_history.device
        fits = (
            amax_history.is_cuda and amax.dtype == torch.float32 and scale.dtype == torch.float32
            and amax_history.dtype == torch.float32 and nonfinite_count.dtype == torch.int64
            and amax.device == device and scale.device == device and nonfinite_count.device == device
            and amax_history.dim() == 1 and amax_history.numel() > 0 and amax.numel() == 1
            and scale.numel() == 1 and nonfinite_count.numel() == 1 and type(margin) is int and margin >= 0
            and algo in AMAX_ALGOS
        )  # fmt: skip
    except AttributeError:  # not a tensor
        fits = False
    if not fits:
        check_update_arguments(amax_history, amax, scale, nonfinite_count, margin, algo)
        if not amax_history.is_cuda:
            raise RuntimeError(f"delayed_scale_update: the cuda backend needs CUDA tensors, got {device}")
    if not amax_history.is_contiguous():
        amax_history = amax_history.contiguous()
    steps, rest = divmod(margin, 64)
    with on_device(device):
        return extension().delayed_scale_update(
            amax_history, amax, scale, nonfinite_count, min(steps, _MARGIN_STEPS), float(2**rest),
            fp8_max(fp8_dtype), algo == "max", raw_stream(device))
