"""``Float8Tensor``: a ``torch.Tensor`` whose values are held in FP8.

The internal :class:`~te_fuser.quantization.tensor.QuantizedTensor` is plain
storage that the ops hand to the GEMM kernels. ``Float8Tensor`` is the public,
flowing type built on it: a wrapper tensor subclass (as TransformerEngine's
``Float8Tensor`` and torchao's float8 training tensor) that can be an op's input
or output, an autograd leaf (an FP8 parameter) or a non-leaf (``te.ops.Quantize``'s
output), and that every torch function accepts:

- ``dtype`` is the nominal high-precision dtype (what :meth:`dequantize` gives);
  the bytes held are FP8 data plus scales (:attr:`fp8_nbytes`);
- ``detach``/``alias`` and the views and reshapes that keep the last dim keep
  FP8 and share the values (the 2-D flattening ``(M, K)`` is unchanged, so every
  scaling stays exact); ``clone`` keeps FP8 too;
- a device move (``.to(device)``, ``.cuda()``) and ``empty_like`` (``Module.to_empty``)
  keep FP8, so a module's FP8 parameters stay FP8 parameters where it moves;
- every other function dequantizes its FP8 arguments and returns plain tensors;
- an in-place write (``copy_``, ``add_``, an optimizer's fused or foreach
  update) computes in high precision and casts the result back with the tensor's
  own quantizer: a tensor without one (an activation) refuses writes. An update
  that reads the values it writes (``lerp_``, ``add_``, ``mul_``, ...: an EMA copy of
  an FP8 model) keeps its high-precision result, and the next such update starts
  from it, so small updates accumulate as in high precision (one high-precision
  copy of that tensor kept); a write that replaces the values drops it.

The values live in a shared :class:`Float8Storage`: a write rebinds its
``QuantizedTensor`` (the copies are never written in place), so views and
``.data`` aliases see it, and whoever kept the old one can tell it changed.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map

from ..fp8 import short_name
from ..kernels.operand import ScaledOperand
from .tensor import QuantizedTensor

__all__ = ["Float8Tensor", "Float8Storage", "dequantized"]

aten = torch.ops.aten

# Functions whose result keeps the argument's FP8 values as they are.
_ALIASES = {aten.detach.default, aten.alias.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


class Float8Storage:
    """The FP8 values one tensor and its aliases share: ``q`` (a QuantizedTensor of
    the 2-D flattening), the ``quantizer`` that casts writes (``None``: read-only),
    ``writes``, bumped at every write, and ``source``: None or ``(value, q)``, the
    high-precision value a ``q`` was cast from (see :meth:`cast_from`): an in-place
    update's result (held), or an FP8 parameter's master (a weak reference: the
    optimizer holds it); ``q`` a weak reference too. ``init_value``: an FP8
    parameter's initial high-precision value on the CPU, where
    ``quantized_model_init(preserve_high_precision_init_val=True)`` kept one (it
    moves with the values, through device moves and ``to_empty``)."""

    __slots__ = ("q", "quantizer", "writes", "source", "init_value", "__weakref__")

    def __init__(self, q: QuantizedTensor, quantizer=None) -> None:
        if not isinstance(q, QuantizedTensor):
            raise TypeError(f"Float8Storage.q: must be a QuantizedTensor, got {type(q).__name__}")
        self.q, self.quantizer, self.writes, self.source, self.init_value = q, quantizer, 0, None, None

    def cast_from(self, held: bool | None = None) -> torch.Tensor | None:
        """The high-precision value the current FP8 values were cast from, where one
        is known: an in-place update's result, or a master recorded with
        :meth:`note_source`; None after any other write. ``held``: only a value
        noted so (True: an update's result; False: a master someone else holds)."""
        source = self.source
        if source is None or source[1]() is not self.q:
            return None
        value = source[0]
        weak = isinstance(value, weakref.ref)
        if held is not None and held == weak:
            return None
        return value() if weak else value

    def note_source(self, value: torch.Tensor, held: bool = True) -> None:
        """Record that the current FP8 values are the cast of ``value`` (``held``:
        keep it alive, else only while someone else does)."""
        self.source = (value if held else weakref.ref(value), weakref.ref(self.q))

    def write(self, value: torch.Tensor, quantizer=None) -> None:
        """Cast ``value`` (high precision, the storage's shape) as its new values,
        with ``quantizer`` (which then becomes the storage's) or its own."""
        quantizer = self.quantizer if quantizer is None else quantizer
        if quantizer is None:
            raise RuntimeError("Float8Tensor: this tensor has no quantizer to cast a write with (an FP8 activation "
                               "is read-only); dequantize() it and write the copy")
        columnwise = self.q.has_columnwise
        self.q = quantizer.cast(value.to(self.q.dtype) if value.dtype is not self.q.dtype else value,
                           rowwise=True, columnwise=columnwise)
        self.quantizer = quantizer
        self.writes += 1

    def adopt(self, q: QuantizedTensor, quantizer=None) -> None:
        """Take ``q`` (already cast) as the new values."""
        self.q = q
        if quantizer is not None:
            self.quantizer = quantizer
        self.writes += 1


class Float8Tensor(torch.Tensor):
    """A tensor of nominal ``dtype`` whose values are a :class:`Float8Storage`'s FP8
    copies (see the module doc)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, storage: Float8Storage, shape=None, requires_grad: bool = False):
        q = storage.q
        shape = q.shape if shape is None else torch.Size(shape)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=q.dtype, device=q.device, requires_grad=requires_grad)

    def __init__(self, storage: Float8Storage, shape=None, requires_grad: bool = False) -> None:
        self._storage = storage

    @classmethod
    def from_quantized(cls, q: QuantizedTensor, quantizer=None, requires_grad: bool = False) -> "Float8Tensor":
        return cls(Float8Storage(q, quantizer), requires_grad=requires_grad)

    # -- what the ops read ----------------------------------------------------------
    @property
    def fp8_storage(self) -> Float8Storage:
        return self._storage

    # ``p.data = new`` (``Module._apply`` of ``.cuda()`` / ``.to(device)`` sets it on
    # each parameter whose new value is of a compatible kind) re-points the tensor;
    # a Float8Tensor's values live in its storage, which must follow.
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, value)
        if type(value) is Float8Tensor:
            self._storage = value._storage

    def quantized(self) -> QuantizedTensor:
        """The FP8 copies as the internal QuantizedTensor of this tensor's shape."""
        q = self._storage.q
        if q.shape == self.shape:
            return q
        return QuantizedTensor(q.rowwise, q.columnwise, self.shape, q.dtype)

    # The copies as the internal QuantizedTensor names them (a quantizer's call
    # returns this tensor; code written against ``quantizer.cast`` reads the same).
    @property
    def rowwise(self) -> ScaledOperand | None:
        return self._storage.q.rowwise

    @property
    def columnwise(self) -> ScaledOperand | None:
        return self._storage.q.columnwise

    @property
    def has_rowwise(self) -> bool:
        return self._storage.q.rowwise is not None

    @property
    def has_columnwise(self) -> bool:
        return self._storage.q.columnwise is not None

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._storage.q.fp8_dtype

    @property
    def scaling(self) -> str:
        return self._storage.q.scaling

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values as a plain tensor of ``dtype`` (default the nominal dtype)."""
        return self._storage.q.dequantize(dtype).reshape(self.shape)

    def get_high_precision_init_val(self) -> torch.Tensor | None:
        """The initial high-precision value kept on the CPU by
        ``quantized_model_init(preserve_high_precision_init_val=True)``, else None."""
        return self._storage.init_value

    def clear_high_precision_init_val(self) -> None:
        self._storage.init_value = None

    @property
    def fp8_nbytes(self) -> int:
        """Bytes held: the FP8 data and scales of every copy."""
        return self._storage.q.nbytes

    def __repr__(self) -> str:
        q = self._storage.q
        return (f"Float8Tensor(shape={tuple(self.shape)}, dtype={short_name(self.dtype)}, "
                f"fp8={short_name(q.fp8_dtype)} {q.scaling}, nbytes={q.nbytes})")

    # -- checkpoints and copies ----------------------------------------------------------
    def __reduce_ex__(self, protocol):
        q = self._storage.q
        copies = tuple(None if op is None else (op.data, op.scale_inv, op.scaling) for op in (q.rowwise, q.columnwise))
        return (_rebuild, (copies, tuple(self.shape), q.shape, q.dtype, self.requires_grad))

    def __deepcopy__(self, memo):
        init = self._storage.init_value
        storage = _storage_copy(self._storage, torch.Tensor.clone, None if init is None else init.clone())
        out = Float8Tensor(storage, self.shape, self.requires_grad)
        memo[id(self)] = out
        return out

    # -- dispatch -----------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            (t,) = args
            return _alias(t._storage, t.shape)
        if func in _VIEWS:
            t, shape = args[0], _infer(args[1], args[0].numel())
            if shape and t.shape and shape[-1] == t.shape[-1]:
                return _alias(t._storage, shape)
        if func is aten.clone.default and type(args[0]) is Float8Tensor:
            t = args[0]
            return Float8Tensor(Float8Storage(t.quantized(), t._storage.quantizer), t.shape)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if type(dst) is Float8Tensor:
                _copy_into(dst, src)
                return dst
        if func in _MOVES and type(args[0]) is Float8Tensor and _keeps_fp8(args[0], kwargs):
            return _moved(args[0], kwargs, empty=func is aten.empty_like.default)
        written = _written_args(func, args, kwargs)
        if written:
            return _write_through(func, args, kwargs, written)
        return func(*tree_map(dequantized, args), **tree_map(dequantized, kwargs))


# A device move (``.to(device)``, ``.cuda()``) and ``empty_like`` (``Module.to_empty``
# of a model made on the meta device) keep FP8: a module's FP8 parameters stay FP8
# parameters, with the same quantizer, where the nominal dtype and layout stay.
_MOVES = {aten._to_copy.default, aten.empty_like.default}


def _keeps_fp8(t: "Float8Tensor", kwargs) -> bool:
    dtype, layout = kwargs.get("dtype"), kwargs.get("layout")
    return (dtype is None or dtype is t.dtype) and (layout is None or layout is torch.strided)


def _storage_copy(storage: Float8Storage, fn, init_value) -> Float8Storage:
    """A storage of ``fn`` applied to each of ``storage``'s data and scale tensors,
    with its quantizer and ``init_value``."""
    q = storage.q
    copies = [None if op is None else ScaledOperand(fn(op.data), fn(op.scale_inv), op.scaling)
              for op in (q.rowwise, q.columnwise)]
    out = Float8Storage(QuantizedTensor(copies[0], copies[1], q.shape, q.dtype), storage.quantizer)
    out.init_value = init_value
    return out


def _moved(t: "Float8Tensor", kwargs, empty: bool) -> "Float8Tensor":
    """``t``'s copies on ``kwargs['device']`` (or where they are): copied, or left
    uninitialised (``empty``: values to be written before use, as ``empty_like``'s)."""
    device = kwargs.get("device") or t.device
    non_blocking = bool(kwargs.get("non_blocking", False))

    def move(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x, device=device) if empty else x.to(device, non_blocking=non_blocking, copy=True)

    return Float8Tensor(_storage_copy(t._storage, move, t._storage.init_value), t.shape)


def _alias(storage: Float8Storage, shape) -> Float8Tensor:
    """A Float8Tensor of ``storage`` (a detach, alias or view). Under inference mode
    it is made outside it, so autograd can give it its source's version counter (an
    inference tensor has none to take)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return Float8Tensor(storage, shape)
    return Float8Tensor(storage, shape)


def dequantized(x):
    """``x`` with a Float8Tensor replaced by its plain high-precision value."""
    return x.dequantize() if type(x) is Float8Tensor else x


def _rebuild(copies, shape, q_shape, dtype, requires_grad):
    """A pickled Float8Tensor (``__reduce_ex__``): its copies' tensors and scaling
    names, shapes, nominal dtype; it makes nothing but these tensors' wrappers."""
    ops = [None if c is None else ScaledOperand(*c) for c in copies]
    q = QuantizedTensor(ops[0], ops[1], torch.Size(q_shape), dtype)
    return Float8Tensor(Float8Storage(q), shape, requires_grad)


# torch.load reads only allowed globals by default (weights_only): a state dict holding
# FP8 parameters loads as saved, without weights_only=False.
torch.serialization.add_safe_globals([_rebuild])


def _infer(shape, numel: int) -> torch.Size:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = numel // known if known else 0
    return torch.Size(shape)


def _copy_into(dst: Float8Tensor, src) -> None:
    """``dst.copy_(src)``: a Float8Tensor of the same flattening and format is
    adopted as it is (a checkpoint load keeps the exact bytes); anything else is
    cast by ``dst``'s quantizer."""
    storage = dst._storage
    if type(src) is Float8Tensor and src.shape == dst.shape and src.device == dst.device:
        q_src, q_dst = src._storage.q, storage.q
        if (q_src.fp8_dtype, q_src.scaling, q_src.dtype) == (q_dst.fp8_dtype, q_dst.scaling, q_dst.dtype) and (
                q_src.has_columnwise or not q_dst.has_columnwise):
            storage.adopt(QuantizedTensor(q_src.rowwise, q_src.columnwise if q_dst.has_columnwise else None,
                                          q_dst.shape, q_dst.dtype))
            return
    value = dequantized(src)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=dst.dtype, device=dst.device)
    value = value.to(device=dst.device, dtype=dst.dtype).expand(dst.shape)
    storage.write(value.reshape(storage.q.shape).contiguous())


def _written_args(func, args, kwargs) -> list:
    """The Float8Tensors that ``func`` writes (its schema's mutable arguments)."""
    written = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        written += [t for t in items if type(t) is Float8Tensor]
    return written


# In-place updates that read the values they write (an EMA's lerp, a decay's mul, an
# add): a storage they write keeps its high-precision result as its source, the next
# such update starts from it (or from an FP8 parameter's master, its source after a
# step). Repeated small updates then accumulate as in high
# precision (an EMA copy of an FP8 model: re-cast each update, such an EMA drifted
# 0.06 from the fp32 one in 200 steps), at the cost of that one high-precision copy.
# Writes that replace the values (fill_, uniform_, copy_, ...) keep none.
_UPDATES = {"add_", "sub_", "mul_", "div_", "lerp_", "addcmul_", "addcdiv_", "clamp_", "clamp_min_", "clamp_max_"}


def _updates(func) -> bool:
    name = func.overloadpacket.__name__
    return name.removeprefix("_foreach_") in _UPDATES


def _write_through(func, args, kwargs, written: list):
    """Run an in-place ``func`` on high-precision copies of its arguments (for an
    update, of the written ones' sources where they have them), then cast the
    written ones back into their storages."""
    update = _updates(func)
    proxies = {}
    for t in written:
        source = t._storage.cast_from() if update else None
        proxies[id(t)] = source.reshape(t.shape).clone() if source is not None else t.dequantize()

    def unwrap(x):
        if type(x) is Float8Tensor:
            return proxies.get(id(x), None) if id(x) in proxies else x.dequantize()
        return x

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    for t in written:
        storage, value = t._storage, proxies[id(t)].reshape(t._storage.q.shape)
        storage.write(value)
        if update:
            storage.note_source(value)
    back = {id(p): t for t in written for p in [proxies[id(t)]]}
    return tree_map(lambda x: back.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)
