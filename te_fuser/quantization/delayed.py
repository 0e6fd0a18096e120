"""``DelayedScalingQuantizer``: per-tensor scales from a history of past amaxes.

Each call casts with the scale computed from the history *before* this tensor,
records this tensor's amax as the newest history entry, then computes the scale
for the next call:

    amax  = max(history) | history[0] | amax_compute_algo(history)
    scale = (fmax / amax) / 2**margin          (IEEE fp32 divisions; the margin 2**64 at a time)
          | scaling_factor_compute_algo(amax, scale, fmax, recipe)

Guards, applied on the device (no host sync):

- a tensor whose amax is inf or NaN is skipped: its amax is not recorded (the
  history is not shifted), the scale stays, and ``nonfinite_amax_count`` goes up
  by one; so the count is the number of such tensors, and the next finite amax
  continues as if the skipped tensor had not been seen;
- a history amax of 0 keeps the previous scale; so does an inf or NaN already in
  the history (only older state, such as a checkpoint, can hold one), uncounted;
- a quotient that overflows (tiny amax) gives the largest finite fp32.

With ``"max"`` or ``"most_recent"`` and no ``scaling_factor_compute_algo``, the
whole update (history, scale, scale_inv, count) is one backend kernel,
``delayed_scale_update`` (:mod:`te_fuser.kernels.reference.scaling` states its
rules); the cast writes its amax into a fresh one-element buffer that the kernel
reads. A callable algorithm runs the same steps as torch ops. Where the backend's
prepared cast can update in the same call (the cuda backend's
``cast_tensorwise_update``: the one-launch cast's block 0 runs the update once
its amax is reduced) and no group reduces the amax, the cast does: nothing waits,
and the state is the one the deferred update (``_record``) gives, bit for bit.

A fresh quantizer (new model, or delayed scaling entered from another recipe)
first *seeds* its scale from the amax of the first tensor it sees, so that tensor
is cast with a fitting scale instead of 1. A first tensor with an inf or NaN amax
leaves the scale 1 (skipped and counted as above) yet marks the quantizer seeded:
deciding otherwise would read the device. The next tensor is then cast with
scale 1, and its amax sets the scale from there on.

Like a BatchNorm's running statistics, the history moves in training only: while
ops run a forward in evaluation mode (``model.eval()``; the op fuser sets
:data:`EVALUATING` around it, FSDP2's FP8 all-gather from the module's mode), a
cast takes the scale as it stands and records nothing, and a fresh quantizer casts
with the scale its seeding would give (from the tensor's own amax) and stays
fresh. So a validation pass under the recipe leaves the training run it
interrupts bit for bit what it would have been. Calibration (:meth:`observe`)
records in either mode: that is what it is for.

Since the scale is known before the tensor is, the GEMM that produces the tensor
can cast it in its epilogue (:meth:`DelayedScalingQuantizer.epilogue_cast`, then
``adopt_epilogue_cast``: the same cast, amax and state update as a call); a fresh
quantizer declines that until it has seeded its scale.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import backend
from ..fp8 import FP8_MAX, short_name
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand, tensor_scaled
from ..kernels.reference.scaling import AMAX_ALGOS, divide_by_power_of_2, guarded_scale
from .amax_reduction import PENDING, default_group, flush_amax_reductions
from .base import EpilogueCast, Quantizer, max_over, shard_amax
from .current import generic_current_caster, generic_current_sums_caster
from .recompute import ACTIVE as CHECKPOINT_FRAMES
from .role import QuantizerRole
from .tensor import QuantizedTensor


__all__ = ["DelayedScalingQuantizer", "carry_states", "place_states"]


def _generic_tensorwise(fn, fp8_dtype: torch.dtype):
    """``cast(x, scale, rowwise, columnwise, round_bf16=False, sums_dtype=torch.float32)
    -> (data, data_t, sums or None, amax)``, amax(|x|) in a new (1,) fp32 tensor,
    through a tensor-scaled cast kernel without a ``prepare`` entry of its own
    (``round_bf16`` and ``sums_dtype``: the column-sums kernel's)."""

    def cast(x: torch.Tensor, scale: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
             sums_dtype: torch.dtype = torch.float32):
        amax = torch.empty(1, dtype=torch.float32, device=x.device)  # the cast writes (not accumulates) it
        extra = {"round_bf16": True} if round_bf16 else {}
        if sums_dtype is not torch.float32:
            extra["sums_dtype"] = sums_dtype
        data, data_t, _amax, *sums = fn(x, scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise, amax_out=amax,
                                        **extra)
        return data, data_t, (sums[0] if sums else None), amax

    return cast


_STATE_KEYS = ("scale", "scale_inv", "amax_history", "seeded", "nonfinite_amax_count")

# [True] while ops run a forward in evaluation mode: delayed-scaling casts then record
# nothing (see the module doc). Set by ``ops.fuser.run_forward`` and FSDP2's FP8
# all-gather; one list read per cast.
EVALUATING: list = [False]

# Alike quantizers waiting at a flush from which they update as one batch: fewer
# update one launch each, which on a GPU costs about what a batch's few torch ops
# and stacking cost for that many (a step of the GPT has about 50 a pass).
BATCH_FROM = 8


def _flushed_state(name: str) -> property:
    """The state tensor ``name``, stored as ``_name``, read and written after the
    quantizer's waiting amaxes are applied."""
    stored = f"_{name}"

    def read(self) -> torch.Tensor:
        self._flush()
        if self.__dict__.get("_shared") is not None:  # a holder gets tensors of this quantizer's own
            self._own_shared_tensors()
        return getattr(self, stored)

    def write(self, value: torch.Tensor) -> None:
        self._flush()
        setattr(self, stored, value)

    return property(read, write, doc=f"``{name}``, with every waiting update applied")


class DelayedScalingQuantizer(Quantizer):
    """Delayed scaling (see the module docstring).

    State (fp32 device tensors, moved to the input's device on first use):
    ``scale`` and ``scale_inv`` (0-d), ``amax_history`` (``amax_history_len``,),
    newest first; ``nonfinite_amax_count`` (0-d int64) counts the tensors whose
    amax was inf or NaN (skipped: not recorded, scale kept); ``seeded`` is False
    until a tensor was seen. ``amax_reduction_group``: a ``torch.distributed``
    group to take the maximum amax over its ranks before each scale update;
    ``amax_reduction.WORLD`` for the default process group whenever one is initialized with
    more than one rank (looked up at each cast, so a group initialized after the
    model was built counts); ``None`` for no reduction.
    """

    scaling = Scaling.TENSOR
    reads_through_bf16 = True
    # Where the backend's prepared cast can update the state in the same call (see
    # _cast_and_update): False leaves every update to the deferred path (tests of it).
    update_in_cast = True
    # Whether a fresh quantizer's first cast may be a current-scaling cast (see
    # _seeding_cast): False seeds with an amax pass first (tests of it).
    seed_in_cast = True

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        margin: int = 0,
        amax_history_len: int = 1024,
        amax_compute_algo: str | Callable = "max",
        scaling_factor_compute_algo: Callable | None = None,
        recipe: Any = None,
        role: QuantizerRole | None = None,
        *,
        device=None,
        rowwise: bool = True,
        columnwise: bool = False,
    ) -> None:
        super().__init__(fp8_dtype, role, rowwise=rowwise, columnwise=columnwise, device=device)
        self.margin = self._checked_int("margin", margin, 0)
        self.amax_history_len = self._checked_int("amax_history_len", amax_history_len, 1)
        if not callable(amax_compute_algo) and amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"DelayedScalingQuantizer.amax_compute_algo: must be one of {list(AMAX_ALGOS)} or a callable, "
                f"got {amax_compute_algo!r}"
            )
        if scaling_factor_compute_algo is not None and not callable(scaling_factor_compute_algo):
            raise TypeError(
                "DelayedScalingQuantizer.scaling_factor_compute_algo: must be a callable or None, "
                f"got {scaling_factor_compute_algo!r}"
            )
        self.amax_compute_algo = amax_compute_algo
        self.scaling_factor_compute_algo = scaling_factor_compute_algo
        self.recipe = recipe
        self.fmax = FP8_MAX[self.fp8_dtype]
        self._start_fresh()

    STATE_TENSORS = ("scale", "scale_inv", "amax_history", "nonfinite_amax_count")

    def _start_fresh(self, borrow_state: bool = False) -> None:
        """A new quantizer's (and a fresh copy's) state: unseeded, nothing waiting, no
        group or plan key yet. ``borrow_state`` (a fresh copy of a quantizer that
        holds a fresh state): keep that quantizer's state tensors for now, which
        ``place_states`` replaces by the device's, or by its own where it places
        none, so that a plan's hundred copies make no CPU tensors only to drop
        them. A borrowed tensor is never written: every update rebinds."""
        self.amax_reduction_group = None
        self.recipe_key: str | None = None  # the plan's recipe key, compared across the ranks it reduces over
        self._pending = 0  # its amaxes waiting in PENDING
        if borrow_state and self._holds_fresh_state():
            self._borrowed = self._fresh
        else:
            self._reset(self.device)

    def _borrows_state(self) -> bool:
        """Whether it still holds the fresh state tensors of the quantizer it was copied from."""
        borrowed = self.__dict__.get("_borrowed")
        return borrowed is not None and borrowed is self._fresh and self._holds_fresh_state()

    # The state as users and holders see it: any amax still waiting (see _record) is
    # applied first. The methods below read the stored tensors after their own _flush.
    scale = _flushed_state("scale")
    scale_inv = _flushed_state("scale_inv")
    amax_history = _flushed_state("amax_history")
    nonfinite_amax_count = _flushed_state("nonfinite_amax_count")

    def __getstate__(self) -> dict:
        """A copy or a pickle holds the state with every waiting amax applied (the
        waiting list names this object, not the copy)."""
        self._flush()
        return super().__getstate__()

    def _checked_int(self, name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"DelayedScalingQuantizer.{name}: must be an integer >= {minimum}, got {value!r}")
        return value

    def _reset(self, device: torch.device) -> None:
        self._flush()  # a waiting amax belongs to the state being replaced
        self._scale = torch.ones((), dtype=torch.float32, device=device)
        self._scale_inv = torch.ones((), dtype=torch.float32, device=device)
        self._amax_history = torch.zeros(self.amax_history_len, dtype=torch.float32, device=device)
        self._nonfinite_amax_count = torch.zeros((), dtype=torch.int64, device=device)
        self.seeded = False
        self._borrowed = None
        self._shared = None
        # The fresh state's own tensors: while the state is still these (nothing
        # rebound them, and _continue, the one writer in place, cleared this), it
        # holds a fresh state's values, which place_states makes without a copy.
        self._fresh = (self._scale, self._scale_inv, self._amax_history, self._nonfinite_amax_count)

    def _own_shared_tensors(self) -> None:
        """Replace each state tensor that is still one of the device's shared fresh
        ones (``place_states``) by a copy of its own, before anyone outside the
        quantizer holds it: a holder may write it in place (a CUDA graph's fixed
        copy of the state does), which a shared tensor must never see."""
        shared = self._shared
        self._shared = None
        own = tuple(t.clone() if any(t is u for u in shared) else t
                    for t in (self._scale, self._scale_inv, self._amax_history, self._nonfinite_amax_count))
        if self._fresh is shared:
            self._fresh = own
        self._scale, self._scale_inv, self._amax_history, self._nonfinite_amax_count = own

    def _holds_fresh_state(self) -> bool:
        fresh = getattr(self, "_fresh", None)  # None in a quantizer pickled before it was kept
        return (fresh is not None and not self.seeded and fresh[0] is self._scale and fresh[1] is self._scale_inv
                and fresh[2] is self._amax_history and fresh[3] is self._nonfinite_amax_count)

    def _move_state(self, device: torch.device) -> None:
        if self._scale.device != device:  # once, on first use on a device
            # host -> device copies need no wait; a device -> host copy must complete
            non_blocking = device.type == "cuda" and self._scale.device.type == "cpu"
            for name in self.STATE_TENSORS:
                setattr(self, f"_{name}", getattr(self, f"_{name}").to(device, non_blocking=non_blocking))

    # -- quantization ----------------------------------------------------------
    def cast(self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None):
        """:meth:`Quantizer.cast`; the ops' calls (both copies named, a plain tensor)
        skip the generic checks, with the same result."""
        if not self._lean(x, rowwise, columnwise):
            return super().cast(x, rowwise=rowwise, columnwise=columnwise)
        rowwise_op, columnwise_op, _ = (
            self._updating_cast(x, rowwise, columnwise, "quantize_tensorwise", False, torch.float32)
            or self._cast(self._flat(x), rowwise, columnwise, "quantize_tensorwise"))
        return QuantizedTensor.of_cast(rowwise_op, columnwise_op, x.shape, x.dtype)

    def _lean_column_sums(self, x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                          sums_dtype: torch.dtype = torch.float32):
        """The ops' column-sums casts, lean as :meth:`cast` (fp32 cast as bf16 rounded as the kernel reads it)."""
        kernel = "quantize_tensorwise_column_sums"
        rowwise_op, columnwise_op, sums = (
            self._updating_cast(x, rowwise, columnwise, kernel, round_bf16, sums_dtype)
            or self._cast(self._flat(x), rowwise, columnwise, kernel, round_bf16, sums_dtype))
        return QuantizedTensor.of_cast(rowwise_op, columnwise_op, x.shape,
                                       torch.bfloat16 if round_bf16 else x.dtype), sums

    def _updating_cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool, kernel: str, round_bf16: bool,
                       sums_dtype: torch.dtype):
        """The ops' common cast in a training step, x as it comes (two or more dims:
        the backend's entry flattens it): a seeded quantizer, nothing waiting, no
        checkpointed region, evaluation or reduction group, and a backend cast that
        updates the state in the same call (:meth:`_cast_and_update`, whose checks
        the entry makes: x and the state on the current device). ``(row-wise
        operand, column-wise operand, sums)`` with the new state bound, or None
        with nothing changed, for :meth:`_cast`'s general path. The same bits and
        state as that path: fewer calls on the host for the step's every cast."""
        frames = CHECKPOINT_FRAMES
        if self._pending or not self.seeded or frames[0] is not None or frames[1] is not None or EVALUATING[0]:
            return None
        scale_inv = self._scale_inv  # the scale this cast uses goes with its operands
        out = self._cast_and_update(self._caster(kernel, x.device, _generic_tensorwise), x, rowwise, columnwise,
                                    round_bf16, sums_dtype)
        if out is None:
            return None
        return (tensor_scaled(out[0], scale_inv) if rowwise else None,
                tensor_scaled(out[1], scale_inv) if columnwise else None, out[2])

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        rowwise_op, columnwise_op, _ = self._cast(x_hp, rowwise, columnwise, "quantize_tensorwise")
        return rowwise_op, columnwise_op

    def _quantize_with_column_sums(self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                                   sums_dtype: torch.dtype = torch.float32):
        """The one-pass cast also sums the columns (the same state update as a plain
        cast); ``round_bf16``: the kernel reads x rounded to bf16."""
        return self._cast(x_hp, rowwise, columnwise, "quantize_tensorwise_column_sums", round_bf16, sums_dtype)

    def _cast(self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, kernel: str, round_bf16: bool = False,
              sums_dtype: torch.dtype = torch.float32):
        """Cast with the current scale through ``kernel`` (returning the data, the
        transposed data, the amax and, for the column-sums kernel, the sums), then
        record the amax: (row-wise operand, column-wise operand, sums or None).
        ``round_bf16`` and ``sums_dtype`` (the column-sums kernel): the cast and its
        amax of x read as bf16, the sums returned as ``sums_dtype``."""
        device = x_hp.device
        self._flush()
        self._move_state(device)
        frames = CHECKPOINT_FRAMES
        if frames[1] is not None or EVALUATING[0]:  # a cast that records nothing
            scale, scale_inv = self._unrecorded_scale(
                lambda: self._seed_amax(x_hp, backend.resolve("quantize_tensorwise", device).fn, round_bf16))
            x_fp8, x_fp8_t, sums, _ = self._caster(kernel, device, _generic_tensorwise)(
                x_hp, scale, rowwise, columnwise, round_bf16, sums_dtype)
            return (tensor_scaled(x_fp8, scale_inv) if rowwise else None,
                    tensor_scaled(x_fp8_t, scale_inv) if columnwise else None, sums)
        seeded = self.seeded
        if not seeded and self.seed_in_cast and self.margin == 0 and self._kernel_update and self._group() is None:
            return self._seeding_cast(x_hp, rowwise, columnwise, kernel, round_bf16, sums_dtype)
        if not seeded:  # the first scale from the amax of what is cast
            self._seed(x_hp, backend.resolve("quantize_tensorwise", device).fn, round_bf16)
        if frames[0] is not None:  # a checkpointed region's forward: its recomputation casts alike
            frames[0].note(self, self._scale, self._scale_inv, seeded)
        cast = self._caster(kernel, device, _generic_tensorwise)
        scale_inv = self._scale_inv  # the state is rebound, never written in place
        out = self._cast_and_update(cast, x_hp, rowwise, columnwise, round_bf16, sums_dtype)
        if out is None:
            x_fp8, x_fp8_t, sums, amax = cast(x_hp, self._scale, rowwise, columnwise, round_bf16, sums_dtype)
            self._record(amax)
        else:
            x_fp8, x_fp8_t, sums = out
        rowwise_op = tensor_scaled(x_fp8, scale_inv) if rowwise else None  # (M, K)
        columnwise_op = tensor_scaled(x_fp8_t, scale_inv) if columnwise else None  # (K, M)
        return rowwise_op, columnwise_op, sums

    def _seeding_cast(self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, kernel: str, round_bf16: bool,
                      sums_dtype: torch.dtype = torch.float32):
        """A fresh quantizer's first cast as one current-scaling cast: with no margin
        and the built-in scale, the seed's scale from the tensor's own amax is current
        scaling's (fmax / amax; 1 for an amax of 0, inf or NaN; the largest fp32 where
        that overflows), so the cast computes amax, scale and copies in one pass
        where seeding took an amax pass and an update first. The amax is then
        recorded as any cast's: the same copies and state, bit for bit, and one
        launch where a switch to delayed scaling otherwise launched four or five for
        every fresh quantizer. ``(row-wise operand, column-wise operand, sums or None)``."""
        # current scaling's cast bound to the format alone (no power of 2, no epsilon): the backend's prepared one
        if kernel == "quantize_tensorwise_column_sums":
            cast = self._caster("quantize_current_column_sums", x_hp.device, generic_current_sums_caster)
        else:
            cast = self._caster("quantize_current", x_hp.device, generic_current_caster)
        data, data_t, scale, scale_inv, amax, sums = cast.with_scale(x_hp, rowwise, columnwise, round_bf16, sums_dtype)
        if scale.dim():  # the cuda backend's are 0-d already (a reshape is a dispatch: 99 of them in a GPT's switch)
            scale, scale_inv = scale.reshape(()), scale_inv.reshape(())
        self._scale, self._scale_inv = scale, scale_inv
        self.seeded = True
        if CHECKPOINT_FRAMES[0] is not None:  # a checkpointed region's forward: its recomputation seeds alike
            CHECKPOINT_FRAMES[0].note(self, self._scale, self._scale_inv, False)
        self._record(amax.reshape(1))
        scale_inv = self._scale_inv
        return (tensor_scaled(data, scale_inv) if rowwise else None,
                tensor_scaled(data_t, scale_inv) if columnwise else None, sums)

    def _cast_and_update(self, cast, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                         sums_dtype: torch.dtype = torch.float32):
        """The cast with the state updated from its amax in the same call, where the
        backend's prepared cast has such an entry (``with_update``: the cuda backend,
        one launch where the cast is one), the update is the kernel's and no group
        reduces the amax: ``(data, data_t, sums)``, the new state bound. Else None:
        the caller casts and records the amax (a reduction must see every rank's
        first, and the other backends update apart). Bit for bit the same state."""
        with_update = getattr(cast, "with_update", None) if self.update_in_cast else None
        if (with_update is None or not self._kernel_update
                or self.amax_reduction_group is not None and self._group() is not None):  # no group: no look-up
            return None
        out = with_update(x_hp, self._scale, self._amax_history, self._nonfinite_amax_count, self.margin,
                          self.amax_compute_algo == "max", rowwise, columnwise, round_bf16, sums_dtype)
        if out is None:
            return None
        x_fp8, x_fp8_t, sums, _, history, scale, scale_inv, count = out
        self._amax_history, self._scale, self._scale_inv, self._nonfinite_amax_count = history, scale, scale_inv, count
        return x_fp8, x_fp8_t, sums

    def epilogue_cast(self, device: torch.device) -> EpilogueCast | None:
        """The current scale, the FP8 format and a buffer for the tensor's amax; ``None``
        while unseeded (the first tensor must seed the scale from its own amax)."""
        self._flush()
        self._move_state(device)
        frames = CHECKPOINT_FRAMES
        if frames[1] is not None:  # recomputing: the epilogue where the forward's cast was one
            if not frames[1].next_was_seeded(self):
                return None  # the forward seeded in a call: so does this cast
            scale, scale_inv, _ = frames[1].next_scale(self)
            if frames[0] is not None:
                frames[0].note(self, scale, scale_inv)
            return EpilogueCast(scale, self.fp8_dtype, torch.empty(1, dtype=torch.float32, device=device), scale_inv)
        if not self.seeded:
            return None
        if frames[0] is not None:
            frames[0].note(self, self._scale, self._scale_inv)
        amax = torch.empty(1, dtype=torch.float32, device=device)  # the epilogue writes (not accumulates) it
        return EpilogueCast(self._scale, self.fp8_dtype, amax, self._scale_inv)

    def adopt_epilogue_cast(
        self, cast: EpilogueCast, data: torch.Tensor, shape: torch.Size, dtype: torch.dtype, columnwise: bool = False
    ) -> QuantizedTensor:
        """Record the epilogue's amax and update the scale as :meth:`_quantize` does; the
        column-wise copy is the transpose of the FP8 bytes (one per-tensor scale: the
        same bytes a cast of the transpose gives)."""
        scale_inv = cast.pending  # the one the epilogue's scale goes with
        if CHECKPOINT_FRAMES[1] is None and not EVALUATING[0]:  # a recomputation or an evaluation records nothing
            self._record(cast.amax)
        rowwise_op = ScaledOperand(data, scale_inv, Scaling.TENSOR)  # (M, K)
        columnwise_op = None
        if columnwise:
            data_t = data.view(torch.uint8).t().contiguous().view(data.dtype)  # (K, M)
            columnwise_op = ScaledOperand(data_t, scale_inv, Scaling.TENSOR)
        return QuantizedTensor(rowwise_op, columnwise_op, shape, dtype)

    casts_shards = True

    def cast_shard(self, shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast this rank's shard with the current scale (the same on every rank of the
        reduction) and record the whole tensor's amax, the maximum over ``group``'s
        shards, as a cast of the whole tensor records its own: through the pending
        reduction when the quantizer's group spans ``group`` (no collective of its
        own), else all-reduced over ``group`` first. A fresh quantizer seeds its scale
        from that whole-tensor amax, as it would from the whole tensor."""
        device = shard.device
        self._flush()
        self._move_state(device)
        cast = backend.resolve("quantize_tensorwise", device).fn
        frames = CHECKPOINT_FRAMES
        if frames[1] is not None or EVALUATING[0]:  # a gather that records nothing
            scale, scale_inv = self._unrecorded_scale(lambda: max_over(shard_amax(shard), group))
            data, _, _ = cast(shard, scale, self.fp8_dtype, rowwise=True, columnwise=False)
            return data, scale_inv
        seeded = self.seeded
        if not seeded:
            self._seed_from_amax(max_over(shard_amax(shard), group))
        if frames[0] is not None:
            frames[0].note(self, self._scale, self._scale_inv, seeded)
        scale_inv = self._scale_inv  # the state is rebound, never written in place
        amax = torch.empty(1, dtype=torch.float32, device=device)
        data, _, _ = cast(shard, self._scale, self.fp8_dtype, rowwise=True, columnwise=False, amax_out=amax)
        if not self._reduces_over(group):
            max_over(amax, group)
        self._record(amax)
        return data, scale_inv

    def _reduces_over(self, group) -> bool:
        """Whether the amax reduction in force spans every rank of ``group``."""
        own = self._group()
        if own is None:
            return False
        if own is group or own is torch.distributed.group.WORLD:
            return True
        ranks = torch.distributed.get_process_group_ranks
        return set(ranks(group)) <= set(ranks(own))

    def observe(self, x: torch.Tensor) -> None:
        """Calibration: record ``amax(x)`` in the history and update the scale; no cast."""
        self._check_input(x, True, False)
        if CHECKPOINT_FRAMES[1] is not None:  # a checkpointed region recomputed: its forward observed already
            return
        x_hp = x.reshape(-1, x.shape[-1])  # (M, K)
        self._flush()
        self._move_state(x_hp.device)
        cast = backend.resolve("quantize_tensorwise", x_hp.device).fn
        amax = torch.empty(1, dtype=torch.float32, device=x_hp.device)
        cast(x_hp, self._scale, self.fp8_dtype, rowwise=False, columnwise=False, amax_out=amax)
        self.seeded = True
        self._record(amax)

    def _unrecorded_scale(self, first_amax: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv)`` of a cast that records nothing: in a checkpointed
        region's recomputation, the scale its forward noted; in an evaluation forward,
        the scale as it stands, or for a fresh quantizer the first scale that
        ``first_amax()`` (the amax of what is cast) would seed, this rank's own and
        kept nowhere (a validation one rank runs alone must not wait for the others),
        the quantizer staying fresh. Noted for the replay of a checkpointed region
        being recorded."""
        frames = CHECKPOINT_FRAMES
        if frames[1] is not None:
            scale, scale_inv, seeded = frames[1].next_scale(self)
        else:
            seeded = self.seeded
            scale, scale_inv = (self._scale, self._scale_inv) if seeded else self._first_scale(first_amax())
        if frames[0] is not None:  # a region nested in the one recomputed runs its forward again
            frames[0].note(self, scale, scale_inv, seeded)
        return scale, scale_inv

    def _seed_amax(self, x_hp: torch.Tensor, cast: Callable, round_bf16: bool = False) -> torch.Tensor:
        """The amax a fresh quantizer seeds from: of ``x_hp`` itself (``round_bf16``: of
        ``x_hp.to(bfloat16)``, which the cast then reads; that amax is the bf16 rounding
        of ``x_hp``'s, rounding being monotone and symmetric, so no rounded copy is made)."""
        amax = torch.empty(1, dtype=torch.float32, device=x_hp.device)
        cast(x_hp, self._scale, self.fp8_dtype, rowwise=False, columnwise=False, amax_out=amax)
        return amax.to(torch.bfloat16).float() if round_bf16 else amax

    def _seed(self, x_hp: torch.Tensor, cast: Callable, round_bf16: bool = False) -> None:
        """First scale of a fresh quantizer, from the amax of ``x_hp`` (:meth:`_seed_amax`).

        An inf or NaN amax cannot seed: the scale stays 1. The quantizer is marked
        seeded all the same, since telling the two apart would read the device (a
        host sync); the same call's :meth:`_record` skips that amax and counts it
        once, and the next finite tensor (cast with scale 1) sets the scale."""
        self._seed_from_amax(self._seed_amax(x_hp, cast, round_bf16))

    def _seed_from_amax(self, amax: torch.Tensor) -> None:
        """The first scale from ``amax`` (one element, fp32: the first tensor's), reduced
        over the quantizer's group; see :meth:`_seed`."""
        self._reduce_amax(amax)
        self._scale, self._scale_inv = self._first_scale(amax)
        self.seeded = True

    def _first_scale(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and reciprocal a fresh quantizer takes from ``amax`` (nothing bound)."""
        if self.scaling_factor_compute_algo is None:
            # "most_recent": the scale from this amax alone (kept at 1 for inf or NaN); seeding records
            # no history and counts nothing (the record that follows counts)
            update = backend.resolve("delayed_scale_update", amax.device).fn
            _, scale, scale_inv, _ = update(
                self._amax_history, amax, self._scale, self._nonfinite_amax_count, self.fp8_dtype, self.margin,
                "most_recent")  # fmt: skip
            return scale, scale_inv
        scale, _ = self._next_scale(amax.reshape(()), self._scale)
        return scale, torch.reciprocal(scale)  # as _set_scale: an IEEE fp32 division

    def _record(self, amax: torch.Tensor) -> None:
        """Record ``amax`` (one element, fp32) once the waiting amaxes are applied
        together (see :class:`_PendingAmaxes`): at the latest before this
        quantizer's state is used or shown, so no cast sees an older scale than an
        update at once would give; under a reduction group, reduced first."""
        PENDING.add(self, amax, self._group())

    @staticmethod
    def update_together(pairs: list) -> None:
        """Apply waiting amaxes, ``(quantizer, amax)`` with each quantizer once:
        :data:`BATCH_FROM` or more quantizers of one configuration (device, history
        length, format, margin, algorithm) with one ``delayed_scale_update_many``
        over their stacked state, the others (and callable algorithms) each with
        its own update. Bit for bit the same state either way."""
        groups: dict = {}
        for q, amax in pairs:
            if q._kernel_update:
                key = (q._amax_history.device, q.amax_history_len, q.fp8_dtype, q.margin, q.amax_compute_algo)
                groups.setdefault(key, []).append((q, amax))
            else:
                q._update(amax)
        for (device, _, fp8_dtype, margin, algo), members in groups.items():
            if len(members) < BATCH_FROM:
                for q, amax in members:
                    q._update(amax)
                continue
            qs = [q for q, _ in members]
            update = backend.resolve("delayed_scale_update_many", device).fn
            histories, scales, scale_invs, counts = update(
                [q._amax_history for q in qs], [amax for _, amax in members], [q._scale for q in qs],
                [q._nonfinite_amax_count for q in qs], fp8_dtype, margin, algo)  # fmt: skip
            for q, h, s, si, c in zip(qs, histories.unbind(), scales.unbind(), scale_invs.unbind(), counts.unbind()):
                q._amax_history, q._scale, q._scale_inv, q._nonfinite_amax_count = h, s, si, c

    @property
    def _kernel_update(self) -> bool:
        """Whether the update is the ``delayed_scale_update`` kernel's (a named amax
        algorithm, the built-in scale): else torch ops run the callables."""
        return self.scaling_factor_compute_algo is None and isinstance(self.amax_compute_algo, str)

    def _group(self):
        """The process group its amaxes are reduced over now (None: no reduction)."""
        group = self.amax_reduction_group
        return default_group() if isinstance(group, str) else group  # str: WORLD

    def _flush(self) -> None:
        """Apply its pending amaxes (and everyone's: they reduce together) before its state is used."""
        if self._pending:
            flush_amax_reductions()

    def _update(self, amax: torch.Tensor) -> None:
        """Record ``amax`` as the newest history entry and update the scale: one
        ``delayed_scale_update`` kernel, or torch ops for a callable."""
        if self._kernel_update:
            update = backend.resolve("delayed_scale_update", amax.device).fn
            self._amax_history, self._scale, self._scale_inv, self._nonfinite_amax_count = update(
                self._amax_history, amax, self._scale, self._nonfinite_amax_count, self.fp8_dtype, self.margin,
                self.amax_compute_algo)  # fmt: skip
            return
        # the kernel's rules in torch ops: an inf or NaN amax is skipped (history and scale
        # kept, counted), selected on the device; the callables still run, their result unused
        recorded = amax.reshape(()) < torch.inf  # False for inf and NaN
        shifted = torch.cat((amax.reshape(1), self._amax_history[:-1]))
        history = torch.where(recorded, shifted, self._amax_history)
        scale, _ = self._next_scale(self._history_amax(history), self._scale)
        self._amax_history = history
        self._set_scale(torch.where(recorded, scale, self._scale))
        self._nonfinite_amax_count = self._nonfinite_amax_count + recorded.logical_not()

    def _reduce_amax(self, amax: torch.Tensor) -> None:
        group = self._group()
        if group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)

    # -- the scale update --------------------------------------------------------
    def _history_amax(self, history: torch.Tensor) -> torch.Tensor:
        algo = self.amax_compute_algo
        if algo == "max":
            return history.amax()
        if algo == "most_recent":
            return history[0]
        amax = algo(history.clone())
        return torch.as_tensor(amax, dtype=torch.float32, device=history.device).reshape(())

    def _next_scale(self, amax: torch.Tensor, prev_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax is finite)`` for an fp32 0-d ``amax``, in torch ops (the
        paths the ``delayed_scale_update`` kernel does not take), no host sync."""
        if self.scaling_factor_compute_algo is None:
            scale = torch.div(self.fmax, amax)  # IEEE fp32 division; a tiny amax gives inf
            scale = divide_by_power_of_2(scale, self.margin)
        else:
            scale = self.scaling_factor_compute_algo(amax, prev_scale, self.fmax, self.recipe)
            scale = torch.as_tensor(scale, dtype=torch.float32, device=amax.device).reshape(())
        return guarded_scale(scale, amax, prev_scale)

    def _set_scale(self, scale: torch.Tensor) -> None:
        self._scale = scale
        self._scale_inv = torch.reciprocal(scale)  # an IEEE fp32 division, on CPU and CUDA alike

    @property
    def nonfinite_amax_events(self) -> int:
        """How many scale updates an inf/NaN amax skipped (reads the device: syncs)."""
        return int(self._nonfinite_amax_count.item())

    # -- state -----------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`Quantizer.state_tensors`: the waiting amaxes applied and shared
        fresh tensors made the quantizer's own once (not once a name: a CUDA
        graph's replay reads every quantizer's state)."""
        self._flush()
        if self.__dict__.get("_shared") is not None:
            self._own_shared_tensors()
        return {"scale": self._scale, "scale_inv": self._scale_inv, "amax_history": self._amax_history,
                "nonfinite_amax_count": self._nonfinite_amax_count}

    def state_dict(self) -> dict[str, Any]:
        self._flush()
        return {
            "scale": self._scale.clone(),
            "scale_inv": self._scale_inv.clone(),
            "amax_history": self._amax_history.clone(),
            "seeded": self.seeded,
            "nonfinite_amax_count": self._nonfinite_amax_count.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(_STATE_KEYS) - set(state))
        unexpected = sorted(set(state) - set(_STATE_KEYS))
        if missing or unexpected:
            raise ValueError(f"{self._who()}: state_dict keys: missing {missing}, unexpected {unexpected}")
        self._flush()  # the pending amaxes belong to the state being replaced
        history = torch.as_tensor(state["amax_history"])
        if tuple(history.shape) != (self.amax_history_len,):
            raise ValueError(
                f"{self._who()}: state_dict amax_history has shape {tuple(history.shape)}, this quantizer "
                f"keeps ({self.amax_history_len},); use continue_from_state to resize a history"
            )
        device = self._scale.device
        self._amax_history = history.to(device=device, dtype=torch.float32, copy=True)
        self._scale = torch.as_tensor(state["scale"]).to(device=device, dtype=torch.float32, copy=True).reshape(())
        scale_inv = torch.as_tensor(state["scale_inv"])
        self._scale_inv = scale_inv.to(device=device, dtype=torch.float32, copy=True).reshape(())
        count = torch.as_tensor(state["nonfinite_amax_count"])
        self._nonfinite_amax_count = count.to(device=device, dtype=torch.int64, copy=True).reshape(())
        self.seeded = bool(state["seeded"])

    def carry_state_from(self, previous: Quantizer | None) -> None:
        """Continue the amax history of a previous delayed-scaling quantizer.

        The history is resized to this quantizer's length (the newest entries are
        kept; growing pads zeros at the old end) and the scale recomputed from it
        under this quantizer's format, margin and algorithms. Any other previous
        quantizer (or ``None``) leaves this one fresh: it seeds on first use.
        """
        if previous is self:
            return
        if not isinstance(previous, DelayedScalingQuantizer):
            if self.seeded:  # a fresh quantizer is already in that state
                self._reset(self._scale.device)
            return
        previous._flush()
        self._continue(previous.amax_history, previous.scale, previous.nonfinite_amax_count, previous.seeded)

    def continue_from_state(self, state: dict[str, Any]) -> None:
        """Continue a checkpointed state saved under another delayed-scaling recipe,
        as :meth:`carry_state_from` continues a quantizer: the history resized, the
        scale recomputed under this quantizer's configuration."""
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            raise ValueError(f"{self._who()}: state_dict keys: missing {missing}")
        device = self._scale.device
        history = torch.as_tensor(state["amax_history"]).to(device=device, dtype=torch.float32).reshape(-1)
        scale = torch.as_tensor(state["scale"]).to(device=device, dtype=torch.float32).reshape(())
        count = torch.as_tensor(state["nonfinite_amax_count"]).to(device=device, dtype=torch.int64).reshape(())
        self._continue(history, scale, count, bool(state["seeded"]))

    def _continue(self, history: torch.Tensor, scale: torch.Tensor, count: torch.Tensor, seeded: bool) -> None:
        """Take over ``history`` (newest first, any length), resized to this
        quantizer's length, and recompute the scale from it (``scale``: the previous
        one, kept where the history gives none)."""
        self._reset(history.device)
        self._fresh = None  # written in place below
        kept = min(history.numel(), self.amax_history_len)
        self._amax_history[:kept] = history[:kept]
        self._nonfinite_amax_count = count.clone()
        self.seeded = seeded
        if seeded:
            new_scale, _ = self._next_scale(self._history_amax(self._amax_history), scale)
            self._set_scale(new_scale)

    # -- text --------------------------------------------------------------------
    def describe(self) -> str:
        text = f"delayed({short_name(self.fp8_dtype)}, hist={self.amax_history_len}, margin={self.margin}"
        algo = self.amax_compute_algo
        if algo != "max":
            text += f", amax={algo if isinstance(algo, str) else getattr(algo, '__qualname__', 'callable')}"
        if self.scaling_factor_compute_algo is not None:
            sf = self.scaling_factor_compute_algo
            text += f", scale={getattr(sf, '__qualname__', 'callable')}"
        return text + ")"


# Where _copied_states lays the states it copies out in its blocks: every tensor
# starts on a 16-byte boundary (the GEMM takes a scale's address as it is there,
# and Triton specialises on a pointer's alignment).
_FLOATS_PER_SLOT = 4
_INT64S_PER_SLOT = 2


def _state_views(scales: torch.Tensor, histories: torch.Tensor, counts: torch.Tensor, history_lengths: list[int]):
    """Each quantizer's scale, inverse scale, history and count as views of blocks
    laid out as ``_copied_states`` lays them (``scales``: its scale and inverse
    scale slots, ``histories``: its padded histories, ``counts``: its int64 count
    slots), as four tuples in the quantizers' order."""
    n, f, i = len(history_lengths), _FLOATS_PER_SLOT, _INT64S_PER_SLOT
    both = scales.view(2 * n, f)[:, 0].unbind()
    sizes = [size for length in history_lengths for size in (length, _padded(length, f) - length)]
    return both[0::2], both[1::2], histories.split(sizes)[::2], counts.view(n, i)[:, 0].unbind()


# (device, history length) -> a fresh state's four tensors on that device, which
# every fresh delayed-scaling quantizer placed there holds until its first update
# rebinds them: nothing writes a state tensor in place (the quantizer's accessors
# hand a holder copies of its own first), so one set serves every quantizer.
_SHARED_FRESH: dict = {}


def _shared_fresh_state(device: torch.device, history_len: int):
    """The device's shared fresh state for histories of ``history_len`` (made at its
    first use: scale and inverse scale 1, history and count 0); None while a CUDA
    graph is captured and it is not made yet (a tensor made in a capture holds its
    values only once the graph replays)."""
    key = (device, history_len)
    shared = _SHARED_FRESH.get(key)
    if shared is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        shared = (torch.ones((), dtype=torch.float32, device=device), torch.ones((), dtype=torch.float32, device=device),
                  torch.zeros(history_len, dtype=torch.float32, device=device),
                  torch.zeros((), dtype=torch.int64, device=device))
        _SHARED_FRESH[key] = shared
    return shared


def _bind_shared(movers, device: torch.device) -> bool:
    """Give each of ``movers`` (fresh quantizers) the device's shared fresh state of
    its history length; False (nothing bound) where one is missing (see
    :func:`_shared_fresh_state`)."""
    states = []
    for q in movers:
        shared = _shared_fresh_state(device, q.amax_history_len)
        if shared is None:
            return False
        states.append(shared)
    for q, shared in zip(movers, states):
        q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count = shared
        q._fresh = q._shared = shared
        q._borrowed = None
    return True


def carry_states(pairs) -> None:
    """``q.carry_state_from(previous)`` for each ``(q, previous)`` pair, the same
    states, in far fewer launches where many delayed-scaling quantizers continue
    seeded ones of one configuration (a switch between delayed-scaling recipes: the
    GPT's 130 quantizers each made about a dozen small launches, run 300's
    delayed_mha switch). Each such group's histories are stacked, resized and
    turned into scales as vectors in one pass of ops, and its states laid out as
    ``_copied_states`` lays them (each tensor a 16-byte aligned view of a block);
    every other pair continues alone."""
    groups: dict[tuple, list] = {}
    for q, previous in pairs:
        if (type(q) is DelayedScalingQuantizer and type(previous) is DelayedScalingQuantizer and previous is not q
                and previous.seeded and q.amax_compute_algo in ("max", "most_recent")
                and q.scaling_factor_compute_algo is None):
            previous._flush()
            key = (q.amax_history_len, previous._amax_history.numel(), q.fmax, q.margin, q.amax_compute_algo,
                   previous._amax_history.device)
            groups.setdefault(key, []).append((q, previous))
        else:
            q.carry_state_from(previous)
    for (length, previous_length, fmax, margin, algo, device), group in groups.items():
        if len(group) < 2:
            group[0][0].carry_state_from(group[0][1])
            continue
        _carry_group(group, length, previous_length, fmax, margin, algo, device)


def _carry_group(group: list, length: int, previous_length: int, fmax: float, margin: int, algo: str,
                 device: torch.device) -> None:
    """:func:`carry_states` for one group: ``_continue`` of each, as vectors."""
    n, f, i = len(group), _FLOATS_PER_SLOT, _INT64S_PER_SLOT
    kept = min(previous_length, length)
    histories = torch.zeros((n, _padded(length, f)), dtype=torch.float32, device=device)
    histories[:, :kept] = torch.stack([p._amax_history[:kept] for _, p in group])
    previous_scales = torch.stack([p._scale for _, p in group])
    amax = histories[:, :length].amax(dim=1) if algo == "max" else histories[:, 0]
    scale = divide_by_power_of_2(torch.div(fmax, amax), margin)  # as _next_scale, element by element
    scale, _ = guarded_scale(scale, amax, previous_scales)
    scales = torch.zeros((2 * n, f), dtype=torch.float32, device=device)
    scales[0::2, 0] = scale
    scales[1::2, 0] = torch.reciprocal(scale)
    counts = torch.zeros((n, i), dtype=torch.int64, device=device)
    counts[:, 0] = torch.stack([p._nonfinite_amax_count for _, p in group])
    views = _state_views(scales, histories.reshape(-1), counts.reshape(-1), [length] * n)
    for (q, _), scale_view, scale_inv_view, history_view, count_view in zip(group, *views):
        q._flush()
        q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count = (scale_view, scale_inv_view,
                                                                              history_view, count_view)
        q.seeded = True
        q._borrowed = q._shared = q._fresh = None  # its own state, not a fresh one


def place_states(quantizers, device: torch.device) -> None:
    """``_place``, then none of ``quantizers`` still borrows the fresh state of the one
    it was copied from (``fresh_copy(borrow_state=True)``): each holds the device's
    shared fresh state, views of its copied one or, where none were placed, a new
    CPU state as a new quantizer's."""
    _place(quantizers, device)
    for q in quantizers:
        if isinstance(q, DelayedScalingQuantizer) and q._borrows_state():
            q._reset(q.device)


def _place(quantizers, device: torch.device) -> None:
    """Move the scaling state of the delayed-scaling quantizers among ``quantizers``
    that still hold it on the CPU (fresh ones, or ones given a loaded state) to
    ``device`` at once, instead of four copies a quantizer at its first cast: a plan
    built at a switch to delayed scaling has a hundred such quantizers in a GPT.
    Fresh ones all take the device's shared fresh state (``_SHARED_FRESH``: no
    launch, no copy, no tensor made, after its first use), on the CPU too; where a
    loaded or carried state is among them, the states are copied to a GPU in two
    blocks, each tensor a view, 16-byte aligned. The same values as moving each
    quantizer alone. While a CUDA graph is captured only a shared state made before
    serves, and nothing is copied; otherwise the states stay where they are."""
    movers = [q for q in quantizers if isinstance(q, DelayedScalingQuantizer) and q._scale.device.type == "cpu"]
    if not movers:
        return
    for q in movers:
        q._flush()
    if all(q._holds_fresh_state() for q in movers):
        _bind_shared(movers, device)  # on any device
        return
    if device.type != "cuda" or len(movers) < 2 or torch.cuda.is_current_stream_capturing():
        return  # elsewhere, for one quantizer, or in a capture, a state moves at its first cast as before
    lengths = [q.amax_history_len for q in movers]
    scales, scale_invs, histories, counts = _copied_states(movers, lengths, device)  # a loaded or carried state
    for q, scale, scale_inv, history, count in zip(movers, scales, scale_invs, histories, counts):
        q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count = scale, scale_inv, history, count


def _copied_states(movers: list, history_lengths: list[int], device: torch.device):
    """The movers' states copied to ``device`` in two blocks (``_state_views`` of
    them): the scales and inverse scales in slots of ``_FLOATS_PER_SLOT``, then
    the histories, each padded to a slot; the counts (int64) in slots of
    ``_INT64S_PER_SLOT``."""
    n, f, i = len(movers), _FLOATS_PER_SLOT, _INT64S_PER_SLOT
    pad = torch.zeros(f, dtype=torch.float32)
    pieces = []
    for q in movers:
        pieces += (q._scale.reshape(1), pad[1:], q._scale_inv.reshape(1), pad[1:])
    for q, length in zip(movers, history_lengths):
        pieces += (q._amax_history, pad[:_padded(length, f) - length])
    counts = torch.zeros((n, i), dtype=torch.int64)
    counts[:, 0] = torch.stack([q._nonfinite_amax_count for q in movers])
    float_block = torch.cat(pieces).to(device, non_blocking=True)
    int64_block = counts.reshape(-1).to(device, non_blocking=True)
    return _state_views(float_block[:2 * n * f], float_block[2 * n * f:], int64_block, history_lengths)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
