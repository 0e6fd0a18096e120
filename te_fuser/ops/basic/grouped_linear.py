"""GroupedLinear: G linear layers over consecutive row groups (mixture-of-experts experts).

``y_g = x_g · w_gᵀ + b_g`` where ``x_g`` are the rows ``offsets[g]:offsets[g+1]`` of
x (M, K), the split sizes given as the op's extra input (TransformerEngine's
``te.ops.GroupedLinear(num_groups, in_features, out_features)`` called as
``op(x, split_sizes)``). The three GEMMs of each group, as in ``BasicLinear``:

- fprop ``y_g  = x_g · w_gᵀ``   x row-wise (input quantizer),  w_g row-wise (weight quantizer)
- dgrad ``dx_g = dy_g · w_g``   dy row-wise (grad_output),     w_g column-wise
- wgrad ``dw_g = dy_gᵀ · x_g``  dy column-wise (grad_output),  x column-wise; the grouped dim is the reduction

With ``scale_bias=True`` (TransformerEngine's; only with a bias) the op takes a
second extra input, one scale per token (a router's probabilities, shape (M,)),
and adds ``b_g · scale`` to each row instead of ``b_g``, ``op(x, split_sizes,
scales)``; the scales get their gradient (``dy_row · b_g``) and the bias the
scale-weighted column sums of dy, both summed in fp32.

With tensor or row scales (delayed, current, row-wise scaling) x and dy are cast
once, whole (the column-wise copies transposed, so every GEMM's reduction dim is
contiguous, the wgrad's too), and each GEMM runs either as one grouped kernel for
all experts (``grouped_gemm``, ``grouped_gemm_wgrad``: the experts' weights stacked
as one (G·N, K) operand) or as a loop of the dense FP8 GEMM, one per non-empty
group (:func:`grouped_gemm_dispatch`, :func:`grouped_gemm_wgrad_dispatch`).
:data:`LOOP_RULE` picks per call, from the split sizes the host holds anyway: the
loop needs a launch per group, so it pays only when each GEMM keeps the GPU busy
longer than the host takes to launch the next. On one H200 (ms, GPU time, G = 8,
bf16 out; the kernels alone, RESULTS.md run 56):

| case (FLOPs per GEMM) | fprop grouped (Triton) | fprop loop (cuBLASLt) | wgrad grouped | wgrad loop |
|---|---|---|---|---|
| 8 x 2048 tokens, K = 4096, N = 14336 (241 G) | 2.754 | 1.724 | 2.522 | 2.217 |
| 8 x 1024 tokens, K = N = 4096 (34 G) | 0.361 | 0.265 | 0.440 | 0.479 |
| 8 x 512 tokens, K = N = 4096 (17 G) | 0.175 | 0.129 | 0.316 | 0.357 |
| 8 x 128 tokens, K = N = 1024 (0.27 G) | 0.058 | 0.179 | 0.020 | 0.324 |

So the rule takes the loop from 2**34 FLOPs (17 G) per non-empty GEMM on average
for the fprop and dgrad, and from 2**37 (137 G) for the wgrad, whose grouped
kernel keeps up longer; on CUDA, when the dense GEMM runs on cuBLASLt (the
``cuda`` backend) and cuBLASLt takes the shapes (dims multiples of 16; in the
wgrad each group's token count too). The loop multiplies as the
grouped kernel does (no fast accumulation: products promoted to fp32 as
cuBLASLt's default); results agree to the FP8 tensor cores' accumulation
(``fp8_gemm_tensor_core`` in the tests' table), and bit for bit where both sum
exactly (the CPU tests, on representable data).

A weight quantizer that keeps scaling state (delayed scaling's amax history)
casts the stacked weights as one tensor, so its history records one amax per
step; a stateless one casts each expert's weight for a scale of its own. Block
and MXFP8 scales do not slice along a group boundary that is not a tile
boundary, so those recipes cast each group and run the dense FP8 GEMM per group
(MXFP8 needs every split size a multiple of 32). Without a recipe (or with
identity quantizers) the groups run as torch linears in the compute dtype, like
``BasicLinear``'s high-precision path.

Parameters follow TransformerEngine: ``weight0`` ... ``weight{G-1}`` (N, K) and
``bias0`` ... ``bias{G-1}`` (N,). The split sizes are read on the host (a device
tensor of them costs a synchronisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ... import backend
from ...kernels.formats import Scaling
from ...kernels.operand import ScaledOperand
from ...quantization.tensor import QuantizedTensor
from ..gemm import columnwise, gemm, rowwise
from ..op import BasicOperation, OpContext
from .linear import init_linear_weight

__all__ = ["GroupedLinear", "Groups", "Experts", "LoopRule", "LOOP_RULE", "grouped_gemm_dispatch",
           "grouped_gemm_wgrad_dispatch", "fprop_path", "wgrad_path"]

_GROUPED_SCALINGS = (Scaling.TENSOR, Scaling.ROW)


class GroupedLinear(BasicOperation):
    module_type = "linear"
    casts_weights = True
    forward_roles = ("input", "weight")
    backward_roles = ("grad_output",)
    num_extra_inputs = 1  # the split sizes (and, with scale_bias, the bias scales: 2 on the instance)

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 scale_bias: bool = False, device=None, dtype=None, name=None) -> None:
        super().__init__(name)
        for field, value in (("num_groups", num_groups), ("in_features", in_features),
                             ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedLinear.{field}: must be a positive integer, got {value!r}")
        for field, value in (("bias", bias), ("scale_bias", scale_bias)):
            if not isinstance(value, bool):
                raise TypeError(f"GroupedLinear.{field}: must be a bool, got {type(value).__name__}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bias
        self.scale_bias = scale_bias and bias  # as TransformerEngine: without a bias there is nothing to scale
        if self.scale_bias:
            self.num_extra_inputs = 2
        for g in range(num_groups):
            self.register_parameter(f"weight{g}", nn.Parameter(torch.empty(out_features, in_features, device=device,
                                                                            dtype=dtype)))
        for g in range(num_groups):
            b = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
            self.register_parameter(f"bias{g}", b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each group's weight drawn again as ``torch.nn.Linear``'s and its bias 0, in
        place (after ``to_empty``, or to start over)."""
        for w in self.weights:
            init_linear_weight(w)
        with torch.no_grad():
            for b in self.biases:
                b.zero_()

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}"
                + (", scale_bias=True" if self.scale_bias else ""))

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{g}") for g in range(self.num_groups)]

    @property
    def biases(self) -> list[nn.Parameter]:
        return [getattr(self, f"bias{g}") for g in range(self.num_groups)] if self.use_bias else []

    def check_shapes(self, in_shape, quantizers):
        if len(in_shape) < 2 or in_shape[-1] != self.in_features:
            raise ValueError(f"{self.describe()}: input shape {tuple(in_shape)} needs at least 2 dims and a last "
                             f"dim of in_features={self.in_features}")
        q = quantizers.get("weight")
        if q is not None:
            q.check_shape((self.out_features, self.in_features), rowwise=True, columnwise=True)
        return torch.Size((*in_shape[:-1], self.out_features))

    def split_bounds(self, split_sizes, rows: int) -> list[int]:
        """The groups' row offsets ``[0, s0, s0+s1, ..., rows]`` from the extra input."""
        if isinstance(split_sizes, torch.Tensor):
            if split_sizes.dim() != 1 or split_sizes.dtype.is_floating_point or split_sizes.is_complex():
                raise ValueError(f"{self.describe()}: split_sizes must be a 1-D integer tensor, got shape "
                                 f"{tuple(split_sizes.shape)} of {split_sizes.dtype}")
            sizes = split_sizes.tolist()
        elif isinstance(split_sizes, (list, tuple)):
            sizes = list(split_sizes)
        else:
            raise TypeError(f"{self.describe()}: split_sizes must be an integer tensor, got "
                            f"{type(split_sizes).__name__}")
        if len(sizes) != self.num_groups or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                for s in sizes):
            raise ValueError(f"{self.describe()}: split_sizes must be {self.num_groups} non-negative integers "
                             f"(num_groups), got {sizes}")
        if sum(sizes) != rows:
            raise ValueError(f"{self.describe()}: split_sizes {sizes} sum to {sum(sizes)}, but the input has "
                             f"{rows} rows")
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        return bounds

    def bias_scales(self, scales, x: torch.Tensor) -> torch.Tensor:
        """The scale_bias extra input, checked, as one scale per token (M,): shape
        (M,) as TransformerEngine takes it, or the input's shape without its last dim."""
        tokens = tuple(x.shape[:-1])
        rows = math.prod(tokens)
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"{self.describe()}: scale_bias takes the bias scales as a tensor (one per token), "
                            f"got {type(scales).__name__}")
        if not scales.dtype.is_floating_point:
            raise TypeError(f"{self.describe()}: the bias scales must be a floating tensor, got {scales.dtype}")
        if tuple(scales.shape) not in ((rows,), tokens):
            raise ValueError(f"{self.describe()}: the bias scales must have shape ({rows},), one per token, got "
                             f"{tuple(scales.shape)}")
        if scales.device != x.device:
            raise ValueError(f"{self.describe()}: the bias scales are on {scales.device} but the input is on "
                             f"{x.device}")
        return scales.reshape(rows)

    def op_forward(self, ctx: OpContext, x, extra_inputs: Sequence[torch.Tensor]):
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        bounds = self.split_bounds(extra_inputs[0], x2d.shape[0])
        scales = self.bias_scales(extra_inputs[1], x) if self.scale_bias else None  # (M,)
        dtype = ctx.run.compute_dtype
        if x2d.dtype is not dtype:
            x2d = x2d.to(dtype)
        path = _path(ctx)
        if path == "per_group":
            _check_group_shapes(ctx, self, bounds)  # before any cast changes state
        groups = Groups(bounds, x2d.device)
        y2d = _FORWARDS[path](ctx, self, x2d, groups, scales)  # (M, N)
        if ctx.run.needs_backward:
            ctx.saved.update(path=path, groups=groups, x_shape=x.shape, w_dtype=self.weight0.dtype)
            if scales is not None:
                ctx.saved.update(scales=scales, scales_in=extra_inputs[1], biases=_biases(self, dtype))
        return y2d.reshape(*x.shape[:-1], self.out_features), []

    def op_backward(self, ctx: OpContext, dy, grad_extra_outputs):
        saved = ctx.saved
        dy2d = dy.reshape(-1, self.out_features)  # (M, N)
        dtype = ctx.run.compute_dtype
        if dy2d.dtype is not dtype:
            dy2d = dy2d.to(dtype)
        g = self.num_groups
        need = ctx.param_needs_grad or (True,) * len(list(self.parameters()))
        need_dx, need_dw, need_db = ctx.needs_input_grad, any(need[:g]), any(need[g:])
        dx2d, dws = _BACKWARDS[saved["path"]](ctx, self, dy2d, need_dx, need_dw)
        dx = None if dx2d is None else dx2d.reshape(saved["x_shape"])
        bounds = saved["groups"].bounds
        if not self.scale_bias:
            dbs = _bias_grads(dy2d, bounds, self.biases) if need_db else [None] * len(self.biases)
            return dx, list(dws if dws is not None else [None] * g) + list(dbs), [None]
        scales_in = saved["scales_in"]
        dbs, d_scales = _scaled_bias_grads(dy2d, bounds, saved["biases"], saved["scales"], need_db,
                                           scales_in.requires_grad)
        dbs = [db if db is None or db.dtype is b.dtype else db.to(b.dtype) for db, b in zip(dbs, self.biases)]
        if d_scales is not None:
            d_scales = d_scales.reshape(scales_in.shape).to(scales_in.dtype)
        return dx, list(dws if dws is not None else [None] * g) + dbs, [None, d_scales]


# ------------------------------------------------------------------ dispatch


class Groups:
    """The row groups of one call: their bounds on the host and, made on first use,
    their offsets on the device (what the grouped kernels read; a loop of dense
    GEMMs never needs them)."""

    __slots__ = ("bounds", "device", "_offsets")

    def __init__(self, bounds: Sequence[int], device: torch.device | str) -> None:
        self.bounds = list(bounds)
        self.device = torch.device(device)
        self._offsets: torch.Tensor | None = None

    @property
    def offsets(self) -> torch.Tensor:
        """(G+1,) int64 prefix sums on the device."""
        if self._offsets is None:
            self._offsets = torch.tensor(self.bounds, dtype=torch.int64).to(self.device, non_blocking=True)
        return self._offsets

    def spans(self) -> list[tuple[int, int, int]]:
        """(group, first row, end row) of every non-empty group."""
        return [(g, s, e) for g, (s, e) in enumerate(zip(self.bounds, self.bounds[1:])) if e > s]


class Experts:
    """One FP8 operand of every expert: each expert's copy (``parts``, what a loop of
    dense GEMMs takes) and the copies stacked along their rows (:meth:`stacked`, what
    the grouped kernel takes: made on first use, or given when one cast made them)."""

    __slots__ = ("parts", "_stacked")

    def __init__(self, parts: Sequence[ScaledOperand], stacked: ScaledOperand | None = None) -> None:
        self.parts = list(parts)
        self._stacked = stacked

    @classmethod
    def of_stacked(cls, whole: ScaledOperand, groups: int) -> "Experts":
        """The experts of one operand stacked along its rows, in ``groups`` equal blocks."""
        rows = whole.data.shape[0] // groups
        return cls([_row_block(whole, g * rows, (g + 1) * rows) for g in range(groups)], whole)

    def stacked(self) -> ScaledOperand:
        if self._stacked is None:
            self._stacked = _stack(self.parts)
        return self._stacked


@dataclass(frozen=True)
class LoopRule:
    """When a grouped GEMM runs as a loop of dense FP8 GEMMs (one per non-empty
    group) instead of one grouped launch: on ``devices``, with the dense GEMM on one
    of ``dense_backends``, when the GEMMs average at least ``min_flop_per_gemm``
    FLOPs (``min_flop_per_wgrad_gemm`` for the wgrad; the module doc gives the
    measurements behind the defaults)."""

    min_flop_per_gemm: float = 2.0**34
    devices: tuple[str, ...] = ("cuda",)
    dense_backends: tuple[str, ...] = ("cuda",)
    min_flop_per_wgrad_gemm: float = 2.0**37

    def path(self, device: torch.device, flop: int, gemms: int, dense_takes_them: bool,
             wgrad: bool = False) -> str:
        """'loop' or 'grouped' for ``gemms`` non-empty GEMMs of ``flop`` FLOPs in all."""
        if gemms == 0 or not dense_takes_them or device.type not in self.devices:
            return "grouped"
        if backend.resolve("gemm", device).backend not in self.dense_backends:
            return "grouped"
        least = self.min_flop_per_wgrad_gemm if wgrad else self.min_flop_per_gemm
        return "loop" if flop >= least * gemms else "grouped"


LOOP_RULE = LoopRule()


def _dense_takes(a: ScaledOperand, b: ScaledOperand, dims: Sequence[int]) -> bool:
    """cuBLASLt's FP8 shapes (kernels/cuda/gemm.py): dims multiples of 16, not two E5M2 operands."""
    return all(d % 16 == 0 for d in dims) and not (a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2)


def fprop_path(a: ScaledOperand, b: Experts, groups: Groups, rule: LoopRule | None = None) -> str:
    """Where :func:`grouped_gemm_dispatch` runs ``a``'s groups against ``b``: 'grouped' or 'loop'."""
    spans = groups.spans()
    (q, r), p = b.parts[0].data.shape, a.data.shape[0]
    takes = _dense_takes(a, b.parts[0], (q, r))
    return (rule or LOOP_RULE).path(a.data.device, 2 * p * q * r, len(spans), takes)


def wgrad_path(a: ScaledOperand, b: ScaledOperand, groups: Groups, rule: LoopRule | None = None) -> str:
    """Where :func:`grouped_gemm_wgrad_dispatch` runs: 'grouped' or 'loop'."""
    spans = groups.spans()
    (q, p), r = a.data.shape, b.data.shape[0]
    takes = _dense_takes(a, b, (q, r, *(e - s for _, s, e in spans)))
    return (rule or LOOP_RULE).path(a.data.device, 2 * p * q * r, len(spans), takes, wgrad=True)


def grouped_gemm_dispatch(a: ScaledOperand, b: Experts, groups: Groups, out_dtype: torch.dtype,
                          bias: Sequence[torch.Tensor] | None = None, bias_scale: torch.Tensor | None = None,
                          rule: LoopRule | None = None) -> torch.Tensor:
    """``out (P, Q)``: each group's rows ``a[s:e] @ b.parts[g].T + bias[g]`` (the bias
    times ``bias_scale[s:e]`` per row when given), through the grouped kernel or a
    loop of dense GEMMs as :func:`fprop_path` says. ``a`` (P, R); ``bias`` one (Q,)
    tensor per group in ``out_dtype``; the loop adds a scaled bias in a second pass
    (fp32, one more rounding), the grouped kernel in its epilogue."""
    if fprop_path(a, b, groups, rule) == "grouped":
        stacked_bias = None if bias is None else torch.stack(list(bias))  # (G, Q)
        fn = backend.resolve("grouped_gemm", a.data.device).fn
        return fn(a, b.stacked(), groups.offsets, out_dtype, bias=stacked_bias, bias_scale=bias_scale)
    out = torch.empty(a.data.shape[0], b.parts[0].data.shape[0], dtype=out_dtype, device=a.data.device)
    for g, s, e in groups.spans():
        plain_bias = None if bias is None or bias_scale is not None else bias[g]
        out[s:e] = gemm(_row_block(a, s, e), b.parts[g], out_dtype, bias=plain_bias)
        if bias_scale is not None:
            _add_scaled_bias(out[s:e], bias[g], bias_scale[s:e])
    return out


def grouped_gemm_wgrad_dispatch(a: ScaledOperand, b: ScaledOperand, groups: Groups, out_dtype: torch.dtype,
                                rule: LoopRule | None = None) -> list[torch.Tensor]:
    """Each group's ``a[:, s:e] @ b[:, s:e].T`` (Q, R), zeros for an empty group: one
    grouped launch, or a dense GEMM per non-empty group, as :func:`wgrad_path` says.
    ``a`` (Q, P) and ``b`` (R, P) are the column-wise copies (the tokens contiguous)."""
    q, r = a.data.shape[0], b.data.shape[0]
    if wgrad_path(a, b, groups, rule) == "grouped":
        fn = backend.resolve("grouped_gemm_wgrad", a.data.device).fn
        return list(fn(a, b, groups.offsets, out_dtype).split(q))  # (G·Q, R) in G blocks
    outs = [None] * (len(groups.bounds) - 1)
    for g, s, e in groups.spans():
        outs[g] = gemm(_column_block(a, s, e), _column_block(b, s, e), out_dtype)
    return [o if o is not None else torch.zeros(q, r, dtype=out_dtype, device=a.data.device) for o in outs]


def _row_block(op: ScaledOperand, start: int, end: int) -> ScaledOperand:
    scale = op.scale_inv if op.scaling == Scaling.TENSOR else op.scale_inv[start:end]
    return ScaledOperand(op.data[start:end], scale, op.scaling)


def _column_block(op: ScaledOperand, start: int, end: int) -> ScaledOperand:
    return ScaledOperand(op.data[:, start:end], op.scale_inv, op.scaling)  # tensor or per-row scales: unchanged


def _add_scaled_bias(y: torch.Tensor, bias: torch.Tensor, scales: torch.Tensor) -> None:
    """``y += scales[:, None] · bias`` in fp32 (fp64 for fp64), rounded once to y's dtype."""
    wide = torch.float64 if y.dtype is torch.float64 else torch.float32
    y.addcmul_(scales.to(wide)[:, None], bias.to(wide)[None, :])


# ------------------------------------------------------------------- paths


def _path(ctx: OpContext) -> str:
    """'grouped' (tensor / row scales: the dispatch above), 'per_group' (a dense FP8
    GEMM per group) or 'high_precision', by the scales the installed quantizers produce."""
    run = ctx.run
    if not run.quantizing:
        return "high_precision"
    qs = ctx.quantizers
    scalings = [qs[t].scaling for t in ("input", "weight") + (("grad_output",) if run.fp8_backward else ())]
    if all(s == "identity" for s in scalings):
        return "high_precision"
    if all(s in _GROUPED_SCALINGS for s in scalings):
        return "grouped"
    return "per_group"


def _check_group_shapes(ctx: OpContext, op: GroupedLinear, bounds: list[int]) -> None:
    need_col = ctx.run.needs_backward
    for s, e in zip(bounds, bounds[1:]):
        if e > s:
            ctx.quantizers["input"].check_shape((e - s, op.in_features), rowwise=True, columnwise=need_col)
            if ctx.run.fp8_backward and need_col:
                ctx.quantizers["grad_output"].check_shape((e - s, op.out_features), rowwise=True, columnwise=True)


def _weights_hp(op: GroupedLinear, dtype: torch.dtype) -> list[torch.Tensor]:
    return [w if w.dtype is dtype else w.to(dtype) for w in op.weights]


def _biases(op: GroupedLinear, dtype: torch.dtype) -> list[torch.Tensor] | None:
    return [b if b.dtype is dtype else b.to(dtype) for b in op.biases] if op.use_bias else None


def _cat_fp8(datas: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([d.view(torch.uint8) for d in datas]).view(datas[0].dtype)


def _row_scales(op: ScaledOperand) -> torch.Tensor:
    rows = op.data.shape[0]
    return op.scale_inv.reshape(1, 1).expand(rows, 1) if op.scaling == Scaling.TENSOR else op.scale_inv


def _stack(ops: list[ScaledOperand]) -> ScaledOperand:
    """Operands of one FP8 dtype stacked along their rows, each keeping its scales."""
    if len({op.fp8_dtype for op in ops}) != 1:
        raise RuntimeError("GroupedLinear: the experts' weights were cast to different FP8 dtypes")
    if len(ops) == 1:
        return ops[0]
    return ScaledOperand(_cat_fp8([op.data for op in ops]), torch.cat([_row_scales(op) for op in ops]), Scaling.ROW)


def _regroup_columnwise(op: ScaledOperand, groups: int) -> ScaledOperand:
    """The column-wise copy (K, G·N) of stacked weights as G column-wise copies (G·K, N)."""
    k, gn = op.data.shape
    data = op.data.view(torch.uint8).view(k, groups, gn // groups).transpose(0, 1).reshape(groups * k, gn // groups)
    scale = op.scale_inv if op.scaling == Scaling.TENSOR else op.scale_inv.repeat(groups, 1)
    return ScaledOperand(data.view(op.data.dtype), scale, op.scaling)


def _grouped_weights(ctx: OpContext, op: GroupedLinear, need_col: bool) -> tuple[Experts, Experts | None]:
    """The experts' row-wise (N, K) and column-wise (K, N) FP8 weights."""
    q = ctx.quantizers["weight"]
    weights = op.weights  # cast from the parameters themselves (an fp32 master weight in one rounding)
    g = op.num_groups
    if q.STATE_TENSORS:  # its state sees the experts as one tensor: one amax per step
        w_q = q.cast(torch.cat(weights), rowwise=True, columnwise=need_col)
        col = Experts.of_stacked(_regroup_columnwise(w_q.columnwise, g), g) if need_col else None
        return Experts.of_stacked(w_q.rowwise, g), col
    casts = [q.cast(w, rowwise=True, columnwise=need_col) for w in weights]
    col = Experts([c.columnwise for c in casts]) if need_col else None
    return Experts([c.rowwise for c in casts]), col


def _forward_grouped(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, groups: Groups, scales) -> torch.Tensor:
    run = ctx.run
    need_dw_fp8 = run.needs_backward and run.fp8_backward
    x_q = ctx.quantizers["input"].cast(x2d, rowwise=True, columnwise=need_dw_fp8)
    w_row, w_col = _grouped_weights(ctx, op, need_dw_fp8)
    y = grouped_gemm_dispatch(x_q.rowwise, w_row, groups, run.compute_dtype, bias=_biases(op, run.compute_dtype),
                              bias_scale=scales)
    if run.needs_backward:
        _save_operands(ctx, op, x2d, x_q, (w_row, w_col), groups.bounds)
    return y


def _save_operands(ctx: OpContext, op: GroupedLinear, x2d, x_q, w_q, bounds: list[int]) -> None:
    """What the backward reads, per ``backward_override``: the FP8 operands (x whole
    or per group, w as Experts or per group), their dequantized copies, or the
    high-precision tensors."""
    run, saved = ctx.run, ctx.saved
    if run.fp8_backward:
        saved["x"], saved["w"] = x_q, w_q
        return
    if run.backward_override == "dequantized":
        x_hp = (x_q.dequantize(run.compute_dtype) if isinstance(x_q, QuantizedTensor)
                else _dequantized_rows(x_q, x2d, bounds, run.compute_dtype))
        w_hp = _dequantized_weights(w_q, op, run.compute_dtype)
    else:
        x_hp, w_hp = x2d, _weights_hp(op, run.compute_dtype)
    saved["x"], saved["w"] = x_hp, w_hp


def _dequantized_weights(w_q, op: GroupedLinear, dtype: torch.dtype) -> list[torch.Tensor]:
    if isinstance(w_q, list):  # per group QuantizedTensors
        return [w.dequantize(dtype) for w in w_q]
    deq = backend.resolve("dequantize", op.weight0.device).fn
    return [deq(part, dtype) for part in w_q[0].parts]  # (N, K) each


def _backward_grouped(ctx: OpContext, op: GroupedLinear, dy2d, need_dx: bool, need_dw: bool):
    run, saved = ctx.run, ctx.saved
    if not run.fp8_backward:
        return _backward_high_precision(ctx, op, dy2d, need_dx, need_dw)
    x_q, (_, w_col) = saved["x"], saved["w"]
    groups = saved["groups"]
    dy_q = ctx.quantizers["grad_output"].cast(dy2d, rowwise=need_dx, columnwise=need_dw)
    dx = dws = None
    if need_dx:
        dx = grouped_gemm_dispatch(dy_q.rowwise, w_col, groups, run.compute_dtype)  # (M, K)
    if need_dw:
        dws = grouped_gemm_wgrad_dispatch(dy_q.columnwise, x_q.columnwise, groups, saved["w_dtype"])  # G x (N, K)
    return dx, dws


def _forward_per_group(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, groups: Groups, scales):
    """Block / MXFP8 scales: each group cast on its own, a dense FP8 GEMM each."""
    run = ctx.run
    need_col = run.needs_backward and run.fp8_backward
    dtype = run.compute_dtype
    q_in, q_w = ctx.quantizers["input"], ctx.quantizers["weight"]
    w_q = [q_w.cast(w, rowwise=True, columnwise=need_col) for w in op.weights]
    biases = _biases(op, dtype) or [None] * op.num_groups
    y = x2d.new_empty(x2d.shape[0], op.out_features)
    x_q = [None] * op.num_groups
    for g, s, e in groups.spans():
        x_q[g] = q_in.cast(x2d[s:e], rowwise=True, columnwise=need_col)
        y[s:e] = gemm(rowwise(x_q[g]), rowwise(w_q[g]), dtype, bias=biases[g] if scales is None else None,
                      fast_accum=run.fast_accum_fprop)
        if scales is not None:
            _add_scaled_bias(y[s:e], biases[g], scales[s:e])
    if run.needs_backward:
        _save_operands(ctx, op, x2d, x_q, w_q, groups.bounds)
    return y


def _dequantized_rows(x_q: list, x2d: torch.Tensor, bounds: list[int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty_like(x2d)
    for q, s, e in zip(x_q, bounds, bounds[1:]):
        if q is not None:
            out[s:e] = q.dequantize(dtype)
    return out


def _backward_per_group(ctx: OpContext, op: GroupedLinear, dy2d, need_dx: bool, need_dw: bool):
    run, saved = ctx.run, ctx.saved
    if not run.fp8_backward:
        return _backward_high_precision(ctx, op, dy2d, need_dx, need_dw)
    x_q, w_q, bounds = saved["x"], saved["w"], saved["groups"].bounds
    q_dy, dtype = ctx.quantizers["grad_output"], run.compute_dtype
    dx = dy2d.new_empty(dy2d.shape[0], op.in_features) if need_dx else None
    dws = [] if need_dw else None
    for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if e == s:
            if need_dw:
                dws.append(torch.zeros(op.out_features, op.in_features, dtype=saved["w_dtype"], device=dy2d.device))
            continue
        dy_q = q_dy.cast(dy2d[s:e], rowwise=need_dx, columnwise=need_dw)
        if need_dx:
            dx[s:e] = gemm(rowwise(dy_q), columnwise(w_q[g]), dtype, fast_accum=run.fast_accum_dgrad)
        if need_dw:
            dws.append(gemm(columnwise(dy_q), columnwise(x_q[g]), saved["w_dtype"], fast_accum=run.fast_accum_wgrad))
    return dx, dws


def _forward_high_precision(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, groups: Groups, scales):
    """Each group a torch linear in the compute dtype (bias in its epilogue; a scaled
    bias added after, in fp32)."""
    run = ctx.run
    dtype = run.compute_dtype
    w_hp = _weights_hp(op, dtype)
    if run.calibrating:
        ctx.quantizer("input").observe(x2d)
        ctx.quantizer("weight").observe(torch.cat(w_hp))
    biases = _biases(op, dtype) or [None] * op.num_groups
    y = x2d.new_empty(x2d.shape[0], op.out_features)
    for g, s, e in groups.spans():
        y[s:e] = gemm(x2d[s:e], w_hp[g], dtype, bias=biases[g] if scales is None else None)
        if scales is not None:
            _add_scaled_bias(y[s:e], biases[g], scales[s:e])
    if run.needs_backward:
        ctx.saved["x"], ctx.saved["w"] = x2d, w_hp
    return y


def _backward_high_precision(ctx: OpContext, op: GroupedLinear, dy2d, need_dx: bool, need_dw: bool):
    """dgrad and wgrad per group in the compute dtype, from the saved (or dequantized) x and w."""
    saved, dtype = ctx.saved, ctx.run.compute_dtype
    x_hp, w_hp, bounds = saved["x"], saved["w"], saved["groups"].bounds
    dx = dy2d.new_zeros(dy2d.shape[0], op.in_features) if need_dx else None
    dws = [] if need_dw else None
    for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if need_dx and e > s:
            dx[s:e] = gemm(dy2d[s:e], w_hp[g].t(), dtype)
        if need_dw:
            dw = gemm(dy2d[s:e].t(), x_hp[s:e].t(), dtype) if e > s else dy2d.new_zeros(
                op.out_features, op.in_features)
            dws.append(dw.to(saved["w_dtype"]))
    return dx, dws


def _bias_grads(dy2d: torch.Tensor, bounds: list[int], biases: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each group's column sums of dy in fp32 (zeros for an empty group), in the bias dtype."""
    out = []
    for b, s, e in zip(biases, bounds, bounds[1:]):
        db = dy2d[s:e].sum(dim=0, dtype=torch.float32)
        out.append(db if db.dtype is b.dtype else db.to(b.dtype))
    return out


def _scaled_bias_grads(dy2d: torch.Tensor, bounds: list[int], biases: list[torch.Tensor], scales: torch.Tensor,
                       need_db: bool, need_ds: bool) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """With scale_bias, in fp32: each group's bias gradient ``Σ_rows scale · dy`` and
    the scales' gradient ``dy_row · b_g`` (M,), from the forward's biases."""
    dbs = []
    d_scales = torch.zeros(dy2d.shape[0], dtype=torch.float32, device=dy2d.device) if need_ds else None
    for b, s, e in zip(biases, bounds, bounds[1:]):
        dy32 = dy2d[s:e].float()  # (m_g, N)
        dbs.append((dy32 * scales[s:e, None].float()).sum(dim=0) if need_db else None)
        if need_ds and e > s:
            d_scales[s:e] = (dy32 * b.float()).sum(dim=1)
    return dbs, d_scales


_FORWARDS = {"grouped": _forward_grouped, "per_group": _forward_per_group, "high_precision": _forward_high_precision}
_BACKWARDS = {"grouped": _backward_grouped, "per_group": _backward_per_group,
              "high_precision": _backward_high_precision}
