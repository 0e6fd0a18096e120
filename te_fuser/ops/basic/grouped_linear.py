"""GroupedLinear: G linear layers over consecutive row groups (mixture-of-experts experts).

``y_g = x_g · w_gᵀ + b_g`` where ``x_g`` are the rows ``offsets[g]:offsets[g+1]`` of
x (M, K), the split sizes given as the op's extra input (TransformerEngine's
``te.ops.GroupedLinear(num_groups, in_features, out_features)`` called as
``op(x, split_sizes)``). The three GEMMs of each group, as in ``BasicLinear``:

- fprop ``y_g  = x_g · w_gᵀ``   x row-wise (input quantizer),  w_g row-wise (weight quantizer)
- dgrad ``dx_g = dy_g · w_g``   dy row-wise (grad_output),     w_g column-wise
- wgrad ``dw_g = dy_gᵀ · x_g``  dy column-wise (grad_output),  x column-wise; the grouped dim is the reduction

With tensor or row scales (delayed, current, row-wise scaling) each GEMM is one
grouped kernel for all experts (``grouped_gemm``, ``grouped_gemm_wgrad``): x and dy
are cast once, whole, and the experts' weights are stacked as one (G·N, K) operand
(and their column-wise copies as one (G·K, N)). A weight quantizer that keeps
scaling state (delayed scaling's amax history) casts the stacked weights as one
tensor, so its history records one amax per step; a stateless one casts each
expert's weight for a scale of its own. Block and MXFP8 scales do not slice along
a group boundary that is not a tile boundary, so those recipes cast each group
and run the dense FP8 GEMM per group (MXFP8 needs every split size a multiple of
32). Without a recipe (or with identity quantizers) the groups run as torch
linears in the compute dtype, like ``BasicLinear``'s high-precision path.

Parameters follow TransformerEngine: ``weight0`` ... ``weight{G-1}`` (N, K) and
``bias0`` ... ``bias{G-1}`` (N,). The split sizes are read on the host (a device
tensor of them costs a synchronisation).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ... import backend
from ...kernels.formats import Scaling
from ...kernels.operand import ScaledOperand
from ...quantization.tensor import QuantizedTensor
from ..gemm import columnwise, gemm, rowwise
from ..op import BasicOperation, OpContext

__all__ = ["GroupedLinear"]

_GROUPED_SCALINGS = (Scaling.TENSOR, Scaling.ROW)


class GroupedLinear(BasicOperation):
    module_type = "linear"
    casts_weights = True
    forward_roles = ("input", "weight")
    backward_roles = ("grad_output",)
    num_extra_inputs = 1  # the split sizes

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True, device=None,
                 dtype=None, name=None) -> None:
        super().__init__(name)
        for field, value in (("num_groups", num_groups), ("in_features", in_features),
                             ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedLinear.{field}: must be a positive integer, got {value!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"GroupedLinear.bias: must be a bool, got {type(bias).__name__}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bias
        for g in range(num_groups):
            w = torch.empty(out_features, in_features, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # as torch.nn.Linear
            self.register_parameter(f"weight{g}", nn.Parameter(w))
        for g in range(num_groups):
            b = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
            self.register_parameter(f"bias{g}", b)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")

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

    def op_forward(self, ctx: OpContext, x, extra_inputs: Sequence[torch.Tensor]):
        (split_sizes,) = extra_inputs
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        bounds = self.split_bounds(split_sizes, x2d.shape[0])
        dtype = ctx.run.compute_dtype
        if x2d.dtype is not dtype:
            x2d = x2d.to(dtype)
        path = _path(ctx)
        if path == "per_group":
            _check_group_shapes(ctx, self, bounds)  # before any cast changes state
        y2d = _FORWARDS[path](ctx, self, x2d, bounds)  # (M, N)
        if ctx.run.needs_backward:
            ctx.saved.update(path=path, bounds=bounds, x_shape=x.shape, w_dtype=self.weight0.dtype)
        return y2d.reshape(*x.shape[:-1], self.out_features), []

    def op_backward(self, ctx: OpContext, dy, grad_extra_outputs):
        dy2d = dy.reshape(-1, self.out_features)  # (M, N)
        dtype = ctx.run.compute_dtype
        if dy2d.dtype is not dtype:
            dy2d = dy2d.to(dtype)
        g = self.num_groups
        need = ctx.param_needs_grad or (True,) * len(list(self.parameters()))
        need_dx, need_dw, need_db = ctx.needs_input_grad, any(need[:g]), any(need[g:])
        dx2d, dws = _BACKWARDS[ctx.saved["path"]](ctx, self, dy2d, need_dx, need_dw)
        dx = None if dx2d is None else dx2d.reshape(ctx.saved["x_shape"])
        dbs = _bias_grads(dy2d, ctx.saved["bounds"], self.biases) if need_db else [None] * len(self.biases)
        return dx, list(dws if dws is not None else [None] * g) + list(dbs), [None]


# ------------------------------------------------------------------- paths


def _path(ctx: OpContext) -> str:
    """'grouped' (one kernel per GEMM), 'per_group' (a dense FP8 GEMM per group) or
    'high_precision', by the scales the installed quantizers produce."""
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


def _offsets(bounds: list[int], device) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int64).to(device, non_blocking=True)


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


def _grouped_weights(ctx: OpContext, op: GroupedLinear, need_col: bool):
    """(row-wise (G·N, K), column-wise (G·K, N) or None) FP8 weights of all experts."""
    q = ctx.quantizers["weight"]
    weights = op.weights  # cast from the parameters themselves (an fp32 master weight in one rounding)
    if q.STATE_TENSORS:  # its state sees the experts as one tensor: one amax per step
        w_q = q(torch.cat(weights), rowwise=True, columnwise=need_col)
        return w_q.rowwise, (_regroup_columnwise(w_q.columnwise, op.num_groups) if need_col else None)
    casts = [q(w, rowwise=True, columnwise=need_col) for w in weights]
    col = _stack([c.columnwise for c in casts]) if need_col else None
    return _stack([c.rowwise for c in casts]), col


def _stacked_bias(op: GroupedLinear, dtype: torch.dtype) -> torch.Tensor | None:
    return torch.stack([b if b.dtype is dtype else b.to(dtype) for b in op.biases]) if op.use_bias else None


def _forward_grouped(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    run = ctx.run
    need_dw_fp8 = run.needs_backward and run.fp8_backward
    x_q = ctx.quantizers["input"](x2d, rowwise=True, columnwise=need_dw_fp8)
    w_row, w_col = _grouped_weights(ctx, op, need_dw_fp8)
    offsets = _offsets(bounds, x2d.device)
    y = backend.resolve("grouped_gemm", x2d.device).fn(x_q.rowwise, w_row, offsets, run.compute_dtype,
                                                       bias=_stacked_bias(op, run.compute_dtype))
    if run.needs_backward:
        ctx.saved["offsets"] = offsets
        _save_operands(ctx, op, x2d, x_q, (w_row, w_col), bounds)
    return y


def _save_operands(ctx: OpContext, op: GroupedLinear, x2d, x_q, w_q, bounds: list[int]) -> None:
    """What the backward reads, per ``backward_override``: the FP8 operands (x whole
    or per group, w stacked or per group), their dequantized copies, or the
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
    deq = backend.resolve("dequantize", op.weight0.device).fn
    if isinstance(w_q, list):  # per group QuantizedTensors
        return [w.dequantize(dtype) for w in w_q]
    w_all = deq(w_q[0], dtype)  # (G·N, K)
    return list(w_all.split(op.out_features))


def _backward_grouped(ctx: OpContext, op: GroupedLinear, dy2d, need_dx: bool, need_dw: bool):
    run, saved = ctx.run, ctx.saved
    if not run.fp8_backward:
        return _backward_high_precision(ctx, op, dy2d, need_dx, need_dw)
    x_q, (_, w_col) = saved["x"], saved["w"]
    offsets = saved["offsets"]
    dy_q = ctx.quantizers["grad_output"](dy2d, rowwise=need_dx, columnwise=need_dw)
    device = dy2d.device
    dx = dws = None
    if need_dx:
        dx = backend.resolve("grouped_gemm", device).fn(dy_q.rowwise, w_col, offsets, run.compute_dtype)  # (M, K)
    if need_dw:
        dw = backend.resolve("grouped_gemm_wgrad", device).fn(dy_q.columnwise, x_q.columnwise, offsets,
                                                              saved["w_dtype"])  # (G·N, K)
        dws = list(dw.split(op.out_features))
    return dx, dws


def _forward_per_group(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Block / MXFP8 scales: each group cast on its own, a dense FP8 GEMM each."""
    run = ctx.run
    need_col = run.needs_backward and run.fp8_backward
    dtype = run.compute_dtype
    q_in, q_w = ctx.quantizers["input"], ctx.quantizers["weight"]
    w_q = [q_w(w, rowwise=True, columnwise=need_col) for w in op.weights]
    biases = [b if b.dtype is dtype else b.to(dtype) for b in op.biases] or [None] * op.num_groups
    y = x2d.new_empty(x2d.shape[0], op.out_features)
    x_q = []
    for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if e == s:
            x_q.append(None)
            continue
        x_q.append(q_in(x2d[s:e], rowwise=True, columnwise=need_col))
        y[s:e] = gemm(rowwise(x_q[-1]), rowwise(w_q[g]), dtype, bias=biases[g], fast_accum=run.fast_accum_fprop)
    if run.needs_backward:
        _save_operands(ctx, op, x2d, x_q, w_q, bounds)
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
    x_q, w_q, bounds = saved["x"], saved["w"], saved["bounds"]
    q_dy, dtype = ctx.quantizers["grad_output"], run.compute_dtype
    dx = dy2d.new_empty(dy2d.shape[0], op.in_features) if need_dx else None
    dws = [] if need_dw else None
    for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if e == s:
            if need_dw:
                dws.append(torch.zeros(op.out_features, op.in_features, dtype=saved["w_dtype"], device=dy2d.device))
            continue
        dy_q = q_dy(dy2d[s:e], rowwise=need_dx, columnwise=need_dw)
        if need_dx:
            dx[s:e] = gemm(rowwise(dy_q), columnwise(w_q[g]), dtype, fast_accum=run.fast_accum_dgrad)
        if need_dw:
            dws.append(gemm(columnwise(dy_q), columnwise(x_q[g]), saved["w_dtype"], fast_accum=run.fast_accum_wgrad))
    return dx, dws


def _forward_high_precision(ctx: OpContext, op: GroupedLinear, x2d: torch.Tensor, bounds: list[int]):
    """Each group a torch linear in the compute dtype (bias in its epilogue)."""
    run = ctx.run
    dtype = run.compute_dtype
    w_hp = _weights_hp(op, dtype)
    if run.calibrating:
        ctx.quantizer("input").observe(x2d)
        ctx.quantizer("weight").observe(torch.cat(w_hp))
    biases = [b if b.dtype is dtype else b.to(dtype) for b in op.biases] or [None] * op.num_groups
    y = x2d.new_empty(x2d.shape[0], op.out_features)
    for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
        if e > s:
            y[s:e] = gemm(x2d[s:e], w_hp[g], dtype, bias=biases[g])
    if run.needs_backward:
        ctx.saved["x"], ctx.saved["w"] = x2d, w_hp
    return y


def _backward_high_precision(ctx: OpContext, op: GroupedLinear, dy2d, need_dx: bool, need_dw: bool):
    """dgrad and wgrad per group in the compute dtype, from the saved (or dequantized) x and w."""
    saved, dtype = ctx.saved, ctx.run.compute_dtype
    x_hp, w_hp, bounds = saved["x"], saved["w"], saved["bounds"]
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


_FORWARDS = {"grouped": _forward_grouped, "per_group": _forward_per_group, "high_precision": _forward_high_precision}
_BACKWARDS = {"grouped": _backward_grouped, "per_group": _backward_per_group,
              "high_precision": _backward_high_precision}
