"""Basic and fused operations: the units the op fuser plans with.

A :class:`BasicOperation` is an ``nn.Module`` that owns its parameters and knows
how to run its own forward and backward given an :class:`OpContext`. A
:class:`FusedOperation` stands in for a run of consecutive basic ops in one pass
(forward or backward) and owns no parameters: it reads them from its basic ops.

Ops exchange plain tensors. Each basic op saves what its backward needs in its
own context, whichever op (basic or fused) ran its forward, so forward and
backward fusions can be chosen independently.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
from torch import nn

from ..epoch import CHANGES
from ..quantization.role import QuantizerRole

if TYPE_CHECKING:
    from ..quantization import Quantizer
    from ..recipe import Recipe

__all__ = ["RunConfig", "OpContext", "BasicOperation", "FusedOperation", "WatchedModule", "QuantizerSnapshot"]


class QuantizerSnapshot(NamedTuple):
    """What :meth:`BasicOperation.restore_quantizers` puts back: the installed
    quantizers, the recipe key they were built for, a checkpointed state still
    waiting for its recipe, and each quantizer's scaling state (cloned)."""

    quantizers: dict
    recipe_key: "str | None"
    pending: "dict | None"
    states: dict


class RunConfig:
    """What a plan was built for: shared by every op context of one forward.

    Besides the plan's conditions it holds values derived once from the
    (immutable) recipe, which the ops read on every call: whether tensors are
    quantized, the ``backward_override``, and each GEMM's fast-accumulation flag.
    """

    __slots__ = (
        "recipe", "calibrating", "compute_dtype", "needs_backward", "training", "key",
        "quantizing", "backward_override", "fp8_backward", "keep_fp8", "from_master", "fast_accum_fprop",
        "fast_accum_dgrad", "fast_accum_wgrad",
    )

    def __init__(self, recipe, calibrating, compute_dtype, needs_backward, training, key):
        self.recipe: Recipe | None = recipe
        self.calibrating: bool = calibrating
        self.compute_dtype: torch.dtype = compute_dtype
        self.needs_backward: bool = needs_backward
        self.training: bool = training
        self.key: str = key
        self.quantizing: bool = recipe is not None and not calibrating
        self.backward_override: str | None = None if recipe is None else recipe.backward_override
        # FP8 backward GEMMs: quantizing, with no backward_override
        self.fp8_backward: bool = self.quantizing and self.backward_override is None
        # the backward may read the forward's FP8 operands (all but backward_override='high_precision')
        self.keep_fp8: bool = self.backward_override != "high_precision"
        # an FP8 weight is cast from the parameter itself (see linear_forward)
        self.from_master: bool = self.quantizing and self.keep_fp8
        self.fast_accum_fprop: bool = recipe is not None and recipe.fast_accum("fprop")
        self.fast_accum_dgrad: bool = recipe is not None and recipe.fast_accum("dgrad")
        self.fast_accum_wgrad: bool = recipe is not None and recipe.fast_accum("wgrad")


class OpContext:
    """One basic op's state for one forward/backward: its quantizers (those of the
    plan that ran the forward), the run configuration, and saved tensors. The
    backward's flags, ``needs_input_grad`` (a bool) and ``param_needs_grad`` (one
    bool per parameter), are set by the fuser before the op's backward runs."""

    __slots__ = ("op", "quantizers", "run", "saved", "needs_input_grad", "param_needs_grad")

    def __init__(self, op: "BasicOperation", quantizers: dict[str, "Quantizer"], run: RunConfig):
        self.op = op
        self.quantizers = quantizers
        self.run = run
        self.saved: dict[str, Any] = {}

    def quantizer(self, tensor_type: str) -> "Quantizer | None":
        return self.quantizers.get(tensor_type)


# te_fuser.epoch's counter: bumped whenever an op installs quantizers, or an op (or a
# composite of ops) gets a Parameter or a module hook registered or removed through
# nn.Module's methods, or the kernel backend changes; a fuser's compiled guard
# compares it in O(1) and hands any change to the Python path, which reads the
# parameter and hook dicts, the quantizers and the backend themselves.
_EPOCH = CHANGES


class _WatchedParameters(dict):
    """A module's ``_parameters`` dict that bumps :data:`_EPOCH` on every write, so a
    Parameter written straight into it (FSDP2's swaps, hand-made tying) is seen by
    the compiled guard like one set through ``setattr``. Reads are a plain dict's."""

    def __setitem__(self, name, value) -> None:
        super().__setitem__(name, value)
        _EPOCH[0] += 1

    def __delitem__(self, name) -> None:
        super().__delitem__(name)
        _EPOCH[0] += 1

    def pop(self, *args):
        _EPOCH[0] += 1
        return super().pop(*args)

    def popitem(self):
        _EPOCH[0] += 1
        return super().popitem()

    def setdefault(self, name, default=None):
        _EPOCH[0] += 1
        return super().setdefault(name, default)

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        _EPOCH[0] += 1

    def clear(self) -> None:
        super().clear()
        _EPOCH[0] += 1

    def __ior__(self, other):
        _EPOCH[0] += 1
        return super().__ior__(other)


class WatchedModule(nn.Module):
    """An ``nn.Module`` whose parameter and hook registrations, and any write into
    its parameter dict, bump :data:`_EPOCH`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_parameters", _WatchedParameters(self._parameters))
        # The parameters' names in the order first registered: the order the op reads and
        # returns gradients in, also while one of them is pruned or parametrized (the
        # fuser's parameter slots, ops/fuser.py)
        object.__setattr__(self, "_param_order", [])

    def register_parameter(self, name, param) -> None:
        super().register_parameter(name, param)
        order = self.__dict__.get("_param_order")
        if order is not None and name not in order:
            order.append(name)
        _EPOCH[0] += 1

    def __delattr__(self, name) -> None:
        super().__delattr__(name)
        _EPOCH[0] += 1

    def _apply(self, fn, recurse=True):  # .to() may replace Parameters (overwrite_module_params_on_conversion)
        out = super()._apply(fn, recurse)
        _EPOCH[0] += 1
        return out

    def _hook_registered(self, handle):
        _EPOCH[0] += 1
        return handle

    def register_forward_pre_hook(self, *args, **kwargs):
        return self._hook_registered(super().register_forward_pre_hook(*args, **kwargs))

    def register_forward_hook(self, *args, **kwargs):
        return self._hook_registered(super().register_forward_hook(*args, **kwargs))

    def register_full_backward_pre_hook(self, *args, **kwargs):
        return self._hook_registered(super().register_full_backward_pre_hook(*args, **kwargs))

    def register_full_backward_hook(self, *args, **kwargs):
        return self._hook_registered(super().register_full_backward_hook(*args, **kwargs))

    def register_backward_hook(self, *args, **kwargs):
        return self._hook_registered(super().register_backward_hook(*args, **kwargs))


# Plain per-op state that is neither a parameter, a buffer nor a module: set
# without nn.Module.__setattr__'s bookkeeping (it runs on every recipe switch).
_PLAIN_STATE = frozenset({"_quantizers", "_quantizer_key", "_loaded_state", "_weight_cache", "_own_fuser",
                          "_applied"})


_EXTRA = "_extra_state"


def extra_state_is_empty(state) -> bool:
    """Whether an op's extra state carries nothing: no scaling state, no pending
    checkpoint state and no applied recipe."""
    return not state or (not any(e["state"] for e in state.get("quantizers", {}).values())
                         and state.get("applied_recipe") is None)


def _drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    if extra_state_is_empty(state_dict.get(prefix + _EXTRA)):
        state_dict.pop(prefix + _EXTRA, None)


def _supply_missing_extra_state(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                error_msgs) -> None:
    state_dict.setdefault(prefix + _EXTRA, {})


def _take_state(quantizer: "Quantizer", entry: dict, recipe_key: str | None) -> None:
    if entry["recipe_key"] == recipe_key:
        quantizer.load_state_dict(entry["state"])
    else:
        quantizer.continue_from_state(entry["state"])


class BasicOperation(WatchedModule):
    """An op the fuser can plan with.

    Subclasses set ``module_type`` (the first field of their quantizer roles),
    ``forward_roles`` / ``backward_roles`` (tensor types they quantize), the
    number of extra inputs / outputs, and implement :meth:`op_forward` and
    :meth:`op_backward`. Called directly (``op(x)``), an op runs through its own
    one-op fuser and is exactly as correct as inside a ``Sequential``.
    """

    module_type: str = "op"
    forward_roles: tuple[str, ...] = ()
    backward_roles: tuple[str, ...] = ()
    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}(name=...): must be a string, got {type(name).__name__}")
        self.name = name or ""
        self._quantizers: dict[str, Quantizer] = {}
        self._quantizer_key: str | None = None
        self._loaded_state: dict | None = None  # quantizer state from a checkpoint, not yet applied
        self._own_fuser = None
        self._applied: tuple | None = None  # (the model's own recipe key, on_mismatched_load) from te.apply_recipe
        # An extra state that holds nothing is left out of the state dict, so that an op
        # without scaling state has the keys of its torch counterpart (nn.LayerNorm's, ...)
        self._register_state_dict_hook(_drop_empty_extra_state)
        self._register_load_state_dict_pre_hook(_supply_missing_extra_state)

    def __setattr__(self, name: str, value) -> None:
        if name in _PLAIN_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # -- quantizers -----------------------------------------------------------
    def roles(self) -> list[QuantizerRole]:
        return [QuantizerRole(self.module_type, t, self.name) for t in self.forward_roles + self.backward_roles]

    def quantizer(self, tensor_type: str) -> "Quantizer | None":
        """The quantizer installed for ``tensor_type`` (``'input'``, ``'weight'``...)."""
        if tensor_type not in self.forward_roles + self.backward_roles:
            raise ValueError(
                f"{self.describe()}: no quantizer role {tensor_type!r}; "
                f"roles are {list(self.forward_roles + self.backward_roles)}"
            )
        return self._quantizers.get(tensor_type)

    @property
    def installed_quantizers(self) -> dict[str, "Quantizer"]:
        """The installed quantizers by tensor role. Read only: publishing a plan
        installs a new dict, so holding this one tells whether that happened."""
        return self._quantizers

    @property
    def quantizer_key(self) -> "str | None":
        """The recipe key the installed quantizers were built for (None: none installed)."""
        return self._quantizer_key

    def snapshot_quantizers(self) -> QuantizerSnapshot:
        """The quantizers and their scaling state as they are now (see :meth:`restore_quantizers`)."""
        return QuantizerSnapshot(self._quantizers, self._quantizer_key, self._loaded_state,
                                 {t: q.state_dict() for t, q in self._quantizers.items()})

    def restore_quantizers(self, snapshot: QuantizerSnapshot) -> None:
        """Put back the quantizers of ``snapshot`` with the scaling state they had
        then; a cast kept by ``te.reuse_quantized_weights()`` is dropped."""
        self._quantizers, self._quantizer_key, self._loaded_state = snapshot[:3]
        for t, q in snapshot.quantizers.items():
            q.load_state_dict(snapshot.states[t])
        self.drop_caches()

    def install_quantizers(self, quantizers: dict[str, "Quantizer"], key: str) -> None:
        """Make ``quantizers`` this op's own, built for ``key`` (called on publish).
        A checkpointed state they took over (see :meth:`restore_loaded_state`) is
        no longer pending."""
        self._quantizers = quantizers
        self._quantizer_key = key
        self.apply_sequence_parallel_group()
        if self._loaded_state:  # a new dict: a snapshot (te.warmup) may hold the old one
            pending = {t: e for t, e in self._loaded_state.items()
                       if t not in quantizers or e["class"] != type(quantizers[t]).__qualname__}
            self._loaded_state = pending or None
        self.drop_caches()

    # Whether the op takes a Float8Tensor input as it is (a linear takes it as its FP8
    # operand, views keep it FP8); the fuser dequantizes one for every other op, whose
    # kernels read plain tensors.
    accepts_fp8_input = False

    # The process group this op's activations and gradients are sharded over along
    # their rows (tokens), set by ``te.sequence_parallel``; None: not sharded.
    sequence_parallel_group = None

    def apply_sequence_parallel_group(self) -> None:
        """Hand :attr:`sequence_parallel_group` to the installed quantizers of every
        role but the weights' (which every rank holds whole) that reduce over one."""
        for tensor_type, q in self._quantizers.items():
            if tensor_type != "weight" and hasattr(q, "sequence_parallel_group"):
                q.sequence_parallel_group = self.sequence_parallel_group

    # Whether the op casts a weight of its own (and may keep the cast: see drop_caches).
    casts_weights = False

    def drop_caches(self) -> None:
        """Forget cached quantized tensors (the weight cache of a linear)."""

    # -- checkpoints: the scaling state travels in the module's state_dict -----
    # The extra state maps each role to {"class", "state", "recipe_key"}: the state
    # of the installed quantizer when it holds one, else a checkpointed state not
    # yet taken over by a quantizer of its class (it waits for a recipe that builds
    # one, and is saved again meanwhile). So a forward in high precision, or under
    # a recipe whose quantizers keep no state, never drops scaling state.
    def get_extra_state(self) -> dict:
        entries = dict(self._loaded_state or {})
        for t, q in self._quantizers.items():
            state = q.state_dict()
            if state or t not in entries:
                entries[t] = {"class": type(q).__qualname__, "state": state, "recipe_key": self._quantizer_key}
        applied = self.__dict__.get("_applied")
        return {"recipe_key": self._quantizer_key, "quantizers": entries,
                "applied_recipe": None if applied is None else applied[0]}

    def set_extra_state(self, state: dict) -> None:
        """Take a checkpoint's scaling state: into the installed quantizers of the
        same class now (exactly when saved under the installed recipe, else
        continued as on a recipe switch: a delayed-scaling history is resized),
        and for the other roles when a recipe builds a quantizer of their class."""
        if not state:
            return
        self._check_applied_recipe(state.get("applied_recipe"))
        if not state.get("quantizers"):
            return
        pending = dict(self._loaded_state or {})
        for t, entry in state["quantizers"].items():
            entry = {"recipe_key": state.get("recipe_key"), **entry}
            q = self._quantizers.get(t)
            if q is not None and entry["class"] == type(q).__qualname__:
                _take_state(q, entry, self._quantizer_key)
                pending.pop(t, None)
            else:
                pending[t] = entry
        self._loaded_state = pending or None

    def mark_applied(self, recipe_key: "str | None", on_mismatched_load: str) -> None:
        """Record the model's own recipe (``te.apply_recipe``): saved with the scaling
        state, and checked (``on_mismatched_load``) when a checkpoint is loaded."""
        self._applied = (recipe_key, on_mismatched_load)

    def _check_applied_recipe(self, saved_key: str | None) -> None:
        """Report a checkpoint saved under another ``te.apply_recipe`` recipe than the
        one this model has (its scaling state still carries over, as on a switch)."""
        applied = self.__dict__.get("_applied")
        if applied is None or saved_key is None or saved_key == applied[0]:
            return
        key, policy = applied
        message = (f"te_fuser: a checkpoint saved under the recipe {saved_key} is loaded into a model whose "
                   f"recipe is {key} (te.apply_recipe); its scaling state carries over as on a recipe switch")
        if policy == "error":
            raise ValueError(f"{self.describe()}: {message}")
        if policy == "warn":
            warnings.warn(message, stacklevel=2)

    def restore_loaded_state(self, quantizer: "Quantizer", tensor_type: str, recipe_key: str) -> None:
        """Give ``quantizer`` (built for ``recipe_key``, not yet installed) the pending
        checkpointed state of ``tensor_type`` when it was saved by a quantizer of the
        same class: exactly under the same recipe, else continued."""
        entry = (self._loaded_state or {}).get(tensor_type)
        if entry is not None and entry["class"] == type(quantizer).__qualname__:
            _take_state(quantizer, entry, recipe_key)

    # -- planning -------------------------------------------------------------
    def check_shapes(self, in_shape: torch.Size, quantizers: dict[str, "Quantizer"]) -> torch.Size:
        """Validate this op for an input of ``in_shape``; return the output shape."""
        return in_shape

    def output_dtype(self, in_dtype: torch.dtype, compute_dtype: torch.dtype, extra_dtypes) -> torch.dtype:
        """The dtype of this op's output for an input of ``in_dtype`` (what a compiled
        graph is told before the op runs; most ops compute in the compute dtype)."""
        return compute_dtype

    def describe(self) -> str:
        return f"{type(self).__name__}({self.name!r})" if self.name else type(self).__name__

    # -- execution ------------------------------------------------------------
    def op_forward(self, ctx: OpContext, x: torch.Tensor, extra_inputs: Sequence[torch.Tensor]):
        """Return ``(y, extra_outputs)``; save what the backward needs in ``ctx``."""
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grad_extra_outputs: Sequence[torch.Tensor | None]):
        """Return ``(dx, param_grads, grad_extra_inputs)``; ``param_grads`` aligned
        with ``self.parameters()`` (``None`` where no gradient is needed)."""
        raise NotImplementedError

    # Whether :meth:`op_backward_adding` adds another gradient into dx inside the op's
    # own kernel. The fuser hands it the gradient of an extra input that is the
    # fuser's input itself (a residual, ``seq(x, x)``) when this op comes first, so
    # autograd does not add the two in a kernel of their own.
    adds_input_grad = False

    def op_backward_adding(self, ctx: OpContext, dy: torch.Tensor, grad_add: torch.Tensor):
        """``(dx + grad_add, param_grads)``, added in fp32 before dx's one rounding (an
        op without extra inputs or outputs; only where :attr:`adds_input_grad`)."""
        raise NotImplementedError

    # Uniform interface with FusedOperation: lists with one entry per basic op.
    def fuser_forward(self, ctxs, x, extra_inputs):
        y, extra_out = self.op_forward(ctxs[0], x, extra_inputs[0])
        return y, [extra_out]

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        dx, pgrads, dextra = self.op_backward(ctxs[0], dy, grad_extra_outputs[0])
        return dx, [pgrads], [dextra]

    @property
    def basic_ops(self) -> list["BasicOperation"]:
        return [self]

    def own_fuser(self):
        """The fuser that runs this op when it is called on its own (made on first use)."""
        if self._own_fuser is None:
            from .fuser import OperationFuser

            self._own_fuser = OperationFuser([self])
        return self._own_fuser

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        return (self._own_fuser or self.own_fuser())(x, *extra_inputs)


class FusedOperation:
    """A run of consecutive basic ops executed as one, in the forward or backward pass.

    The contract: a fused op is *equivalent to the unfused ops* — given the same
    inputs, parameters and quantizers it returns the same outputs and gradients,
    saves in each basic op's context what that op's own backward needs, and
    updates the same scaling state. Results may differ only by the roundings of
    intermediate tensors it no longer materialises (the compute dtype's rounding;
    bit-identical in high precision when nothing is skipped), which the tests
    bound with the central tolerance table.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        self._basic_ops = list(basic_ops)
        # the per-op extra outputs (or extra-input gradients) of ops that have none
        self.no_extras: tuple = ((),) * len(self._basic_ops)

    @property
    def basic_ops(self) -> list[BasicOperation]:
        return self._basic_ops

    def fuser_forward(self, ctxs, x, extra_inputs):
        raise NotImplementedError

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        raise NotImplementedError

    def describe(self) -> str:
        return f"{type(self).__name__}[{', '.join(op.describe() for op in self._basic_ops)}]"
