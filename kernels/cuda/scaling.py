"""Launchers of the CUDA delayed-scaling state update: check, then one C++ call
that allocates the new state and launches one block per quantizer
(``scaling_kernels.cu``).

Same names, signatures and results as the reference
(:func:`te_fuser.kernels.reference.delayed_scale_update_reference` and
``delayed_scale_update_many_reference``), bit for bit. The batched update reads
each quantizer's tensors where they are (their addresses ride in the launch's
parameters), so it stacks nothing first: one quantizer costs what the single
update's kernel costs, and a batch of any size one launch per 32 quantizers.
(A flush still updates fewer than ``BATCH_FROM`` alike quantizers one by one: for
two or three, the single update's one allocation costs the host less than the
batch's stacked outputs and their views, run 105.)
"""

from __future__ import annotations

import torch

from ..formats import fp8_max
from ..reference.scaling import AMAX_ALGOS, check_update_arguments, stack_update_state
from ._build import extension, raw_stream
from .cast import MARGIN_STEPS, on_device

__all__ = ["delayed_scale_update", "delayed_scale_update_many"]



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
            amax_history, amax, scale, nonfinite_count, min(steps, MARGIN_STEPS), float(2**rest),
            fp8_max(fp8_dtype), algo == "max", raw_stream(device))


def delayed_scale_update_many(
    amax_histories,
    amaxes,
    scales,
    nonfinite_counts,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The updates of ``N`` quantizers of one configuration in one launch per 32:
    ``(histories (N, L), scales (N,), scale_invs (N,), counts (N,))``, new tensors;
    see :func:`~te_fuser.kernels.reference.delayed_scale_update_many_reference`. The
    C++ entry checks every tensor; what it refuses (or a history that is not
    contiguous) goes through the reference's checks, which name the argument."""
    if (type(margin) is not int or margin < 0 or algo not in AMAX_ALGOS or not amax_histories
            or not getattr(amax_histories[0], "is_cuda", False)):
        _checked(amax_histories, amaxes, scales, nonfinite_counts, algo, margin)  # raises, naming what
    steps, rest = divmod(margin, 64)
    config = (min(steps, MARGIN_STEPS), float(2**rest), fp8_max(fp8_dtype), algo == "max")
    try:
        return _many(amax_histories, amaxes, scales, nonfinite_counts, *config)
    except (ValueError, TypeError):
        pass
    _checked(amax_histories, amaxes, scales, nonfinite_counts, algo, margin)
    # what stacks and still did not fit: histories that are not contiguous, scalars of another one-element shape
    return _many([h.contiguous() for h in amax_histories], [a.reshape(1) for a in amaxes],
                 [x.reshape(()) for x in scales], [c.reshape(()) for c in nonfinite_counts], *config)


def _checked(amax_histories, amaxes, scales, nonfinite_counts, algo, margin) -> None:
    """The reference's checks of the arguments (a ValueError naming what does not
    fit), then a RuntimeError for tensors that are not on a GPU."""
    history, _, _, _ = stack_update_state(amax_histories, amaxes, scales, nonfinite_counts, algo, margin)
    if not history.is_cuda:
        raise RuntimeError(f"delayed_scale_update_many: the cuda backend needs CUDA tensors, got {history.device}")


def _many(histories, amaxes, scales, counts, steps: int, rest: float, fmax: float, algo_max: bool):
    device = histories[0].device
    with on_device(device):
        return extension().delayed_scale_update_many(histories, amaxes, scales, counts, steps, rest, fmax, algo_max,
                                                     raw_stream(device))
