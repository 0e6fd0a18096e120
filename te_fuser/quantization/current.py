"""``Float8CurrentScalingQuantizer``: one fp32 scale per tensor, from its own amax."""

from __future__ import annotations

import functools

import torch

from .. import backend
from ..fp8 import short_name
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand, tensor_scaled
from .base import Quantizer, max_over, shard_amax
from .role import QuantizerRole
from .tensor import QuantizedTensor

__all__ = ["Float8CurrentScalingQuantizer"]


def generic_current_caster(fn, fp8_dtype: torch.dtype, power_2: bool = False, epsilon: float = 0.0,
                           sums: bool = False):
    """``cast(x, rowwise, columnwise, round_bf16=False, sums_dtype=torch.float32) ->
    (data, data_t, scale_inv, sums or None)`` through a ``quantize_current`` (``sums``:
    ``quantize_current_column_sums``, which alone takes ``round_bf16`` and
    ``sums_dtype``) kernel without a ``prepare`` entry of its own; ``cast.with_scale``
    returns ``(data, data_t, scale, scale_inv, amax, sums or None)``, as the prepared
    casts' entry of that name does."""

    def with_scale(x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
                   sums_dtype: torch.dtype = torch.float32):
        if sums:
            return fn(x, fp8_dtype, power_2, epsilon, rowwise, columnwise, round_bf16, sums_dtype)
        return (*fn(x, fp8_dtype, power_2, epsilon, rowwise, columnwise, None), None)

    def cast(x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
             sums_dtype: torch.dtype = torch.float32):
        out = with_scale(x, rowwise, columnwise, round_bf16, sums_dtype)
        return out[0], out[1], out[3], out[5]

    cast.with_scale = with_scale
    return cast


generic_current_sums_caster = functools.partial(generic_current_caster, sums=True)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: ``scale = fmax / max(amax(x), amax_epsilon)``.

    With ``power_2_scales`` the scale is rounded down to a power of two. Both
    copies share the one scale; the column-wise copy is the transposed data.
    """

    scaling = Scaling.TENSOR
    reads_through_bf16 = True

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        power_2_scales: bool = False,
        amax_epsilon: float = 0.0,
        role: QuantizerRole | None = None,
        *,
        device=None,
        rowwise: bool = True,
        columnwise: bool = False,
    ) -> None:
        super().__init__(fp8_dtype, role, rowwise=rowwise, columnwise=columnwise, device=device)
        self.power_2_scales = self._checked_bool("power_2_scales", power_2_scales)
        self.amax_epsilon = self._checked_epsilon("amax_epsilon", amax_epsilon)
        # The process group the tensors this quantizer casts are sharded over along
        # their rows (tokens: ``te.sequence_parallel``): each cast's amax is then
        # all-reduced (max) over it first, so every rank casts its rows with the one
        # scale of the whole tensor. None: the tensor's own amax.
        self.sequence_parallel_group = None

    # -- the ops' casts: a lean path for the common call ------------------------
    def _caster_args(self) -> tuple:
        return (self.fp8_dtype, self.power_2_scales, self.amax_epsilon)

    def _lean(self, x, rowwise, columnwise) -> bool:
        return self.sequence_parallel_group is None and super()._lean(x, rowwise, columnwise)

    def cast(self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None):
        """:meth:`Quantizer.cast`; the ops' calls (both copies named, a plain tensor)
        skip the generic checks, with the same result."""
        if not self._lean(x, rowwise, columnwise):
            return super().cast(x, rowwise=rowwise, columnwise=columnwise)
        return self._lean_cast(x, rowwise, columnwise, "quantize_current", generic_current_caster)[0]

    def cast_given_amax(self, x: torch.Tensor, amax: torch.Tensor, *, rowwise: bool,
                        columnwise: bool) -> QuantizedTensor:
        """:meth:`cast` of ``x`` whose ``amax(|x|)`` its producer already reduced
        (``amax``: a one-element fp32 tensor on x's device, e.g. the activation
        kernel's ``amax_out``): the cast's second pass alone, the same copies and
        scale bit for bit as :meth:`cast`. Under a sequence-parallel group the amax
        is first all-reduced over it, as the cast's own would be. The ops' calls take
        the backend's prepared cast where it offers ``given_amax`` (x as it comes,
        checked at the launch), else the checked path below."""
        if self.sequence_parallel_group is None and self._lean(x, rowwise, columnwise):
            given = getattr(self._caster("quantize_current", x.device, generic_current_caster), "given_amax", None)
            out = None if given is None else given(x, amax, rowwise, columnwise)
            if out is not None:
                data, data_t, scale_inv = out
                return QuantizedTensor.of_cast(tensor_scaled(data, scale_inv) if rowwise else None,
                                               tensor_scaled(data_t, scale_inv) if columnwise else None, x.shape,
                                               x.dtype)
        x_hp = self._checked_matrix(x, rowwise, columnwise)
        if self.sequence_parallel_group is not None:
            amax = max_over(amax, self.sequence_parallel_group)
        rowwise_op, columnwise_op = self._quantize(x_hp, rowwise, columnwise, amax.reshape(()))
        return QuantizedTensor(rowwise_op, columnwise_op, x.shape, x.dtype)

    def _lean_column_sums(self, x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                          sums_dtype: torch.dtype = torch.float32):
        """The ops' column-sums casts, lean as :meth:`cast` (fp32 cast as bf16 rounded as the kernel reads it)."""
        return self._lean_cast(x, rowwise, columnwise, "quantize_current_column_sums", generic_current_sums_caster,
                               round_bf16, sums_dtype)

    def _lean_cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool, kernel: str, generic,
                   round_bf16: bool = False, sums_dtype: torch.dtype = torch.float32):
        """The lean path's cast of ``x`` flattened to (M, K) through ``kernel``:
        (the copies, the column sums as ``sums_dtype`` or None); ``round_bf16``: of x read as bf16."""
        caster = self._caster(kernel, x.device, generic)
        any_shape = getattr(caster, "any_shape", None)  # a backend's cast of x as it comes (no reshape here)
        out = None if any_shape is None else any_shape(x, rowwise, columnwise, round_bf16, sums_dtype)
        if out is None:
            out = caster(self._flat(x), rowwise, columnwise, round_bf16, sums_dtype)  # x as (M, K)
        data, data_t, scale_inv, sums = out
        q = QuantizedTensor.of_cast(tensor_scaled(data, scale_inv) if rowwise else None,
                                    tensor_scaled(data_t, scale_inv) if columnwise else None, x.shape,
                                    torch.bfloat16 if round_bf16 else x.dtype)
        return q, sums

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, amax: torch.Tensor | None = None
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        if amax is None and self.sequence_parallel_group is not None:
            amax = max_over(shard_amax(x_hp.reshape(-1, x_hp.shape[-1])), self.sequence_parallel_group)
        cast = backend.resolve("quantize_current", x_hp.device).fn
        x_fp8, x_fp8_t, _scale, scale_inv, _amax = cast(
            x_hp, self.fp8_dtype, self.power_2_scales, self.amax_epsilon, rowwise, columnwise, amax
        )
        rowwise_op = ScaledOperand(x_fp8, scale_inv, Scaling.TENSOR) if rowwise else None  # (M, K)
        columnwise_op = ScaledOperand(x_fp8_t, scale_inv, Scaling.TENSOR) if columnwise else None  # (K, M)
        return rowwise_op, columnwise_op

    casts_shards = True

    def cast_shard(self, shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's amax, all-reduced (max) over ``group``: the whole tensor's amax,
        from which every rank computes the same scale; then the cast with it."""
        amax = max_over(shard_amax(shard), group)
        cast = backend.resolve("quantize_current", shard.device).fn
        data, _, _scale, scale_inv, _amax = cast(
            shard, self.fp8_dtype, self.power_2_scales, self.amax_epsilon, True, False, amax)
        return data, scale_inv

    def _quantize_with_column_sums(self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                                   sums_dtype: torch.dtype = torch.float32):
        """The cast also sums the columns (from its amax pass or its cast pass, as the
        backend's kernel reads them; under a sequence-parallel group the cast takes
        the reduced amax and the sums are a pass of their own); ``round_bf16``: the
        kernel reads x rounded to bf16."""
        if self.sequence_parallel_group is not None:
            return super()._quantize_with_column_sums(x_hp, rowwise, columnwise, round_bf16, sums_dtype)
        cast = backend.resolve("quantize_current_column_sums", x_hp.device).fn
        x_fp8, x_fp8_t, _scale, scale_inv, _amax, sums = cast(
            x_hp, self.fp8_dtype, self.power_2_scales, self.amax_epsilon, rowwise, columnwise, round_bf16, sums_dtype
        )
        rowwise_op = ScaledOperand(x_fp8, scale_inv, Scaling.TENSOR) if rowwise else None
        columnwise_op = ScaledOperand(x_fp8_t, scale_inv, Scaling.TENSOR) if columnwise else None
        return rowwise_op, columnwise_op, sums

    def describe(self) -> str:
        extras = (", pow2" if self.power_2_scales else "") + (
            f", eps={self.amax_epsilon!r}" if self.amax_epsilon else ""
        )
        return f"current({short_name(self.fp8_dtype)}{extras})"
