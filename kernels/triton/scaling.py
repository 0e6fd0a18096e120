"""The delayed-scaling state update, one Triton program per quantizer.

The rules are those of :mod:`te_fuser.kernels.reference.scaling`. A program
walks one quantizer's amax history in blocks (``delayed_scale_update``: one
program; ``delayed_scale_update_many``: one per row of the stacked states): it writes the new history and, for
``algo="max"``, reduces its maximum (NaN when any entry is NaN, as ``torch.amax``);
then it writes the next scale, its reciprocal and the non-finite count. The new
history is the old one read at an offset of one (slot 0 = this call's amax) when
the amax is recorded, of zero (a copy) when an inf or NaN amax skips the call: one
select on the offset, no branch on data. One launch instead of about a dozen tiny
torch ops per delayed-scaling cast.

Every division is ``tl.math.div_rn`` (IEEE round to nearest, interpreted and
compiled alike; a plain fp32 ``/`` may compile to an approximate division), so
the state equals the reference's bit for bit. The margin divides in the
reference's steps of 2**64 and a remainder; after :data:`_MARGIN_STEPS` such
steps any fp32 value is 0, inf or NaN, so more steps change nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..reference.scaling import AMAX_ALGOS, check_update_arguments, padded_scales, stack_update_state
from ._launch import launch
from ._common import fp8_format, next_power_of_2

__all__ = ["delayed_scale_update", "delayed_scale_update_many"]

_MAX_BLOCK = 1024
_MARGIN_STEPS = 6  # a finite fp32 is below 2**128: 2**128 / 2**(64 * 5) rounds to 0


@triton.jit
def _delayed_scale_update_kernel(history_ptr, amax_ptr, scale_ptr, count_ptr, new_history_ptr, new_scale_ptr,
                                 new_scale_inv_ptr, new_count_ptr, L, new_scale_stride, margin_steps, margin_rest,
                                 FMAX: tl.constexpr, ALGO_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # the quantizer: row of the stacked states (0 for one)
    history_ptr += row * L
    new_history_ptr += row * L
    amax_ptr += row
    scale_ptr += row
    count_ptr += row
    new_scale_ptr += row * new_scale_stride  # the new scales 16 bytes apart (stride 4) in a batch
    new_scale_inv_ptr += row * new_scale_stride
    new_count_ptr += row
    amax = tl.load(amax_ptr)
    recorded = amax < float("inf")  # False for inf and NaN: the call is skipped
    shift = tl.where(recorded, 1, 0)  # recorded: the history moves up one slot; skipped: a copy
    running = tl.full([BLOCK], float("-inf"), tl.float32)
    nan_seen = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, L, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < L
        older = tl.load(history_ptr + tl.maximum(offs - shift, 0), mask=inside & (offs >= shift), other=0.0)
        entry = tl.where(offs < shift, amax, older)  # this amax in slot 0 only when recorded
        tl.store(new_history_ptr + offs, entry, mask=inside)
        if ALGO_MAX:
            running = tl.maximum(running, tl.where(inside, entry, float("-inf")))
            nan_seen = tl.maximum(nan_seen, (entry != entry).to(tl.int32))
    if ALGO_MAX:
        history_amax = tl.where(tl.max(nan_seen, axis=0) > 0, float("nan"), tl.max(running, axis=0))
    else:
        history_amax = amax
    quotient = tl.math.div_rn(tl.full([], FMAX, tl.float32), history_amax)
    for _ in range(margin_steps):
        quotient = tl.math.div_rn(quotient, tl.full([], 18446744073709551616.0, tl.float32))  # 2**64
    quotient = tl.where(margin_rest == 1.0, quotient, tl.math.div_rn(quotient, margin_rest))
    quotient = tl.where(quotient == float("inf"), 3.4028234663852886e38, quotient)  # the largest finite fp32
    quotient = tl.where(quotient == float("-inf"), -3.4028234663852886e38, quotient)
    # a skipped call, a history amax of 0, or an inf or NaN already in the history keep the previous scale
    usable = recorded & (history_amax > 0.0) & (history_amax < float("inf"))
    scale = tl.where(usable, quotient, tl.load(scale_ptr))
    tl.store(new_scale_ptr, scale)
    tl.store(new_scale_inv_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale))
    tl.store(new_count_ptr, tl.load(count_ptr) + tl.where(recorded, 0, 1).to(tl.int64))  # counts skipped calls


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
    (one-element fp32) into ``amax_history`` ((L,) fp32, newest first), as new
    tensors; see :func:`~te_fuser.kernels.reference.delayed_scale_update_reference`."""
    try:  # the hot path: one test of what every call passes; the details only on failure
        device = amax_history.device  # cuda, or cpu under the interpreter (the backend resolves no other)
        fits = (
            amax.dtype == torch.float32 and scale.dtype == torch.float32 and amax_history.dtype == torch.float32
            and nonfinite_count.dtype == torch.int64 and amax.device == device and scale.device == device
            and nonfinite_count.device == device and amax_history.dim() == 1 and amax_history.numel() > 0
            and amax.numel() == 1 and scale.numel() == 1 and nonfinite_count.numel() == 1
            and type(margin) is int and margin >= 0 and algo in AMAX_ALGOS
        )  # fmt: skip
    except AttributeError:  # not a tensor
        fits = False
    if not fits:
        check_update_arguments(amax_history, amax, scale, nonfinite_count, margin, algo)
    if not amax_history.is_contiguous():
        amax_history = amax_history.contiguous()
    length = amax_history.numel()
    history = torch.empty(length, dtype=torch.float32, device=device)
    new_scale = torch.empty((), dtype=torch.float32, device=device)
    new_scale_inv = torch.empty((), dtype=torch.float32, device=device)
    count = torch.empty((), dtype=torch.int64, device=device)
    _launch(1, amax_history, amax, scale, nonfinite_count, history, new_scale, new_scale_inv, count, length, 1,
            fp8_dtype, margin, algo)
    return history, new_scale, new_scale_inv, count


def _launch(rows, history, amax, scale, count, new_history, new_scale, new_scale_inv, new_count, length,
            new_scale_stride, fp8_dtype, margin, algo) -> None:
    steps, rest = divmod(margin, 64)
    launch(_delayed_scale_update_kernel, (rows,),
        history, amax, scale, count, new_history, new_scale, new_scale_inv, new_count, length, new_scale_stride,
        min(steps, _MARGIN_STEPS), float(2**rest), FMAX=fp8_format(fp8_dtype)[0], ALGO_MAX=algo == "max",
        BLOCK=max(32, min(next_power_of_2(length), _MAX_BLOCK)), num_warps=4,
    )  # fmt: skip


def delayed_scale_update_many(
    amax_histories: Sequence[torch.Tensor],
    amaxes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    nonfinite_counts: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: int = 0,
    algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The updates of ``N`` quantizers of one configuration: the states stacked,
    then one launch of one program per quantizer; ``(histories (N, L), scales (N,),
    scale_invs (N,), counts (N,))``, see
    :func:`~te_fuser.kernels.reference.delayed_scale_update_many_reference`."""
    history, amax, scale, count = stack_update_state(amax_histories, amaxes, scales, nonfinite_counts, algo, margin)
    n, length = history.shape
    new_history, new_count = torch.empty_like(history), torch.empty_like(count)
    new_scale, new_scale_inv = padded_scales(n, history.device)
    _launch(n, history, amax, scale, count, new_history, new_scale, new_scale_inv, new_count, length, 4, fp8_dtype,
            margin, algo)
    return new_history, new_scale, new_scale_inv, new_count
