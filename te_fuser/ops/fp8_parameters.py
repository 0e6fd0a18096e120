"""FP8 parameters: ``te.quantized_model_init(enabled=True, recipe=...)``.

    with te.quantized_model_init(enabled=True, recipe=te.recipe.Float8CurrentScaling()):
        model = te.ops.Sequential(te.ops.Linear(1024, 4096), te.ops.GELU(), te.ops.Linear(4096, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)   # any torch optimizer

Linear ops created inside the block hold their weight as a :class:`Float8Tensor`
Parameter (TransformerEngine's way): 1 byte per element plus its scales, instead
of 2 (bf16) or 4 (fp32). Its nominal ``dtype`` is the dtype the op was made with.

The high-precision master copy. Updating FP8 values in place would lose every
update smaller than half an FP8 step, so the optimizer never updates them: around
every ``torch.optim.Optimizer`` step (torch's global step pre/post hooks, so fused,
foreach and for-loop steps alike) each FP8 parameter in the optimizer's groups is
replaced by its master copy (a plain tensor of the nominal dtype, given the FP8
parameter's gradient), the step updates the master, and the parameter is put
back and cast afresh from the master by its quantizer. The master lives in the
optimizer's state (``optimizer.state[p]['master']``, so ``optimizer.state_dict()``
checkpoints it), not in the model: the model's weight bytes are the FP8 bytes, and
the master is optimizer memory, as TransformerEngine's optimizers with master
weights keep it. At the first step the master is the parameter's initial
high-precision value when ``preserve_high_precision_init_val`` kept it and its
cast still gives the parameter's bytes (then that CPU copy is released), else the
parameter's dequantized value (the FP8 value *is* the weight the model was
initialised with). The first is the better start for training: weights that sit
exactly on the FP8 grid keep their FP8 values through every update smaller than
half a grid step, where off-grid weights cross a rounding boundary in proportion
to the update (on the yardstick GPT, 30 steps from the dequantized start trailed
the fp32 start by 0.11 bpb; RESULTS.md run 57).

Never stale, either way round:

- the forward uses the parameter's own FP8 copy without a cast when its
  quantizer casts as the plan's weight quantizer does (same scheme, format and
  options; a stateless scheme). Otherwise (a recipe switch) a stateless plan
  quantizer re-casts the parameter in place from the master (or, before any
  step, from the FP8 value) and the parameter keeps the new recipe; a delayed
  scaling plan casts from the master at every forward, as for any weight. The
  column-wise copy of the backward is made per forward (the transposed bytes for a
  per-tensor scale, else a cast from the master) and never kept;
- a master is used only while it is provably the parameter's source: the
  parameter's values are still the ones cast from it, or a cast of it gives the
  parameter's bytes exactly (a checkpoint just loaded). A write to the parameter
  (``p.copy_``, ``p.data.copy_``, ``load_state_dict``) makes the next step start
  from the written value.

If an optimizer step raises, the masters stay in its groups (torch runs no post
hook after a failed step); ``restore_fp8_parameters(optimizer)`` puts them back.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand
from ..quantization import DelayedScalingQuantizer, Float8CurrentScalingQuantizer, QuantizerRole, quantizer_for
from ..quantization.float8_tensor import Float8Storage, Float8Tensor
from ..quantization.tensor import QuantizedTensor
from ..recipe import Recipe

__all__ = ["quantized_model_init", "fp8_model_init", "fp8_init_recipe", "make_fp8_parameter", "fp8_weight",
           "fp8_weight_replaced", "high_precision_start", "parameter_bytes", "restore_fp8_parameters", "master_of",
           "snapshot_fp8_parameters", "restore_fp8_parameter_snapshot"]


class _InitState:
    stack: list = []  # (enabled, recipe, preserve_high_precision_init_val)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Recipe | None = None,
                         preserve_high_precision_init_val: bool = False):
    """Linear ops created inside hold FP8 weights (see the module doc). ``recipe``
    (default :data:`te.DEFAULT_RECIPE`) gives the weights' format and scaling;
    with ``preserve_high_precision_init_val`` each FP8 weight keeps its initial
    high-precision value on the CPU (``get_high_precision_init_val()``,
    ``clear_high_precision_init_val()``), as TransformerEngine's."""
    for name, value in (("enabled", enabled), ("preserve_high_precision_init_val", preserve_high_precision_init_val)):
        if not isinstance(value, bool):
            raise TypeError(f"quantized_model_init.{name}: must be True or False, got {value!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"quantized_model_init.recipe: must be a te_fuser Recipe or None, got {type(recipe).__name__}")
    if enabled and recipe is None:
        from ..autocast import DEFAULT_RECIPE
        recipe = DEFAULT_RECIPE
    _InitState.stack.append((enabled, recipe, preserve_high_precision_init_val))
    try:
        yield
    finally:
        _InitState.stack.pop()


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False):
    """TransformerEngine's older name of :func:`quantized_model_init` (deprecated there too)."""
    warnings.warn("fp8_model_init is deprecated; use quantized_model_init(enabled=..., recipe=...)",
                  DeprecationWarning, stacklevel=3)
    with quantized_model_init(enabled, recipe, preserve_high_precision_init_val):
        yield


def fp8_init_recipe() -> "tuple[Recipe, bool] | None":
    """``(recipe, preserve the init value)`` inside an enabled ``quantized_model_init``, else None."""
    if not _InitState.stack or not _InitState.stack[-1][0]:
        return None
    _, recipe, preserve = _InitState.stack[-1]
    return recipe, preserve


def _storage_quantizer(recipe: Recipe, role: QuantizerRole):
    """The quantizer that casts a weight's stored copy: the recipe's own, except
    that delayed scaling (whose cast depends on the forwards' amax history) stores
    a per-tensor current-scaled copy of the same format."""
    quantizer = quantizer_for(recipe, role)
    if quantizer.fp8_dtype is None:
        raise ValueError(f"quantized_model_init: recipe {recipe!r} does not cast {role} to FP8")
    if isinstance(quantizer, DelayedScalingQuantizer):
        quantizer = Float8CurrentScalingQuantizer(quantizer.fp8_dtype, role=role)
    return quantizer


def fp8_weight_replaced(op, weight: torch.Tensor) -> None:
    """Warn, once for ``op``, that the FP8 parameter it was made with is no longer
    its weight: FSDP2's ``fully_shard`` stores every parameter's shards as plain
    tensors (it keeps no FP8 parameter), and a weight assigned after construction
    replaces it. Training goes on correctly, the weight cast at every forward like
    any high-precision weight, but its bytes are no longer FP8's, which the user
    chose ``quantized_model_init`` for. (``te.enable_fsdp_fp8_all_gather`` replaces
    FP8 parameters too, by request: it says nothing.)"""
    op._made_fp8 = False
    warnings.warn(
        f"{op.describe()}: made under te.quantized_model_init, its weight is now a plain "
        f"{str(weight.dtype).removeprefix('torch.')} tensor, not an FP8 parameter (FSDP2's fully_shard keeps no FP8 "
        f"parameter; assigning a new weight replaces it). It trains correctly, cast at every forward like any "
        f"weight, without FP8 parameters' memory. Under FSDP2, call te.enable_fsdp_fp8_all_gather(model) before "
        f"fully_shard: the weights then go over the wire in FP8",
        UserWarning, stacklevel=2)


def make_fp8_parameter(weight: torch.Tensor, recipe: Recipe, role: QuantizerRole, preserve: bool = False):
    """An FP8 Parameter holding ``weight`` (high precision) cast under ``recipe``."""
    quantizer = _storage_quantizer(recipe, role)
    with torch.no_grad():
        w_hp = weight.detach()
        q = quantizer.cast(w_hp, rowwise=True, columnwise=False)
    param = nn.Parameter(Float8Tensor(Float8Storage(q, quantizer)), requires_grad=weight.requires_grad)
    if preserve and not w_hp.is_meta:  # on the meta device there is no value yet: reset_parameters keeps it
        param.fp8_storage.init_value = w_hp.cpu().clone()
    return param


# -- masters ---------------------------------------------------------------------------
# A master is its storage's source (Float8Storage.note_source, held weakly: the
# optimizer holds it) while the storage's values are still its cast.


def _is_source(storage: Float8Storage, master: torch.Tensor) -> bool:
    if storage.cast_from(held=False) is master:
        return True
    # a master from elsewhere (a loaded optimizer checkpoint): trusted if it casts to these very bytes
    q = storage.q
    if storage.quantizer is None or master.shape != q.shape or master.dtype is not q.dtype:
        return False
    with torch.no_grad():
        cast = storage.quantizer.cast(master.reshape(-1, master.shape[-1]), rowwise=True, columnwise=False)
    same = torch.equal(cast.rowwise.data.view(torch.uint8), q.rowwise.data.view(torch.uint8)) and torch.equal(
        cast.rowwise.scale_inv, q.rowwise.scale_inv) if q.rowwise is not None else False
    if same:
        _record(storage, master)
    return same


def _record(storage: Float8Storage, master: torch.Tensor) -> None:
    storage.note_source(master, held=False)  # an in-place update of the parameter starts from it too


def master_of(param: Float8Tensor) -> torch.Tensor | None:
    """The master copy that is ``param``'s source now, if one is known."""
    return param.fp8_storage.cast_from(held=False)


def _high_precision(param: Float8Tensor) -> torch.Tensor:
    """The parameter's value in high precision (2-D flattening): its master, else its FP8 value."""
    master = master_of(param)
    value = master if master is not None else param.dequantize()
    return value.reshape(param.fp8_storage.q.shape)


# -- the optimizer step -------------------------------------------------------------------
_SWAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _before_step(optimizer, args, kwargs) -> None:
    swaps = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if type(p) is not Float8Tensor:
                continue
            state = optimizer.state.pop(p, {})
            master = state.pop("master", None)
            if master is None:
                master = _initial_master(p)
            elif not _is_source(p.fp8_storage, master):  # written since: from what was written
                master = _written_value(p)
            master.grad = p.grad
            optimizer.state[master] = state
            params[i] = master
            swaps.append((params, i, p, master))
    if swaps:
        _SWAPS[optimizer] = swaps


def _written_value(p: Float8Tensor) -> torch.Tensor:
    """A written parameter's value in high precision: an in-place update's result
    (``Float8Storage.cast_from``), else its FP8 value."""
    updated = p.fp8_storage.cast_from()
    return updated.reshape(p.shape).clone() if updated is not None else p.dequantize().contiguous()


def _initial_master(p: Float8Tensor) -> torch.Tensor:
    """The first step's master: the preserved initial value while it is the
    parameter's source (its cast gives the parameter's bytes), else the written
    value (:func:`_written_value`)."""
    init = p.get_high_precision_init_val()
    if init is not None:
        candidate = init.to(device=p.device, dtype=p.dtype).reshape(p.shape).contiguous()
        if _is_source(p.fp8_storage, candidate):
            p.clear_high_precision_init_val()
            return candidate
    return _written_value(p)


def high_precision_start(p: Float8Tensor) -> torch.Tensor:
    """The high-precision value an FP8 parameter continues from where it stops being
    one (``te.enable_fsdp_fp8_all_gather``): its master while that is its source, else
    as the first optimizer step would start (the preserved initial value, else the
    FP8 value)."""
    master = master_of(p)
    return master.detach().reshape(p.shape).clone() if master is not None else _initial_master(p)


def _after_step(optimizer, args, kwargs) -> None:
    restore_fp8_parameters(optimizer)


def restore_fp8_parameters(optimizer) -> None:
    """Put the FP8 parameters back into ``optimizer``'s groups after a step, cast from
    their masters (torch's step post hook does it; call it after a step that raised)."""
    swaps = _SWAPS.pop(optimizer, ())
    for params, i, p, master in swaps:
        params[i] = p
        state = optimizer.state.pop(master, {})
        state["master"] = master
        optimizer.state[p] = state
        master.grad = None
        storage = p.fp8_storage
        with torch.no_grad():
            storage.write(master.reshape(storage.q.shape))
        _record(storage, master)


_PRE_HOOK = register_optimizer_step_pre_hook(_before_step)
_POST_HOOK = register_optimizer_step_post_hook(_after_step)


# -- a run that must leave no trace (te.warmup) ------------------------------------------
def snapshot_fp8_parameters(module: nn.Module) -> list:
    """What a forward may change in ``module``'s FP8 parameters: each storage's
    copies, its quantizer and its known master (a plan of another recipe re-casts
    the parameter into its layout); :func:`restore_fp8_parameter_snapshot` puts
    them back."""
    return [(p.fp8_storage, p.fp8_storage.q, p.fp8_storage.quantizer, master_of(p))
            for p in module.parameters() if type(p) is Float8Tensor]


def restore_fp8_parameter_snapshot(saved: list) -> None:
    for storage, q, quantizer, master in saved:
        if storage.q is not q or storage.quantizer is not quantizer:
            storage.adopt(q, quantizer)  # the bytes as they were; ``writes`` moves on, so caches look again
        if master is not None:
            _record(storage, master)


# -- the forward's FP8 weight --------------------------------------------------------------
def _casts_alike(a, b) -> bool:
    """Whether quantizers ``a`` and ``b`` cast a tensor to the same bytes: the same
    stateless scheme with the same options."""
    if a is b:
        return not a.STATE_TENSORS
    return (type(a) is type(b) and not a.STATE_TENSORS and a.fp8_dtype == b.fp8_dtype
            and a.describe() == b.describe())


def fp8_weight(quantizer, weight: Float8Tensor, need_columnwise: bool):
    """The FP8 weight operand of a forward whose plan casts weights by ``quantizer``
    (see the module doc): the parameter's own copy where it casts alike, else a
    fresh cast; with the column-wise copy when asked."""
    storage = weight.fp8_storage
    if quantizer.fp8_dtype is None:  # a plan that keeps weights in high precision
        return _high_precision(weight).reshape(weight.shape)
    if not _casts_alike(storage.quantizer, quantizer):
        master = master_of(weight)
        value = _high_precision(weight)
        if quantizer.STATE_TENSORS:  # delayed scaling: a cast of its own, every forward
            return quantizer.cast(value, rowwise=True, columnwise=need_columnwise)
        storage.write(value, quantizer)  # the parameter moves to the plan's recipe
        if master is not None:
            _record(storage, master)
    q = storage.q
    if need_columnwise and not q.has_columnwise:
        q = QuantizedTensor(q.rowwise, _columnwise_copy(weight, q), q.shape, q.dtype)
    return q


def _columnwise_copy(weight: Float8Tensor, q: QuantizedTensor) -> ScaledOperand:
    row = q.rowwise
    if row.scaling == Scaling.TENSOR:  # one scale: the column-wise copy is the transposed bytes
        return ScaledOperand(row.data.t().contiguous(), row.scale_inv, Scaling.TENSOR)  # (K, M)
    return weight.fp8_storage.quantizer.cast(_high_precision(weight), rowwise=False, columnwise=True).columnwise


# -- memory ------------------------------------------------------------------------------
def parameter_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers (FP8 parameters: their FP8
    data and scales; shared tensors counted once)."""
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.fp8_nbytes if type(t) is Float8Tensor else t.untyped_storage().nbytes()
    return total
