"""The ``Quantizer`` interface the fuser and the ops rely on.

A quantizer holds the recipe state of one tensor role (its FP8 format, scaling
options and, for delayed scaling, the amax history) and turns a high-precision
tensor into a :class:`QuantizedTensor` by calling the cast kernels through
``te_fuser.backend.resolve`` — so the same quantizer runs on every backend. It
never computes FP8 numerics itself.

Ops call ``quantizer.cast(x, rowwise=..., columnwise=...)`` and never branch on the
recipe. Before a plan is published the fuser calls :meth:`Quantizer.check_shape`
and :meth:`Quantizer.check_device`, which raise without changing any state.

The hot path does not synchronise with the host: scales, amaxes and histories
stay device tensors, and decisions on their values are ``torch.where``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from .. import backend
from ..epoch import CHANGES
from ..fp8 import FP8_MAX, short_name, torch_dtype
from ..kernels.operand import ScaledOperand
from ..kernels.reference.cast import check_sums_dtype
from .float8_tensor import Float8Tensor
from .role import QuantizerRole
from .tensor import QuantizedTensor, flat_2d_shape

__all__ = ["Quantizer", "EpilogueCast", "FP8_MIN_COMPUTE_CAPABILITY", "shard_amax"]

# FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
# The dtypes a quantizer casts from.
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors without a subclass's own behaviour


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A device's compute capability (asked once: the query costs microseconds)."""
    return torch.cuda.get_device_capability(index)


def shard_amax(x_hp: torch.Tensor) -> torch.Tensor:
    """``amax(|x_hp|)`` of a 2-D tensor as a one-element fp32 tensor, by the backend's
    tensorwise cast kernel asked for no copy (its amax is the cast's own)."""
    amax = torch.empty(1, dtype=torch.float32, device=x_hp.device)
    one = torch.ones((), dtype=torch.float32, device=x_hp.device)
    backend.resolve("quantize_tensorwise", x_hp.device).fn(
        x_hp, one, torch.float8_e4m3fn, rowwise=False, columnwise=False, amax_out=amax)
    return amax


def max_over(amax: torch.Tensor, group) -> torch.Tensor:
    """``amax`` all-reduced (max) in place over the process ``group``: the whole
    tensor's amax from its shards' (a group of one rank already holds it)."""
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


class EpilogueCast(NamedTuple):
    """How a GEMM epilogue casts its result as a quantizer would (see
    :meth:`Quantizer.epilogue_cast`): the saturating cast of ``result * scale`` to
    ``fp8_dtype``, with the amax of |result| written into the one-element fp32
    ``amax`` slot. ``pending`` is the quantizer's own, opaque to the caller."""

    scale: torch.Tensor
    fp8_dtype: torch.dtype
    amax: torch.Tensor
    pending: Any


# (kernel, backend function, constant arguments, generic wrapper) -> the prepared cast
# (see Quantizer._caster); bounded, since an amax epsilon is any float
_SHARED_CASTERS: dict = {}
_MAX_SHARED_CASTERS = 256


class Quantizer:
    """Base class: one tensor role's quantization recipe state.

    Attributes the fuser reads:

    - ``role``: the :class:`QuantizerRole` it serves (``None`` until assigned);
    - ``fp8_dtype``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, or ``None``;
    - ``scaling``: a key of ``kernels.operand.SCALINGS`` or ``'identity'``;
    - ``min_compute_capability``: the CUDA capability the FP8 GEMMs need, or ``None``.

    Subclasses implement :meth:`_quantize` on the 2-D flattening ``(M, K)`` and,
    when they hold state, :meth:`state_dict` / :meth:`load_state_dict`.
    """

    scaling: str = "identity"
    # The names of the tensors of its scaling state (see :meth:`state_tensors`).
    STATE_TENSORS: tuple[str, ...] = ()
    # Whether its state is ready for the casts; a delayed-scaling quantizer seeds
    # its scale from its first tensor (a step that must not be replayed).
    seeded: bool = True
    min_compute_capability: tuple[int, int] | None = FP8_MIN_COMPUTE_CAPABILITY

    def __init__(self, fp8_dtype: torch.dtype | None, role: QuantizerRole | None = None, *,
                 rowwise: bool = True, columnwise: bool = False, device=None) -> None:
        self.role = role
        self.fp8_dtype = fp8_dtype if fp8_dtype is None else self._checked_fp8_dtype(fp8_dtype)
        self.set_usage(rowwise=rowwise, columnwise=columnwise)
        # Where the scaling state is first allocated (it moves to the input's device on first use).
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """The copies a call without ``rowwise=`` / ``columnwise=`` makes (TransformerEngine's
        usage flags). te_fuser's default is the row-wise copy alone (TransformerEngine's is
        both): the ops ask each cast for the copies its GEMMs read."""
        if rowwise is not None:
            self.rowwise_usage = self._checked_bool("rowwise", rowwise)
        if columnwise is not None:
            self.columnwise_usage = self._checked_bool("columnwise", columnwise)

    # -- quantization --------------------------------------------------------
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # Whether calls must run check_shape: the base one only rejects 0-d
        # shapes, which _check_input already does.
        cls._constrains_shape = cls.check_shape is not Quantizer.check_shape

    _constrains_shape = False
    # Whether :meth:`cast` (and :meth:`quantize_with_column_sums`) return a
    # QuantizedTensor of x's 2-D flattening for x of any dims, so that a caller may
    # hand x over as it comes (an identity quantizer returns x itself)
    flattens = True

    rowwise_usage, columnwise_usage = True, False

    def __call__(self, x: torch.Tensor, *, rowwise: bool | None = None,
                 columnwise: bool | None = None) -> torch.Tensor:
        """TransformerEngine's call: ``x`` quantized as a
        :class:`~te_fuser.quantization.float8_tensor.Float8Tensor`, a ``torch.Tensor``
        that ops, autograd and optimizers take (``requires_grad_``, ``copy_`` and the
        views work on it), holding :meth:`cast`'s copies. Writes into it are cast by
        this quantizer. The ops call :meth:`cast` and hand its storage to the GEMMs."""
        return Float8Tensor.from_quantized(self.cast(x, rowwise=rowwise, columnwise=columnwise), self)

    def cast(self, x: torch.Tensor, *, rowwise: bool | None = None,
             columnwise: bool | None = None) -> QuantizedTensor:
        """Quantize ``x`` (any shape ``(..., K)``) as its 2-D flattening ``(M, K)``: the
        internal :class:`QuantizedTensor` the GEMM kernels read; a copy not named takes
        the quantizer's usage flag (:meth:`set_usage`)."""
        if rowwise is None:
            rowwise = self.rowwise_usage
        if columnwise is None:
            columnwise = self.columnwise_usage
        rowwise_op, columnwise_op = self._quantize(self._checked_matrix(x, rowwise, columnwise), rowwise, columnwise)
        return QuantizedTensor(rowwise_op, columnwise_op, x.shape, x.dtype)

    def _checked_matrix(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> torch.Tensor:
        """``x`` checked for a cast of the named copies, as its 2-D flattening ``(M, K)``."""
        self._check_input(x, rowwise, columnwise)
        if self._constrains_shape:
            self.check_shape(tuple(x.shape), rowwise=rowwise, columnwise=columnwise)
        return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])

    # -- the lean path of the ops' calls (schemes that define one) -------------
    _kept_casters = None  # kernel -> (the backend's fn, the constant arguments, the caster, epoch, device)

    def __getstate__(self) -> dict:
        """A copy or a pickle without the kept casters (functions bound to this
        process's kernels; the copy prepares its own on first use)."""
        state = self.__dict__.copy()
        state.pop("_kept_casters", None)
        return state

    def fresh_copy(self, borrow_state: bool = False) -> "Quantizer":
        """A new quantizer of this one's configuration in the state a new one starts
        in (no kept casters; a stateful scheme resets in :meth:`_start_fresh`):
        what building it again would give, without the constructor's checks,
        which this one passed (``quantizer_for`` copies a prototype per recipe
        key and role). ``borrow_state``: a stateful scheme may hold this one's
        fresh state tensors for now instead of making its own, for a caller that
        places every state at once right after (see ``delayed.place_states``)."""
        copy = object.__new__(type(self))
        copy.__dict__ = self.__getstate__()  # a new dict, as a copy.copy's: without the kept casters
        copy._start_fresh(borrow_state)
        return copy

    def _start_fresh(self, borrow_state: bool = False) -> None:
        """Reset what a quantizer keeps between casts (a fresh copy's; nothing here)."""

    def _caster_args(self) -> tuple:
        """The constant arguments a scheme's prepared cast binds (see :meth:`_caster`)."""
        return (self.fp8_dtype,)

    def _caster(self, kernel: str, device: torch.device, generic):
        """The backend's ``kernel`` on ``device`` with :meth:`_caster_args` bound: the
        kernel's ``prepare`` entry where it has one, else ``generic(fn, *args)``;
        kept while the backend's choice and the arguments stay the same. The
        backend's choice is looked up again only when the change counter moved
        (``epoch``: a backend set or overridden, an auto entry changed) or the device
        is another: a step's every cast asks."""
        args = self._caster_args()
        kept = self._kept_casters
        if kept is None:
            kept = self._kept_casters = {}
        hit = kept.get(kernel)
        changes = CHANGES[0]
        if hit is not None and hit[3] == changes and hit[4] == device and hit[1] == args:
            return hit[2]
        fn = backend.resolve(kernel, device).fn
        if hit is not None and hit[0] is fn and hit[1] == args:
            kept[kernel] = (fn, args, hit[2], changes, device)
            return hit[2]
        # A prepared cast binds only constants, so quantizers of one configuration
        # share it: a plan's fresh quantizers do not each prepare their own.
        key = (kernel, fn, args, generic)
        caster = _SHARED_CASTERS.get(key)
        if caster is None:
            prepare = getattr(fn, "prepare", None)
            caster = prepare(*args) if prepare is not None else generic(fn, *args)
            if len(_SHARED_CASTERS) >= _MAX_SHARED_CASTERS:
                _SHARED_CASTERS.clear()
            _SHARED_CASTERS[key] = caster
        kept[kernel] = (fn, args, caster, changes, device)
        return caster

    def _lean(self, x, rowwise, columnwise) -> bool:
        """Whether a cast call may take a scheme's lean path: both copies named, a
        plain high-precision tensor of at least one dim, no shape constraint of a
        subclass. Anything else takes the checked path, which names what is wrong."""
        return (rowwise is not None and columnwise is not None and (rowwise or columnwise)
                and type(x) in _PLAIN and x.dtype in HIGH_PRECISION and x.dim() > 0
                and not self._constrains_shape)

    @staticmethod
    def _flat(x: torch.Tensor) -> torch.Tensor:
        """``x`` as its 2-D flattening (M, K) (itself when it is 2-D)."""
        return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])

    def _quantize(
        self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool
    ) -> tuple[ScaledOperand | None, ScaledOperand | None]:
        """The row-wise (M, K) and column-wise (K, M) copies of ``x_hp`` (M, K)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _quantize")

    def quantize_with_column_sums(
        self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
        as_dtype: torch.dtype | None = None, sums_dtype: torch.dtype = torch.float32,
    ) -> tuple[QuantizedTensor, torch.Tensor]:
        """``self(x)`` and ``x``'s 2-D flattening summed over its rows, in fp32 (a
        bias gradient). A scheme whose cast reads ``x`` anyway may compute the sums
        from the same read; by default they take a pass of their own.

        ``as_dtype`` (a high-precision dtype): the copies are those of ``x.to(as_dtype)``
        and stand for a tensor of that dtype, while the sums are of ``x`` as it is: a
        gradient that arrives in fp32 for GEMMs that compute in bf16, whose bias
        sums it as it arrives. A scheme may round as it reads (no converted copy).
        ``sums_dtype`` (fp32 or bf16): the sums accumulate in fp32 and are returned
        as ``sums_dtype``, each rounded once (the gradient of a bf16 bias, which a
        kernel writes as it adds the sums up, with no conversion after).
        The ops' calls take a scheme's :meth:`_lean_column_sums` where it has one."""
        if sums_dtype is not torch.float32:  # before any state changes (a delayed-scaling cast records)
            check_sums_dtype(sums_dtype, f"{type(self).__name__}.quantize_with_column_sums")
        if self._lean_column_sums is not None and self._lean(x, rowwise, columnwise):
            through_bf16 = self._through_bf16(x, as_dtype)
            if through_bf16 is not None:
                return self._lean_column_sums(x, rowwise, columnwise, through_bf16, sums_dtype)
        self._check_input(x, rowwise, columnwise)
        as_dtype = self._checked_as_dtype(as_dtype, x)
        shape = x.shape
        if self._constrains_shape:
            self.check_shape(tuple(shape), rowwise=rowwise, columnwise=columnwise)
        x_hp = x if len(shape) == 2 else x.reshape(-1, shape[-1])  # (M, K)
        through_bf16 = self._through_bf16(x_hp, as_dtype)
        if through_bf16 is None:  # a converted copy to cast; the sums of x as it came
            sums = x_hp.sum(dim=0, dtype=torch.float32).to(sums_dtype)  # (K,)
            rowwise_op, columnwise_op = self._quantize(x_hp.to(as_dtype), rowwise, columnwise)
        else:
            rowwise_op, columnwise_op, sums = self._quantize_with_column_sums(x_hp, rowwise, columnwise, through_bf16,
                                                                              sums_dtype)
        return QuantizedTensor(rowwise_op, columnwise_op, shape, as_dtype), sums

    def _quantize_with_column_sums(self, x_hp: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool,
                                   sums_dtype: torch.dtype = torch.float32):
        """The copies of ``x_hp`` (M, K) (``round_bf16``: of ``x_hp.to(bfloat16)``) and its
        column sums as ``sums_dtype``; by default the sums take a pass of their own."""
        sums = x_hp.sum(dim=0, dtype=torch.float32).to(sums_dtype)  # (K,), as a bias sums it
        rowwise_op, columnwise_op = self._quantize(x_hp.to(torch.bfloat16) if round_bf16 else x_hp, rowwise,
                                                   columnwise)
        return rowwise_op, columnwise_op, sums

    # Whether the scheme's column-sums cast reads an fp32 x as bf16 itself (round_bf16).
    reads_through_bf16 = False
    # A scheme's lean column-sums cast of an ops' call, ``(x, rowwise, columnwise,
    # round_bf16, sums_dtype) -> (QuantizedTensor, sums)``, or None.
    _lean_column_sums = None

    def _through_bf16(self, x: torch.Tensor, as_dtype: torch.dtype | None) -> bool | None:
        """How a column-sums cast of ``x`` as ``as_dtype`` reads x: as it is (False),
        rounded to bf16 by the scheme's own cast (True: fp32 as bf16, where the scheme
        :attr:`reads_through_bf16`), or None: through a converted copy."""
        if as_dtype is None or as_dtype is x.dtype:
            return False
        if self.reads_through_bf16 and as_dtype is torch.bfloat16 and x.dtype is torch.float32:
            return True
        return None

    def observe(self, x: torch.Tensor) -> None:
        """Calibration: record what the scaling state needs from ``x`` without casting."""

    # -- a cast done by the producing GEMM's epilogue ---------------------------
    def epilogue_cast(self, device: torch.device) -> EpilogueCast | None:
        """The scale, FP8 format and amax slot with which a GEMM epilogue may cast
        this role's next tensor, when they are known before the tensor exists
        (one per-tensor scale); else ``None``, and the tensor goes through
        ``quantizer.cast(x)``. A non-None answer must be followed by
        :meth:`adopt_epilogue_cast` once the epilogue has run."""
        return None

    # -- a cast of one shard of a sharded tensor (FSDP2's FP8 all-gather) -------
    # Whether :meth:`cast_shard` casts a shard as the whole tensor would be cast.
    casts_shards = False

    def cast_shard(self, shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast ``shard`` (M, K), this rank's rows of a tensor sharded over the process
        ``group``, with the one scale a cast of the whole tensor would take (every rank
        computes it alike) and the same effect on the scaling state: ``(data (M, K)
        FP8, scale_inv 0-d)``. Only for per-tensor schemes (``casts_shards``)."""
        raise RuntimeError(f"{self._who()}: {self.describe()} has no per-tensor scale to cast shards with")

    def adopt_epilogue_cast(
        self, cast: EpilogueCast, data: torch.Tensor, shape: torch.Size, dtype: torch.dtype, columnwise: bool = False
    ) -> QuantizedTensor:
        """Take the amax the epilogue wrote into ``cast.amax`` into the scaling state,
        exactly as ``quantizer.cast(x)`` would have, and return the row-wise ``data`` (M, K)
        (plus, when ``columnwise``, its column-wise copy) as the quantized tensor of
        ``shape``; ``dtype`` is the high-precision dtype it stands for."""
        raise RuntimeError(f"{self._who()}: epilogue_cast() gave no cast to adopt")

    # -- validation before a plan is published -------------------------------
    def check_shape(self, shape: tuple[int, ...], *, rowwise: bool = True, columnwise: bool = False) -> None:
        """Raise ``ValueError`` when a tensor of ``shape`` cannot be quantized as asked."""
        self._flat_shape(shape)

    def check_device(self, device: torch.device | str) -> None:
        """Raise ``RuntimeError`` when ``device`` lacks what this quantizer's GEMMs need.

        CPU (and any non-CUDA device) passes: the reference backend emulates every
        format there.
        """
        if self.min_compute_capability is None:
            return
        device = torch.device(device)
        if device.type != "cuda":
            return
        if not torch.cuda.is_available():
            raise RuntimeError(f"{self._who()}: device {device} was requested but no CUDA device is available")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.check_capability(_capability(index), device)

    def check_capability(self, capability: tuple[int, int], device: torch.device | str | None = None) -> None:
        """Raise ``RuntimeError`` when CUDA compute ``capability`` is below ``min_compute_capability``."""
        needed = self.min_compute_capability
        if needed is None or tuple(capability) >= tuple(needed):
            return
        where = f"device {device}" if device is not None else "the device"
        raise RuntimeError(
            f"{self._who()}: {self.describe()} needs FP8 tensor cores (CUDA compute capability >= "
            f"{needed[0]}.{needed[1]}), but {where} has compute capability {capability[0]}.{capability[1]}; "
            "run this role in high precision (no recipe) or on a newer GPU"
        )

    # -- state -----------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors of the scaling state, by name (empty for stateless
        quantizers). An update rebinds these names to new tensors, never writes
        them in place, so a holder of one sees the value it took."""
        return {name: getattr(self, name) for name in self.STATE_TENSORS}

    def bind_state_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (same shape, dtype and device) the state tensor ``name``:
        a holder of fixed addresses (a CUDA graph) binds its own copies."""
        if name not in self.STATE_TENSORS:
            raise ValueError(f"{self._who()}: no state tensor {name!r}; it has {list(self.STATE_TENSORS)}")
        live = getattr(self, name)
        if (tensor.shape, tensor.dtype, tensor.device) != (live.shape, live.dtype, live.device):
            raise ValueError(
                f"{self._who()}: state tensor {name!r} is {tuple(live.shape)} {live.dtype} on {live.device}, "
                f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            )
        setattr(self, name, tensor)

    def state_dict(self) -> dict[str, Any]:
        """The scaling state, tensors cloned (empty for stateless quantizers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self._who()}: holds no scaling state, got keys {sorted(state)}")

    def carry_state_from(self, previous: "Quantizer | None") -> None:
        """Take over what stays valid from the quantizer of the previous recipe (default: nothing)."""

    def continue_from_state(self, state: dict[str, Any]) -> None:
        """Take over a checkpointed state that a quantizer of this class saved under
        another recipe, as :meth:`carry_state_from` would from that quantizer
        (default: load it as it is)."""
        self.load_state_dict(state)

    # -- text --------------------------------------------------------------------
    def describe(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        role = f", role={self.role}" if self.role is not None else ""
        return f"{type(self).__name__}({self.describe()}{role})"

    # -- helpers for subclasses --------------------------------------------------
    def _who(self) -> str:
        role = str(self.role) if self.role is not None else "(no role)"
        return f"{type(self).__name__} for {role}"

    def _flat_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(M, K)`` of the 2-D flattening of ``shape``; a 0-d shape is rejected."""
        if len(shape) == 0:
            raise ValueError(f"{self._who()}: cannot quantize a 0-d tensor; give it at least one dimension")
        return flat_2d_shape(tuple(shape))

    def _checked_fp8_dtype(self, fp8_dtype: Any) -> torch.dtype:
        fp8_dtype = torch_dtype(fp8_dtype)  # TransformerEngine's te.DType names too
        if not isinstance(fp8_dtype, torch.dtype) or fp8_dtype not in FP8_MAX:
            raise ValueError(
                f"{type(self).__name__}.fp8_dtype: must be torch.float8_e4m3fn or torch.float8_e5m2, "
                f"got {fp8_dtype!r}"
            )
        return fp8_dtype

    def _checked_epsilon(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < math.inf):
            raise ValueError(f"{type(self).__name__}.{name}: must be a finite float >= 0, got {value!r}")
        return float(value) + 0.0

    def _checked_bool(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{type(self).__name__}.{name}: must be True or False, got {value!r}")
        return value

    def _checked_as_dtype(self, as_dtype: Any, x: torch.Tensor) -> torch.dtype:
        """``as_dtype`` of :meth:`quantize_with_column_sums`: x's own dtype when None."""
        if as_dtype is None:
            return x.dtype
        if as_dtype not in HIGH_PRECISION:
            raise TypeError(f"{self._who()}: as_dtype must be None or one of "
                            f"{[short_name(d) for d in HIGH_PRECISION]}, got {as_dtype!r}")
        return as_dtype

    def _check_input(self, x: Any, rowwise: bool, columnwise: bool) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._who()}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in HIGH_PRECISION:
            raise TypeError(
                f"{self._who()}: input dtype must be one of "
                f"{[short_name(d) for d in HIGH_PRECISION]}, got {x.dtype}"
            )
        if not x.shape:
            raise ValueError(f"{self._who()}: cannot quantize a 0-d tensor; give it at least one dimension")
        if not (rowwise or columnwise):
            raise ValueError(f"{self._who()}: rowwise and columnwise are both False; ask for at least one copy")
