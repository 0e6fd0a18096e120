"""Reference delayed-scaling state update in plain torch: the numerics oracle.

After a delayed-scaling cast has written its tensor's amax, the quantizer's state
moves on (``L`` = history length, newest entry first). A call whose own amax is
inf or NaN (``not amax < inf``) is *skipped*; any other call is *recorded*:

    skipped:   history   = history                                        (unchanged, not shifted)
               scale     = the previous scale
               count     = count + 1
    recorded:  history   = [amax, history[0 : L-1]]
               a         = max(history) (NaN if any entry is NaN) | history[0]   ("max" | "most_recent")
               q         = fmax / a, then / 2**64 ... / 2**rest           (the margin; every division
                                                                           an IEEE fp32 one)
               q         = largest finite fp32 for +inf (lowest for -inf)
               scale     = q if 0 < a < inf else the previous scale      (amax 0, or an inf or NaN
                                                                           already in the history)
               count     = count
    both:      scale_inv = 1 / scale                                      (IEEE fp32 division)

So ``count`` is the number of calls whose own amax was inf or NaN, and such an
amax never enters the history: it cannot freeze a "max" window, and the next
finite amax continues exactly as if the skipped call had not happened. An inf or
NaN is in the history only when older state put it there (a checkpoint written
before this rule): it keeps the scale until it leaves the window and is not
counted again. An amax is an absolute value; a hand-made -inf is recorded.

The margin divides in steps of at most 2**64, each exact unless its result is
subnormal. Every result is a new tensor; the inputs are not written (FP8 tensors
keep the ``scale_inv`` they were cast with).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..formats import fp8_max
from .cast import FLT_MAX

__all__ = ["delayed_scale_update_reference", "delayed_scale_update_many_reference", "check_update_arguments",
           "stack_update_state", "padded_scales"]

AMAX_ALGOS = ("max", "most_recent")


def check_update_arguments(amax_history, amax, scale, nonfinite_count, margin, algo) -> None:
    """The arguments every backend's ``delayed_scale_update`` takes, each named when wrong."""
    kernel = "delayed_scale_update"
    tensors = {"amax_history": amax_history, "amax": amax, "scale": scale, "nonfinite_count": nonfinite_count}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        dtype = torch.int64 if name == "nonfinite_count" else torch.float32
        if t.dtype != dtype:
            raise ValueError(f"{kernel}: {name} must be {dtype}, got {t.dtype}")
        if t.device != amax_history.device:
            raise ValueError(f"{kernel}: {name} is on {t.device} but amax_history is on {amax_history.device}")
    if amax_history.dim() != 1 or amax_history.numel() == 0:
        raise ValueError(f"{kernel}: amax_history must be 1-D and not empty, got shape {tuple(amax_history.shape)}")
    for name in ("amax", "scale", "nonfinite_count"):
        if tensors[name].numel() != 1:
            raise ValueError(f"{kernel}: {name} must have one element, got shape {tuple(tensors[name].shape)}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"{kernel}: margin must be an integer >= 0, got {margin!r}")
    if algo not in AMAX_ALGOS:
        raise ValueError(f"{kernel}: algo must be one of {list(AMAX_ALGOS)}, got {algo!r}")


def divide_by_power_of_2(t: torch.Tensor, exponent: int) -> torch.Tensor:
    """``t / 2**exponent`` in fp32, in steps whose divisor fp32 holds exactly."""
    while exponent > 0:
        step = min(exponent, 64)
        t = t / float(2**step)
        exponent -= step
    return t


def guarded_scale(quotient: torch.Tensor, amax: torch.Tensor, prev_scale: torch.Tensor):
    """``(scale, amax is finite)``: ``quotient`` with inf capped at the largest finite
    fp32, or ``prev_scale`` where the 0-d ``amax`` is 0, negative, inf or NaN."""
    scale = torch.nan_to_num(quotient, nan=math.nan, posinf=FLT_MAX)  # inf -> largest finite fp32
    finite = amax < math.inf  # False for inf and NaN; one op, where torch.isfinite takes four
    usable = torch.logical_and(amax > 0, finite)  # amax 0, inf or NaN keep the previous scale
    return torch.where(usable, scale, prev_scale), finite


def delayed_scale_update_reference(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    scale: torch.Tensor,
    nonfinite_count: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state after recording ``amax`` (one-element fp32) into ``amax_history``
    ((L,) fp32, newest first), from the previous 0-d fp32 ``scale`` and 0-d int64
    ``nonfinite_count``: ``(history (L,), scale, scale_inv, nonfinite_count)``, new
    tensors (see the module docstring)."""
    if algo not in AMAX_ALGOS:
        raise ValueError(f"delayed_scale_update: algo must be one of {list(AMAX_ALGOS)}, got {algo!r}")
    recorded = amax.reshape(()) < math.inf  # False for inf and NaN: the call is skipped
    history = torch.where(recorded, torch.cat((amax.reshape(1), amax_history[:-1])), amax_history)
    history_amax = history.amax() if algo == "max" else history[0]
    quotient = divide_by_power_of_2(torch.div(fp8_max(fp8_dtype), history_amax), margin)  # IEEE fp32 division
    new_scale, _ = guarded_scale(quotient, history_amax, scale)
    new_scale = torch.where(recorded, new_scale, scale)  # a skipped call keeps the scale
    return history, new_scale, torch.reciprocal(new_scale), nonfinite_count + recorded.logical_not()


def delayed_scale_update_many_reference(
    amax_histories: Sequence[torch.Tensor],
    amaxes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    nonfinite_counts: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``delayed_scale_update`` of ``N`` quantizers that share a history length,
    FP8 format, margin and algorithm, in one pass over their stacked state: row
    ``i`` of ``(histories (N, L), scales (N,), scale_invs (N,), counts (N,))`` is
    what ``delayed_scale_update`` gives for the ``i``-th arguments, bit for bit.
    ``scales`` and ``scale_invs`` hold their elements 16 bytes apart (stride 4), so
    each row's scalar sits where a GEMM reads a scale: at a 16-byte aligned
    address. The same few ops whatever ``N``: what a step's deferred updates cost
    is then one batch, not one launch per cast."""
    history, amax, scale, count = stack_update_state(amax_histories, amaxes, scales, nonfinite_counts, algo, margin)
    recorded = amax < math.inf  # (N,): False for inf and NaN
    shifted = torch.cat((amax.unsqueeze(1), history[:, :-1]), dim=1)
    history = torch.where(recorded.unsqueeze(1), shifted, history)
    history_amax = history.amax(dim=1) if algo == "max" else history[:, 0]
    quotient = divide_by_power_of_2(torch.div(fp8_max(fp8_dtype), history_amax), margin)
    new_scale, _ = guarded_scale(quotient, history_amax, scale)
    scale_out, scale_inv_out = padded_scales(len(scale), scale.device)
    new_scale = torch.where(recorded, new_scale, scale, out=scale_out)
    return history, new_scale, torch.reciprocal(new_scale, out=scale_inv_out), count + recorded.logical_not()


def padded_scales(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 ``(n,)`` outputs (the scales and their reciprocals) whose elements
    lie 16 bytes apart (stride 4), each where a GEMM reads a scale: at a 16-byte
    aligned address (cuBLASLt copies a misaligned one first)."""
    padded = torch.empty(2, n, 4, dtype=torch.float32, device=device)
    return padded[0, :, 0], padded[1, :, 0]


def stack_update_state(amax_histories, amaxes, scales, nonfinite_counts, algo, margin):
    """The ``N`` quantizers' state as ``(histories (N, L), amaxes (N,), scales (N,),
    counts (N,))``, each argument named when it does not fit."""
    n = len(amax_histories)
    if not (n == len(amaxes) == len(scales) == len(nonfinite_counts)) or n == 0:
        raise ValueError(
            "delayed_scale_update_many: amax_histories, amaxes, scales and nonfinite_counts must be equally long "
            f"and not empty, got {n}, {len(amax_histories)}, {len(amaxes)}, {len(scales)}, {len(nonfinite_counts)}"
        )
    if algo not in AMAX_ALGOS:
        raise ValueError(f"delayed_scale_update_many: algo must be one of {list(AMAX_ALGOS)}, got {algo!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"delayed_scale_update_many: margin must be an integer >= 0, got {margin!r}")
    try:
        history = torch.stack(list(amax_histories))  # (N, L)
        amax = torch.cat(list(amaxes))  # (1,) each: (N,)
        scale = torch.stack(list(scales))  # 0-d each: (N,)
        count = torch.stack(list(nonfinite_counts))
        if amax.shape != (n,) or scale.shape != (n,) or count.shape != (n,):  # other one-element shapes
            amax = torch.cat([a.reshape(1) for a in amaxes])
            scale = torch.stack([s.reshape(()) for s in scales])
            count = torch.stack([c.reshape(()) for c in nonfinite_counts])
    except RuntimeError as err:
        raise ValueError(f"delayed_scale_update_many: the quantizers' states do not stack ({err})") from None
    if history.dim() != 2 or history.shape[1] == 0 or history.dtype != torch.float32 or amax.dtype != torch.float32 \
            or scale.dtype != torch.float32 or count.dtype != torch.int64:
        raise ValueError(
            "delayed_scale_update_many: needs 1-D fp32 histories of one length, one-element fp32 amaxes and scales "
            f"and int64 counts, got histories {tuple(history.shape)} {history.dtype}, amaxes {amax.dtype}, "
            f"scales {scale.dtype}, counts {count.dtype}"
        )
    return history, amax, scale, count
