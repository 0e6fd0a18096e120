"""FSDP2 all-gathers the linears' weights in FP8: ``te.enable_fsdp_fp8_all_gather(model)``.

    te.enable_fsdp_fp8_all_gather(model)    # before fully_shard and before the optimizer is made
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Under FSDP2 each rank holds a shard (a block of rows) of every weight and gathers
the whole weight before the forward (and again before the backward). A linear
that runs a per-tensor FP8 recipe (delayed or current scaling) casts that whole
weight to FP8 anyway, with one scale; casting each shard *before* the all-gather
with that same scale gives the same bytes and sends 1 byte per element instead of
2 (bf16) or 4 (fp32). The gathered FP8 weight is what the linear's GEMMs take: it
is not cast again. (torchao's ``enable_fsdp_float8_all_gather`` is the model.)

How it is done: the weight Parameter's data becomes a :class:`Float8AllGatherShard`,
a tensor subclass that FSDP2 shards like any tensor and whose
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks choose what goes on the
wire; the gathered Parameter FSDP2 hands the op is a :class:`GatheredWeight`.

The scale. Every rank computes the same one, from the state of the weight's
quantizer (the quantizer ``cast_shard``): delayed scaling casts with its current
scale, which the amax reduction keeps equal on every rank, and records the whole
weight's amax (the maximum of the shards' amaxes, which goes into the pending
reduction of the step: no collective of its own under the default reduction);
current scaling all-reduces the shard's amax (one small collective per weight
and forward) and takes the scale from the whole weight's amax. Casts are
elementwise, so the gathered bytes are those of a cast of the whole weight, and
the scaling state is the one a cast of the whole weight leaves.

When it is FP8, and when not. A forward's all-gather runs before the op's plan is
chosen (in FSDP2's pre-forward hook), so the gather predicts it: FP8 with the
op's installed weight quantizer when the op's last forward used that very
quantizer (per-tensor, FP8 GEMMs) and te.autocast does not name another recipe
(or disable FP8) now; otherwise high precision. So the first step after a recipe
switch, and every high-precision (e.g. bf16) forward, gather in high precision
and the op casts as usual; the step after, the new recipe's weights go in FP8.
The linear checks the prediction: a weight gathered in FP8 by another quantizer
than its plan's (a switch the gather could not see) is gathered again in high
precision, by a collective of the op's own. The FP8 weight is never stale: every
forward casts the shards afresh (after an optimizer step, a ``.data`` write or a
load alike); the backward's re-gather sends the bytes its forward sent (the
same weight, and no second amax record). The weight's gradient is the usual
one, reduce-scattered by FSDP2 to the high-precision sharded Parameter.

High precision gathers take the same FSDP2 buffer (FSDP2 fixes a parameter's
all-gather sizes at its first gather): its first byte per element goes through
FSDP2's all-gather, the rest through one all-gather of its own on the same group
(the same bytes on the wire as FSDP2's own high-precision gather, in the
``MixedPrecisionPolicy`` param dtype when one is set). Not supported: FSDP2's
``reshard_after_forward`` to a smaller mesh (an int), as for every all-gather
extension. With ``MixedPrecisionPolicy(param_dtype=bf16)`` the FP8 cast is from
the fp32 shard (one rounding), where the non-gathered path casts the bf16 copy.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..autocast import current_state
from ..kernels.formats import Scaling
from ..kernels.operand import ScaledOperand
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.tensor import QuantizedTensor
from ..quantization.delayed import EVALUATING
from .fp8_parameters import high_precision_start

__all__ = ["enable_fsdp_fp8_all_gather", "fp8_all_gather_stats", "Float8AllGatherShard", "GatheredWeight"]


# the one-tensor all-gather that FSDP2 calls: ``all_gather_single`` where torch has
# it (2.13 does), ``all_gather_into_tensor`` where not (2.11). Looked up at each
# call, so a wrapper put in its place (to count the bytes sent) sees ours too.
ALL_GATHER_NAME = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """``input`` of every rank of ``group``, concatenated along dim 0 into ``output``."""
    getattr(torch.distributed, ALL_GATHER_NAME)(output, input, group=group)


aten = torch.ops.aten

# What FSDP2 does to a sharded local tensor (chunk, pad, move, view) keeps the subclass.
_KEEPS_SUBCLASS = {
    aten.detach.default, aten.alias.default, aten.empty_like.default, aten.new_zeros.default,
    aten.slice.Tensor, aten.copy_.default, aten.view.default, aten.as_strided.default,
    aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor, aten.clone.default,
}


def _replaced(cls, args: tuple, kwargs: dict, get) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every ``cls`` instance ``t`` replaced by ``get(t)``:
    a loop over their items and one level of lists and tuples (what aten ops take;
    about a tenth of the pytree walk's host time), the pytree walk for anything
    nested deeper."""
    def one(a):
        if isinstance(a, cls):
            return get(a)
        if isinstance(a, (list, tuple)):
            if type(a) is torch.Size:
                return a
            if type(a) not in (list, tuple) or any(isinstance(x, (list, tuple, dict)) for x in a):
                raise _Nested  # a named tuple, or lists in a list
            return type(a)(get(x) if isinstance(x, cls) else x for x in a)
        if isinstance(a, dict):
            raise _Nested
        return a

    try:
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}
    except _Nested:
        return tree_map_only(cls, get, (args, kwargs))


class _Nested(Exception):
    """An op argument nested deeper than _replaced's loop looks."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _WeightGather:
    """What one weight's shards (every copy FSDP2 makes) and its gathered Parameter
    share: the quantizer its op's last forward wanted, the last forward gather (its
    kind, and in FP8 its bytes, scale and quantizer), this rank's padded shard and
    group for a gather of the op's own, the high-precision buffer, and counts."""

    __slots__ = ("name", "wanted", "state", "kind", "fp8", "padded", "group", "rows", "param_dtype", "hp_buffer",
                 "inner", "stats")

    def __init__(self, name: str) -> None:
        self.name = name
        self.wanted = None  # the weight quantizer of the op's last forward (None: high precision)
        self.state = None  # the te.autocast state it ran under
        self.kind = None  # "fp8" or "hp": the last forward gather's
        self.fp8 = None  # (shard data (rows_pad, K), scale_inv, quantizer) of the last FP8 forward gather
        self.padded = None  # this rank's shard, padded to FSDP2's shard rows
        self.group = None
        self.rows = 0  # the whole weight's
        self.param_dtype = None
        self.hp_buffer = None  # the gathered high-precision bytes, (world, bytes per shard)
        self.inner: list = []  # the tensors whose storage FSDP2 frees after resharding (FSDP2 keeps this list)
        self.stats = {"fp8": 0, "high_precision": 0, "regathered": 0}


class Float8AllGatherShard(torch.Tensor):
    """The data of a sharded weight Parameter that FSDP2 all-gathers in FP8 where its
    op runs a per-tensor FP8 recipe (see the module doc). It behaves as the
    high-precision tensor it wraps: every op unwraps it (an optimizer updates that
    tensor in place); the ops FSDP2 shards with keep the wrapper."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, gather: _WeightGather):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, gather: _WeightGather) -> None:
        self._data = data
        self._gather = gather

    def __repr__(self) -> str:
        return f"Float8AllGatherShard({self._data!r})"

    def __reduce_ex__(self, protocol):  # saved (torch.save, DCP) as the plain tensor it wraps
        return self._data.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_data"], self._gather

    @staticmethod
    def __tensor_unflatten__(inner, gather, outer_size, outer_stride):
        return Float8AllGatherShard(inner["_data"], gather)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        gather = None

        def unwrap(t):
            nonlocal gather
            gather = t._gather
            return t._data

        args, kwargs = _replaced(cls, args, kwargs or {}, unwrap)
        out = func(*args, **kwargs)
        if func not in _KEEPS_SUBCLASS:
            return out
        if isinstance(out, torch.Tensor):
            return cls(out, gather)
        return tree_map_only(torch.Tensor, lambda t: cls(t, gather), out)

    # -- FSDP2's all-gather extension ------------------------------------------------
    @property
    def fsdp_pre_all_gather(self) -> "_PreAllGather":
        """FSDP2's hook (:meth:`_pre_all_gather`), bound to this shard with its signature ready."""
        return _PreAllGather(self)

    def _pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The all-gather input: this shard in FP8 (as uint8, 1 byte per element), or
        the first byte per element of its high-precision bytes (the rest go through
        a collective of their own); padded to FSDP2's shard rows either way."""
        g = self._gather
        group, world = mesh.get_group(), mesh.size()
        rows = outer_size[0]
        shard = self._data
        padded_rows = math.ceil(rows / world)
        if shard.shape[0] != padded_rows:
            padded = shard.new_zeros((padded_rows, *shard.shape[1:]))
            padded[: shard.shape[0]].copy_(shard)
            shard = padded
        shard = shard.reshape(padded_rows, -1)  # (rows_pad, K)
        g.padded, g.group, g.rows = shard, group, rows
        g.param_dtype = mp_policy.param_dtype or shard.dtype
        again = _in_backward() and g.kind is not None  # the forward's weight again: the same bytes
        quantizer = None if again else _predicted_quantizer(module, g)
        kind = g.kind if again else ("fp8" if quantizer is not None else "hp")
        if kind == "fp8":
            if not again:
                was = EVALUATING[0]
                EVALUATING[0] = not module.training  # an evaluation forward's gather records nothing
                try:
                    data, scale_inv = quantizer.cast_shard(shard, group)
                finally:
                    EVALUATING[0] = was
                g.fp8 = (data, scale_inv, quantizer)
                g.stats["fp8"] += 1
            data, scale_inv, quantizer = g.fp8
            g.inner.clear()  # no high-precision buffer for FSDP2 to allocate
            g.hp_buffer = None
            g.kind = "fp8"
            return (data.view(torch.uint8),), ("fp8", scale_inv, quantizer, data.dtype)
        hp = shard.to(g.param_dtype).reshape(-1).view(torch.uint8)  # this shard's bytes
        head = hp[: shard.numel()]  # its first byte per element: FSDP2's all-gather
        tail = hp[shard.numel():]
        tails = torch.empty(world * tail.numel(), dtype=torch.uint8, device=shard.device)
        all_gather(tails, tail, group)
        if not again:
            g.kind = "hp"
            g.stats["high_precision"] += 1
        return (head.view(padded_rows, -1),), ("hp", tails, None, None)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: FP8 data (rows, K) with its scale, or the high-precision
        weight reassembled from FSDP2's bytes and the op's own."""
        g = self._gather
        (gathered,) = outputs  # (world * rows_pad, K) uint8
        kind, extra, quantizer, fp8_dtype = metadata
        rows = g.rows
        if kind == "fp8":
            fp8 = gathered.view(fp8_dtype)[:rows]  # (N, K)
            payload = (fp8, extra, quantizer, None)
        else:
            world = g.group.size()
            per_shard = gathered.numel() // world
            size = g.param_dtype.itemsize * per_shard
            if g.hp_buffer is None or g.hp_buffer.numel() != world * size:
                g.hp_buffer = torch.empty((world, size), dtype=torch.uint8, device=gathered.device)
                g.inner[:] = [g.hp_buffer]
            buffer = g.hp_buffer
            buffer[:, :per_shard].copy_(gathered.reshape(world, per_shard))
            buffer[:, per_shard:].copy_(extra.view(world, -1))
            hp = buffer.view(g.param_dtype).view(-1, gathered.shape[-1])[:rows]  # (N, K)
            payload = (None, None, None, hp)
        if out is not None:
            out._set(*payload)
            return None
        shape = (rows, *self.shape[1:])
        return GatheredWeight(*payload, shape, param_dtype, g), g.inner


class _PreAllGather:
    """A shard's ``fsdp_pre_all_gather``. FSDP2 reads the hook's signature at every
    all-gather (``inspect.signature``): of a bound method, inspect builds a new
    signature without ``self`` each time (tens of microseconds); of an object that
    carries its ``__signature__``, it returns that at once."""

    __slots__ = ("shard",)

    def __init__(self, shard: Float8AllGatherShard) -> None:
        self.shard = shard

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self.shard._pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


_CALL = inspect.signature(_PreAllGather.__call__)
_PreAllGather.__signature__ = _CALL.replace(parameters=list(_CALL.parameters.values())[1:])  # without self


def _predicted_quantizer(module, g: _WeightGather):
    """The weight quantizer the op's next forward will cast with, when it can take a
    weight gathered in FP8 (see the module doc); else None."""
    quantizers = getattr(module, "installed_quantizers", None) or {}
    installed = quantizers.get("weight")
    if installed is None or not installed.casts_shards:
        return None
    state = current_state()
    if state.named:  # the region's recipe, unless a subtree is pinned (then high precision: still right)
        recipe = state.active_recipe
        if (recipe is None or state.calibrating or recipe.backward_override == "high_precision"
                or recipe.key != module.quantizer_key):
            return None
        return installed
    # the model's own recipe or te.autocast's default: as the last forward, under the same region
    return installed if g.wanted is installed and g.state is state else None


class GatheredWeight(torch.Tensor):
    """The whole weight as FSDP2 gathered it, the Parameter its op computes with:
    FP8 data (N, K) cast by ``quantizer`` with ``scale_inv``, or the high-precision
    weight. The linear takes the FP8 data as its weight operand
    (:meth:`quantized`) or asks for the high-precision weight (:meth:`for_plan`);
    any other op sees its high-precision value (the FP8 data dequantized)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, fp8, scale_inv, quantizer, hp, shape, dtype, gather):
        device = (fp8 if fp8 is not None else hp).device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(self, fp8, scale_inv, quantizer, hp, shape, dtype, gather) -> None:
        self._gather = gather
        self._set(fp8, scale_inv, quantizer, hp)

    def _set(self, fp8, scale_inv, quantizer, hp) -> None:
        self._fp8, self._scale_inv, self._quantizer, self._hp = fp8, scale_inv, quantizer, hp

    def __repr__(self) -> str:
        kind = "fp8" if self._fp8 is not None else "high precision"
        return f"GatheredWeight({kind}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @property
    def is_fp8(self) -> bool:
        """Whether it was gathered in FP8 (else in high precision)."""
        return self._fp8 is not None

    @property
    def quantizer(self):
        """The quantizer that cast its shards (None: gathered in high precision)."""
        return self._quantizer

    def value(self) -> torch.Tensor:
        """Its high-precision value: the weight gathered in high precision, or the FP8
        data dequantized."""
        if self._hp is not None:
            return self._hp
        rowwise = ScaledOperand(self._fp8, self._scale_inv, Scaling.TENSOR)
        return QuantizedTensor(rowwise, None, self._fp8.shape, self.dtype).dequantize()

    def for_plan(self, quantizer) -> "torch.Tensor":
        """What the linear computes with under a plan whose weight quantizer is
        ``quantizer`` (None: a high-precision weight is needed): this weight when it
        holds that quantizer's FP8 cast, else the high-precision weight (gathered
        again by the op itself when this gather went FP8 for another quantizer)."""
        g = self._gather
        g.wanted, g.state = quantizer, current_state()
        if self._fp8 is None:
            return self._hp
        if quantizer is self._quantizer:
            return self
        g.stats["regathered"] += 1
        shard = g.padded.to(g.param_dtype)
        whole = torch.empty((g.group.size() * shard.shape[0], shard.shape[1]), dtype=shard.dtype, device=shard.device)
        all_gather(whole, shard, g.group)
        return whole[: g.rows].view(self.shape)

    def quantized(self, quantizer, columnwise: bool) -> QuantizedTensor:
        """The gathered FP8 weight as ``quantizer``'s cast of it (the column-wise copy,
        when asked, is the transposed bytes: one per-tensor scale)."""
        if quantizer is not self._quantizer:
            raise RuntimeError(f"GatheredWeight ({self._gather.name}): gathered in FP8 by {self._quantizer!r}, "
                               f"asked for {quantizer!r}'s cast")
        data = self._fp8  # (N, K)
        rowwise = ScaledOperand(data, self._scale_inv, Scaling.TENSOR)
        col = None
        if columnwise:
            col = ScaledOperand(data.view(torch.uint8).t().contiguous().view(data.dtype), self._scale_inv,
                                Scaling.TENSOR)  # (K, N)
        return QuantizedTensor(rowwise, col, data.shape, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
                    aten._unsafe_view.default):
            w = args[0]
            size = args[1] if len(args) > 1 else w.shape
            if tuple(size) == tuple(w.shape):  # FSDP2 and nn.Parameter make these of the whole weight
                return cls(w._fp8, w._scale_inv, w._quantizer, w._hp, w.shape, w.dtype, w._gather)
        args, kwargs = _replaced(cls, args, kwargs, lambda t: t.value())
        return func(*args, **kwargs)


def enable_fsdp_fp8_all_gather(model: nn.Module) -> nn.Module:
    """Make FSDP2 all-gather the weight of every te_fuser linear in ``model`` in FP8
    wherever it runs a per-tensor FP8 recipe (see the module doc). Call it before
    ``fully_shard`` and before the optimizer is made: each weight Parameter is
    replaced by one whose data is a :class:`Float8AllGatherShard` (a weight tied to
    several linears stays one Parameter). An FP8 parameter (made under
    ``te.quantized_model_init``) becomes its high-precision value: its master, else
    its preserved initial value, else its FP8 value, as its first optimizer step
    would start (FSDP2 keeps no FP8 parameter). Returns ``model``."""
    from .basic.linear import BasicLinear

    replaced: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        if not isinstance(module, BasicLinear):
            continue
        weight = module.weight
        if isinstance(weight, DTensor):
            raise RuntimeError(
                f"enable_fsdp_fp8_all_gather: {name or 'the model'}'s weight is already sharded; call it before "
                "fully_shard (FSDP2 reads the all-gather hooks from the tensor it shards)")
        if isinstance(weight.data, Float8AllGatherShard):
            continue
        new = replaced.get(id(weight))
        if new is None:
            # an FP8 parameter (te.quantized_model_init) continues in high precision from its master or start
            value = high_precision_start(weight) if type(weight) is Float8Tensor else weight.detach()
            data = Float8AllGatherShard(value, _WeightGather(name or "weight"))
            new = replaced[id(weight)] = nn.Parameter(data, requires_grad=weight.requires_grad)
        module.weight = new
        module._made_fp8 = False  # asked for: no warning that its FP8 parameter is gone
    if not replaced and not any(isinstance(m, BasicLinear) for m in model.modules()):
        raise ValueError(f"enable_fsdp_fp8_all_gather: {type(model).__name__} holds no te_fuser linear")
    return model


def _gathers(model: nn.Module):
    seen = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            data = getattr(p, "_local_tensor", p)
            data = data if isinstance(data, (Float8AllGatherShard, GatheredWeight)) else getattr(p, "data", None)
            g = getattr(data, "_gather", None)
            if isinstance(g, _WeightGather) and id(g) not in seen:
                seen.add(id(g))
                yield g


def fp8_all_gather_stats(model: nn.Module) -> dict[str, int]:
    """How many forward all-gathers of ``model``'s weights went in FP8 and in high
    precision, and how many FP8 gathers the linear gathered again in high precision
    (a recipe switch the gather could not foresee), summed over its weights."""
    total = {"fp8": 0, "high_precision": 0, "regathered": 0}
    for g in _gathers(model):
        for k, v in g.stats.items():
            total[k] += v
    return total

