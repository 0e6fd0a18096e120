"""BasicLinear: ``y = x @ w.T`` without bias, in FP8 when a recipe is active.

The three GEMMs of a linear layer, x (M, K), w (N, K), dy (M, N):

- fprop ``y  = x · wᵀ``   (M×K · K×N): x row-wise   (input quantizer),  w row-wise    (weight quantizer)
- dgrad ``dx = dy · w``   (M×N · N×K): dy row-wise  (grad_output),      w column-wise (weight quantizer)
- wgrad ``dw = dyᵀ · x``  (N×M · M×K): dy column-wise (grad_output),    x column-wise (input quantizer)

"Row-wise" means quantized along the row (the last dim); a column-wise copy is
quantized along the other dim and stored transposed, so every GEMM reduces along
the contiguous dim of both operands (see ``te_fuser.kernels.operand``).

``backward_override='high_precision'`` saves x and w in high precision for the
backward GEMMs; ``'dequantized'`` saves their FP8 copies and dequantizes them.
The weight is cast once per forward, for that forward's GEMM and its backward's,
from the parameter's own dtype (an fp32 master weight goes to FP8 in one
rounding); a cast is reused across forwards only inside
``te.reuse_quantized_weights()`` (gradient accumulation, repeated inference),
while the weight is unchanged.

A fused op may hand ``linear_forward`` an input already quantized by this linear's
input quantizer (the previous GEMM's epilogue cast it), and may ask it for its
own result as FP8 data cast in its epilogue (``out_cast``); see
``ops/fused/forward_linear_bias_linear.py``.

``accumulate_into_main_grad=True`` (TransformerEngine's, for Megatron-LM's
wgrad fusion): the wgrad GEMM's fp32 result is added to ``weight.main_grad``, an
fp32 buffer of the weight's shape the caller attaches (or written over it when
the weight has ``overwrite_main_grad=True``), and autograd receives no real
weight gradient: ``.grad`` stays None, or, when the weight has the attribute
``grad_added_to_main_grad``, that flag is set True and ``.grad`` gets a dummy of
the weight's shape and dtype (zeros with ``zero_out_wgrad=True``, else
uninitialised), as TransformerEngine does. No GEMM backend here accumulates into
an output buffer yet, so the FP8 wgrad writes fp32 and is added after; a
high-precision wgrad accumulates in fp32 too (never rounded to bf16 first).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ...quantization.tensor import QuantizedTensor
from ...kernels.formats import Scaling
from ...kernels.operand import ScaledOperand
from ...quantization.base import EpilogueCast
from ..gemm import bias_in, columnwise, gemm, gemm_fp8_out, rowwise
from ..op import BasicOperation, OpContext
from ..fp8_all_gather import GatheredWeight
from ..fp8_parameters import fp8_init_recipe, fp8_weight, fp8_weight_replaced, make_fp8_parameter
from ...quantization.float8_tensor import Float8Tensor
from ...quantization.role import QuantizerRole
from ..weight_cache import WeightCache, reuse_scope_open

__all__ = ["BasicLinear", "linear_forward", "linear_backward", "input_needs_columnwise", "linear_bias_activation_forward",
           "linear_bias_add_forward"]


def init_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) drawn in place as ``torch.nn.Linear`` draws it: uniform
    within ``1 / sqrt(K)`` (kaiming uniform with ``a = sqrt(5)``)."""
    with torch.no_grad():
        return nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class BasicLinear(BasicOperation):
    module_type = "linear"
    accepts_fp8_input = True
    casts_weights = True
    forward_roles = ("input", "weight")
    backward_roles = ("grad_output",)
    _made_fp8 = False  # made as an FP8 parameter, until a forward finds it replaced (fp8_weight_replaced)
    _preserve_init = False  # made under quantized_model_init(preserve_high_precision_init_val=True)

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None, name=None,
                 accumulate_into_main_grad: bool = False) -> None:
        super().__init__(name)
        if not isinstance(accumulate_into_main_grad, bool):
            raise TypeError(f"BasicLinear.accumulate_into_main_grad: must be True or False, "
                            f"got {accumulate_into_main_grad!r}")
        self.accumulate_into_main_grad = accumulate_into_main_grad
        for field, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BasicLinear.{field}: must be a positive integer, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        init_linear_weight(self.weight)
        fp8_init = fp8_init_recipe()
        if fp8_init is not None:  # te.quantized_model_init: the weight is held in FP8 (ops/fp8_parameters.py)
            self._made_fp8, self._preserve_init = True, fp8_init[1]
            self.weight = make_fp8_parameter(self.weight, fp8_init[0], QuantizerRole.make("linear", "weight", name),
                                             preserve=fp8_init[1])
        self._weight_cache = WeightCache()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def drop_caches(self) -> None:
        self._weight_cache.clear()

    def reset_parameters(self) -> None:
        """Draw the weight again as construction did (``torch.nn.Linear``'s uniform
        init), in place: after ``to_empty`` (a model built on the meta device) or to
        start over. An FP8 parameter is drawn in its nominal dtype and cast by its
        own quantizer (its init value kept again where it kept one)."""
        weight = self.weight
        with torch.no_grad():
            if type(weight) is Float8Tensor:
                w_hp = init_linear_weight(torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))
                weight.copy_(w_hp)
                if self._preserve_init:
                    weight.fp8_storage.init_value = w_hp.cpu().clone()
            else:
                init_linear_weight(weight)
        self.drop_caches()

    def quantized_weight(self, quantizer, w_hp: torch.Tensor, need_columnwise: bool, weight=None):
        """The weight cast by ``quantizer``: cast now, or a cast kept inside
        ``te.reuse_quantized_weights()`` while the weight is unchanged (see
        ``ops/weight_cache.py``). ``weight``: ``self.weight``, when the caller holds it."""
        if type(w_hp) is GatheredWeight:  # gathered by FSDP2 in FP8, cast by this quantizer before it
            return w_hp.quantized(quantizer, need_columnwise)
        if type(w_hp) is Float8Tensor:  # an FP8 parameter: its own copy where it casts alike
            return fp8_weight(quantizer, w_hp, need_columnwise)
        if not reuse_scope_open():  # outside te.reuse_quantized_weights() nothing is kept: cast
            return quantizer.cast(w_hp, rowwise=True, columnwise=need_columnwise)
        weight, cache = self.weight if weight is None else weight, self._weight_cache
        w_q = cache.lookup(quantizer, weight, w_hp.dtype, need_columnwise)
        if w_q is None:
            w_q = quantizer.cast(w_hp, rowwise=True, columnwise=need_columnwise)
            cache.store(quantizer, weight, w_hp.dtype, need_columnwise, w_q)
        return w_q

    def cached_weight(self, dtype: torch.dtype) -> "tuple[bool, QuantizedTensor] | None":
        """``(has a column-wise copy, the FP8 weight)`` when a kept cast of the current
        weight by the installed weight quantizer from ``dtype`` may be reused now."""
        return self._weight_cache.holds(self._quantizers.get("weight"), self.weight, dtype)

    def cache_weight(self, w_q: QuantizedTensor, columnwise: bool, dtype: torch.dtype) -> None:
        """Keep ``w_q`` as the installed weight quantizer's cast of the current weight
        (inside ``te.reuse_quantized_weights()``; elsewhere nothing is kept)."""
        self._weight_cache.store(self._quantizers.get("weight"), self.weight, dtype, columnwise, w_q)

    def check_shapes(self, in_shape, quantizers):
        if in_shape[-1] != self.in_features:
            raise ValueError(
                f"{self.describe()}: input's last dim is {in_shape[-1]}, expected in_features={self.in_features}"
            )
        rows = math.prod(in_shape[:-1])
        checks = (("input", (rows, self.in_features)), ("weight", tuple(self.weight.shape)),
                  ("grad_output", (rows, self.out_features)))
        for tensor_type, shape in checks:
            q = quantizers.get(tensor_type)
            if q is not None:
                q.check_shape(shape, rowwise=True, columnwise=True)
        return torch.Size((*in_shape[:-1], self.out_features))

    def op_forward(self, ctx: OpContext, x, extra_inputs: Sequence[torch.Tensor]):
        return linear_forward(ctx, self, x), []

    def op_backward(self, ctx: OpContext, dy, grad_extra_outputs):
        dx, dw = linear_backward(ctx, self, dy)
        return dx, [dw], []


def input_needs_columnwise(ctx: OpContext, op: BasicLinear) -> bool:
    """Whether the backward's wgrad GEMM reads a column-wise FP8 copy of the input."""
    run = ctx.run
    return run.needs_backward and run.fp8_backward and op.weight.requires_grad


def linear_forward(
    ctx: OpContext,
    op: BasicLinear,
    x: "torch.Tensor | QuantizedTensor",
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out_cast: EpilogueCast | None = None,
    weight_scale: float | None = None,
    bias_round: torch.dtype | None = None,
) -> torch.Tensor:
    """fprop with an optional epilogue; saves the backward's operands in ``ctx``.
    ``weight_scale`` (with ``residual``) gives ``weight_scale · (x · wᵀ) + residual``
    rounded once: FP8 per-tensor operands take the factor into the weight's
    dequantization scale for this GEMM (the epilogue applies it in fp32 and adds
    the residual); other GEMMs write fp32 and the scale and residual follow in fp32.

    ``x``: a high-precision (..., K) tensor, or a :class:`QuantizedTensor` already
    cast by this op's input quantizer (with the column-wise copy when the backward
    needs it). With ``out_cast`` the result is returned as its FP8 data (M, N),
    cast in the epilogue after rounding to the compute dtype. ``bias_round``: the bias
    is added as ``bias.to(bias_round)`` (see :func:`~te_fuser.ops.gemm.gemm`)."""
    run = ctx.run
    dtype = run.compute_dtype
    param = weight = op.weight
    if op._made_fp8 and type(param) is not Float8Tensor:
        fp8_weight_replaced(op, param)
    x_shape = x.shape
    # An FP8 weight is cast from the parameter itself (an fp32 master weight in one
    # rounding, without a compute-dtype copy first); the compute-dtype copy is made
    # only where it is used: a high-precision GEMM or a high-precision backward.
    from_master = run.from_master
    if type(weight) is GatheredWeight:  # FSDP2 gathered it, in FP8 where this plan's quantizer cast it
        weight = weight.for_plan(ctx.quantizers.get("weight") if from_master else None)
    w_hp = weight if (weight.dtype is dtype or from_master) else weight.to(dtype)  # (N, K)
    if type(w_hp) is Float8Tensor and not from_master:  # an FP8 parameter in a high-precision forward or backward
        w_hp = w_hp.dequantize(dtype)
    needs_backward = run.needs_backward
    if type(x) is Float8Tensor:  # an FP8 input (te.ops.Quantize's output): its FP8 copy, or its value
        x = _fp8_input(ctx, op, x)
    if isinstance(x, QuantizedTensor):  # cast by the previous GEMM's epilogue (never for a high-precision backward)
        x2d = x_q = x
        w_q = op.quantized_weight(ctx.quantizers.get("weight"), w_hp, needs_backward and run.fp8_backward, param)
        keep_fp8 = run.keep_fp8
    else:
        # a cast takes x as it comes, of any dims, as its 2-D flattening; the
        # high-precision GEMM reads (M, K) (a reshape is a dispatch of its own)
        flat_cast = run.quantizing and getattr(ctx.quantizers.get("input"), "flattens", False)
        x2d = x if (len(x_shape) == 2 or flat_cast) else x.reshape(-1, op.in_features)  # (M, K), or (..., K) to cast
        if x2d.dtype is not dtype:
            x2d = x2d.to(dtype)
        x_q, w_q, keep_fp8 = _fprop_operands(ctx, op, x2d, w_hp, param)
    if out_cast is not None:
        y2d = gemm_fp8_out(rowwise(x_q), rowwise(w_q), out_cast, dtype, bias=bias_in(bias, bias_round),
                           activation=activation, fast_accum=run.fast_accum_fprop)  # (M, N) FP8
    else:
        # with a residual, the sum has torch's promoted dtype (an fp32 residual stream stays fp32)
        out_dtype = dtype if residual is None else _promoted(dtype, residual.dtype)
        x_op, w_op = rowwise(x_q), rowwise(w_q)  # (M, K), (N, K)
        if weight_scale is not None and not (_per_tensor(x_op) and _per_tensor(w_op)):
            y2d = torch.add(residual.reshape(-1, op.out_features).float(), _gemm_fp32(x_op, w_op, run.fast_accum_fprop),
                            alpha=weight_scale).to(out_dtype)  # (M, N), rounded once
        else:
            if weight_scale is not None:  # the epilogue's fp32 factor, in this GEMM's weight scale only
                w_op = ScaledOperand(w_op.data, w_op.scale_inv * weight_scale, w_op.scaling)
            # (..., N) in x's dims, the residual in them too
            y2d = gemm(x_op, w_op, out_dtype, bias=bias, activation=activation, residual=residual,
                       fast_accum=run.fast_accum_fprop, compute_dtype=dtype, bias_round=bias_round, a_shape=x_shape)
    if needs_backward:
        saved = ctx.saved
        saved["x"] = x_q if keep_fp8 else (x2d if len(x2d.shape) == 2 else x2d.reshape(-1, op.in_features))
        saved["w"] = w_q if keep_fp8 else w_hp
        saved["x_shape"] = x_shape
        saved["w_dtype"], saved["w_requires_grad"] = weight.dtype, param.requires_grad
    if out_cast is not None or len(y2d.shape) == len(x_shape):
        return y2d
    return y2d.reshape(*x_shape[:-1], y2d.shape[-1])


_PROMOTED: dict = {}


def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``, remembered (torch's call dispatches like an op)."""
    if a is b:
        return a
    out = _PROMOTED.get((a, b))
    if out is None:
        out = _PROMOTED[(a, b)] = torch.promote_types(a, b)
    return out


def _gemm_fp32(a, b, fast_accum: bool = False) -> torch.Tensor:
    """``a (P, R) @ b (Q, R).T`` accumulated and returned in fp32: the FP8 GEMM writes
    fp32; bf16/fp16 operands run on the tensor cores with an fp32 result on a GPU,
    upcast to fp32 elsewhere (exact products)."""
    if isinstance(a, ScaledOperand) and isinstance(b, ScaledOperand):
        return gemm(a, b, torch.float32, fast_accum=fast_accum)
    if isinstance(a, ScaledOperand) or isinstance(b, ScaledOperand):
        raise TypeError("_gemm_fp32: both operands FP8, or neither")
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype is a.dtype:
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return a.float() @ b.float().t()


def _fp8_input(ctx: OpContext, op: BasicLinear, x: Float8Tensor) -> "QuantizedTensor | torch.Tensor":
    """A Float8Tensor input as the fprop operand (M, K) when its format is the input
    quantizer's and the backward needs no copy it cannot make exactly (a per-tensor
    scale transposes); else its dequantized value in the compute dtype."""
    run, q = ctx.run, x.quantized()
    quantizer = ctx.quantizers.get("input")
    usable = (run.quantizing and run.backward_override != "high_precision" and quantizer is not None
              and x.dtype is run.compute_dtype and q.has_rowwise
              and (q.fp8_dtype, q.scaling) == (quantizer.fp8_dtype, quantizer.scaling))
    if not usable:
        return x.dequantize(run.compute_dtype)
    row, col = q.rowwise, q.columnwise
    if input_needs_columnwise(ctx, op) and col is None:
        if row.scaling != Scaling.TENSOR:
            return x.dequantize(run.compute_dtype)
        col = ScaledOperand(row.data.t().contiguous(), row.scale_inv, Scaling.TENSOR)  # (K, M)
    return QuantizedTensor(row, col, row.data.shape, q.dtype)


def _fprop_operands(ctx: OpContext, op: BasicLinear, x2d: torch.Tensor, w_hp: torch.Tensor, param: torch.Tensor):
    """``(x operand, w operand, whether the backward keeps their FP8 copies)``;
    ``param`` is ``op.weight``."""
    run = ctx.run
    if run.quantizing:
        quantizers = ctx.quantizers
        fp8_backward = run.needs_backward and run.fp8_backward  # the backward GEMMs read column-wise copies
        x_q = quantizers.get("input").cast(x2d, rowwise=True, columnwise=fp8_backward and param.requires_grad)
        w_q = op.quantized_weight(quantizers.get("weight"), w_hp, fp8_backward, param)
        return x_q, w_q, run.keep_fp8
    if run.calibrating:
        ctx.quantizer("input").observe(x2d)
        ctx.quantizer("weight").observe(w_hp)
    return x2d, w_hp, False


def _backward_operands(ctx: OpContext, dy2d: torch.Tensor, need_dx: bool, need_dw: bool, column_sums: bool = False,
                       as_dtype: torch.dtype | None = None, sums_dtype: torch.dtype = torch.float32,
                       dy_amax: torch.Tensor | None = None):
    """dy, x and w in the form the backward GEMMs take, per ``backward_override``;
    with ``column_sums``, also dy's column sums summed in fp32 and returned as
    ``sums_dtype`` (fp32 or bf16), from the dy cast's own read where its scheme
    allows (else None), the cast as of ``dy2d.to(as_dtype)`` when ``as_dtype`` is
    given (FP8 backward only); ``dy_amax``: amax(|dy2d|) as its producer reduced it,
    for a grad-output quantizer that casts with it given (``cast_given_amax``)."""
    run, saved = ctx.run, ctx.saved
    x_s, w_s = saved["x"], saved["w"]
    if run.fp8_backward:
        quantizer = ctx.quantizers.get("grad_output")
        if dy_amax is not None and not column_sums:
            return quantizer.cast_given_amax(dy2d, dy_amax, rowwise=need_dx, columnwise=need_dw), x_s, w_s, None
        if column_sums:
            dy_q, sums = quantizer.quantize_with_column_sums(dy2d, rowwise=need_dx, columnwise=need_dw,
                                                             as_dtype=as_dtype, sums_dtype=sums_dtype)
            return dy_q, x_s, w_s, sums
        return quantizer.cast(dy2d, rowwise=need_dx, columnwise=need_dw), x_s, w_s, None
    if isinstance(x_s, QuantizedTensor):  # 'dequantized': (M, K), whatever dims the forward's x had
        x_s = x_s.dequantize(run.compute_dtype)
        if x_s.dim() != 2:
            x_s = x_s.reshape(-1, x_s.shape[-1])
    if isinstance(w_s, QuantizedTensor):
        w_s = w_s.dequantize(run.compute_dtype)
    # high precision: the bias's own sum (fp32, then its dtype), as the unfused bias computes it
    return dy2d, x_s, w_s, (dy2d.sum(dim=0, dtype=torch.float32).to(sums_dtype) if column_sums else None)


def linear_backward(
    ctx: OpContext, op: BasicLinear, dy: torch.Tensor, grad_residual: torch.Tensor | None = None,
    dy_scale: float | None = None, dy_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dgrad (plus ``grad_residual``, a gradient to add to dx) and wgrad; with
    ``dy_scale``, those of ``dy_scale · dy`` (see :func:`_scaled_operands`); with
    ``dy_amax`` (amax(|dy|), a one-element fp32 tensor its producer reduced), dy's
    FP8 cast takes it as given (``cast_given_amax``: the grad-output quantizer must
    have one) where dy comes in the compute dtype, else it is not used."""
    dx, dw, _ = linear_backward_with_column_sums(ctx, op, dy, grad_residual, column_sums=False, dy_scale=dy_scale,
                                                 dy_amax=dy_amax)
    return dx, dw


def _scaled_operands(ctx: OpContext, dy2d: torch.Tensor, need_dx: bool, need_dw: bool, dy_scale: float):
    """The backward operands of ``dy_scale · dy``. A stateless per-tensor FP8 cast of
    dy takes the factor into its dequantization scales, so both backward GEMMs apply
    it in their fp32 epilogue (dy is read once, by its cast); a cast with scaling
    state (delayed scaling) casts ``dy_scale · dy``, so its amax history records
    what the unfused ops' would, as do the other scalings and high precision."""
    run = ctx.run
    quantizer = ctx.quantizers.get("grad_output") if run.fp8_backward else None
    if quantizer is None or quantizer.scaling != Scaling.TENSOR or quantizer.STATE_TENSORS:
        return _backward_operands(ctx, dy2d * dy_scale, need_dx, need_dw)
    dy_q, x_s, w_s, _ = _backward_operands(ctx, dy2d, need_dx, need_dw)
    row, col = (None if c is None else ScaledOperand(c.data, c.scale_inv * dy_scale, c.scaling)
                for c in (dy_q.rowwise, dy_q.columnwise))
    return QuantizedTensor(row, col, dy_q.shape, dy_q.dtype), x_s, w_s, None


def linear_backward_with_column_sums(
    ctx: OpContext, op: BasicLinear, dy: torch.Tensor, grad_residual: torch.Tensor | None = None,
    column_sums: bool = True, dy_scale: float | None = None, sums_dtype: torch.dtype = torch.float32,
    dy_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dgrad, wgrad and (with ``column_sums``) dy's column sums, the gradient of a
    bias on this linear's output, read from dy by its cast where it can: summed in
    fp32 and returned as ``sums_dtype`` (fp32, or bf16 for a bf16 bias, rounded
    once where the sums are added up)."""
    run = ctx.run
    dtype = run.compute_dtype
    dy_shape = dy.shape
    # an FP8 cast takes dy as it comes, as its 2-D flattening; the high-precision GEMMs read (M, N)
    flat_cast = run.fp8_backward and getattr(ctx.quantizers.get("grad_output"), "flattens", False)
    dy2d = dy if (len(dy_shape) == 2 or flat_cast) else dy.reshape(-1, op.out_features)  # (M, N), or (..., N) to cast
    as_dtype = None
    if dy2d.dtype is not dtype:
        if column_sums and run.fp8_backward and dy_scale is None:
            # dy's cast reads dy as it came and casts it as the compute dtype would hold
            # it (a scheme that can rounds as it reads); the sums are of dy as it came
            as_dtype = dtype
        else:
            dy2d = dy2d.to(dtype)
            dy_amax = None  # an amax of dy as it came, not as cast
    need_dx = ctx.needs_input_grad
    need_dw = ctx.param_needs_grad[0] if ctx.param_needs_grad else ctx.saved["w_requires_grad"]
    if dy_scale is None:
        dy_q, x_s, w_s, sums = _backward_operands(ctx, dy2d, need_dx, need_dw, column_sums, as_dtype, sums_dtype,
                                                  dy_amax)
    else:
        dy_q, x_s, w_s, sums = _scaled_operands(ctx, dy2d, need_dx, need_dw, dy_scale)
    dx = dw = None
    if need_dx:
        x_shape = ctx.saved["x_shape"]
        # (..., K) in dy's dims (x's), with the residual gradient in them too, where the GEMM takes them
        dx2d = _gemm_columnwise(rowwise(dy_q), w_s, dtype, residual=grad_residual, fast_accum=run.fast_accum_dgrad,
                                a_shape=dy_shape)
        dx = dx2d if dx2d.shape == x_shape else dx2d.reshape(x_shape)
    if need_dw and op.accumulate_into_main_grad:
        dw = _wgrad_into_main_grad(ctx, op, dy_q, x_s)
    elif need_dw:
        w_dtype = ctx.saved["w_dtype"]
        # FP8 operands accumulate in fp32 and write the weight's dtype at once; high
        # precision runs on the compute dtype's tensor cores and converts after, as
        # torch.autocast's backward of a linear does (never an fp32 GEMM of bf16 data)
        out_dtype = w_dtype if run.fp8_backward else dtype
        dw = _gemm_columnwise(columnwise(dy_q), x_s, out_dtype, fast_accum=run.fast_accum_wgrad)  # (N, K)
        if dw.dtype is not w_dtype:
            dw = dw.to(w_dtype)
    return dx, dw, sums


_PLAIN = (torch.Tensor, nn.Parameter)  # tensors torch's own mm takes as they are (no subclass to consult)


def _gemm_columnwise(a, b, out_dtype: torch.dtype, residual: torch.Tensor | None = None, fast_accum: bool = False,
                     a_shape: torch.Size | None = None):
    """``gemm(a, columnwise(b), ...)``: a backward GEMM of ``a`` (P, R) and the saved
    ``b`` (R, Q) (dgrad ``dy · w``, wgrad ``dyᵀ · x``). Plain ``a`` and ``b`` in
    ``out_dtype`` without a residual are ``torch.mm(a, b)``: the very call that
    ``gemm`` makes for ``b.t()`` (``b.t().t()`` has ``b``'s own layout), without its
    two transposes. ``a_shape``: as :func:`~te_fuser.ops.gemm.gemm`'s (the result
    then in its dims, or 2-D where torch's mm runs)."""
    if type(b) is QuantizedTensor:
        return gemm(a, b.columnwise, out_dtype, residual=residual, fast_accum=fast_accum, a_shape=a_shape)
    if residual is None and type(a) in _PLAIN and type(b) in _PLAIN and a.dtype is out_dtype \
            and b.dtype is out_dtype:
        return torch.mm(a, b)
    return gemm(a, columnwise(b), out_dtype, residual=residual, fast_accum=fast_accum, a_shape=a_shape)


def _main_grad(op: BasicLinear) -> torch.Tensor:
    weight = op.weight
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(f"{op.describe()}: accumulate_into_main_grad=True, but its weight has no main_grad "
                           "(attach an fp32 buffer of the weight's shape as weight.main_grad before the backward)")
    if tuple(main_grad.shape) != tuple(weight.shape):
        raise ValueError(f"{op.describe()}: weight.main_grad has shape {tuple(main_grad.shape)}, the weight "
                         f"{tuple(weight.shape)}")
    return main_grad.detach()


def _wgrad_into_main_grad(ctx: OpContext, op: BasicLinear, dy_q, x_s) -> "torch.Tensor | None":
    """``main_grad += dyᵀ · x`` (``=`` with ``overwrite_main_grad``) in fp32; returns what
    autograd gets for the weight: None, or a dummy when the weight has
    ``grad_added_to_main_grad`` (TransformerEngine's Megatron-LM protocol)."""
    run, weight = ctx.run, op.weight
    main_grad = _main_grad(op)
    dw = _gemm_fp32(columnwise(dy_q), columnwise(x_s), run.fast_accum_wgrad)  # (N, K) fp32
    if getattr(weight, "overwrite_main_grad", False):
        main_grad.copy_(dw)
    else:
        main_grad.add_(dw)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return dummy_wgrad(tuple(weight.shape), weight.dtype, weight.device, zero=getattr(weight, "zero_out_wgrad", False))


_DUMMY_WGRADS: dict = {}


def dummy_wgrad(shape: tuple, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """The placeholder ``.grad`` of a weight whose gradient went into ``main_grad``: one
    buffer per shape, dtype and device, kept (TransformerEngine's ``get_dummy_wgrad``);
    zeroed when ``zero``, else its contents are unspecified."""
    key = (shape, dtype, torch.device(device))
    buf = _DUMMY_WGRADS.get(key)
    if buf is None:
        buf = _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype, device=device)
    if zero:
        buf.zero_()
    return buf


def linear_bias_activation_forward(ctxs, ops, x):
    """``act(x · wᵀ + b)`` for ``ops`` = [linear, bias?, activation?]: the bias (and,
    when no backward needs the pre-activation, the activation too) in the GEMM's
    fp32 epilogue; ``x`` may be a QuantizedTensor (see ``linear_forward``)."""
    linear = ops[0]
    if len(ops) == 1:
        return linear_forward(ctxs[0], linear, x)
    run = ctxs[0].run
    b = ops[1].bias_as(run.compute_dtype)
    act = ops[2] if len(ops) > 2 else None
    if act is None:
        return linear_forward(ctxs[0], linear, x, bias=b)
    if not run.needs_backward:
        return linear_forward(ctxs[0], linear, x, bias=b, activation=act.kind)
    pre = linear_forward(ctxs[0], linear, x, bias=b)
    return act.forward_reducing_amax(ctxs[2], pre)  # the op's own forward: what its backward reads saved as it saves it


def linear_bias_add_forward(ctxs, ops, x, residual, scale: float | None = None):
    """``x · wᵀ [+ b] + residual`` for ``ops`` = [linear, bias?, add], or with ``scale``
    ``scale · (x · wᵀ) + residual`` for [linear, ConstantScale, add], the residual
    (and bias, scale) applied in fp32 before the one rounding; ``x`` may be a
    QuantizedTensor (see ``linear_forward``). An in-place add writes the sum into
    the residual's buffer (``AddExtraInput.place``)."""
    linear, add = ops[0], ops[-1]
    out_shape = (*x.shape[:-1], linear.out_features)
    if tuple(residual.shape) != out_shape:
        raise ValueError(f"{add.describe()}: extra input shape {tuple(residual.shape)} != {out_shape}")
    if scale is not None:
        return add.place(linear_forward(ctxs[0], linear, x, residual=residual, weight_scale=scale), residual)
    # the bias as it is, added as bias.to(compute dtype): a kernel that rounds it as it reads it saves the copy
    bias = ops[1].bias if len(ops) == 3 else None
    return add.place(linear_forward(ctxs[0], linear, x, bias=bias, residual=residual,
                                    bias_round=ctxs[0].run.compute_dtype), residual)


def _per_tensor(operand) -> bool:
    return isinstance(operand, ScaledOperand) and operand.scaling == Scaling.TENSOR
