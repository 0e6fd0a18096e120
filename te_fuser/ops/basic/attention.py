"""DotProductAttention: scaled dot-product attention on the fused QKV tensor.

The input is the QKV projection's output: (tokens, (H + 2·Hkv)·D) for one
sequence, or (B, T, (H + 2·Hkv)·D); per token the H query heads, then the Hkv
key heads, then the Hkv value heads, D values each. The output is (tokens, H·D)
or (B, T, H·D), the heads side by side, what the output projection reads.
Grouped-query attention: query head ``h`` reads kv head ``h // (H // Hkv)``;
``causal``: query ``i`` sees the keys ``j <= i``; ``softmax_scale`` defaults to
``1 / sqrt(D)``. The kernels (``attention_forward``, ``attention_backward``,
``attention_forward_fp8``) are the backend's, through ``backend.resolve``; they
take q (B, H, T, D) and k, v (B, Hkv, T, D).

Precision. One function decides, :func:`fp8_attention`: attention runs in FP8
when the plan quantizes and its ``qkv`` quantizer casts (the recipe has
``fp8_dpa`` or ``fp8_mha``: ``Recipe.quantizes`` gives attention's roles
identity quantizers otherwise, so under an FP8 recipe without them attention
runs in high precision, as in TransformerEngine).

- High precision: the compute dtype's q, k, v into ``attention_forward``; the
  backward is ``attention_backward`` from the forward's o and lse.
- FP8 (per-tensor recipes: delayed and current scaling). Roles, module type ``dpa``:

  - ``qkv``: casts the fused QKV tensor to E4M3 with one per-tensor scale (q, k
    and v share it), unless the QKV GEMM's epilogue already did
    (``ops/fused/forward_linear_bias_dpa_linear.py``, under ``fp8_mha``);
  - ``s``: the scale of the probabilities P. P lies in [0, 1], so its amax is
    known without looking: each forward the quantizer is fed a tensor of amax 1
    (delayed scaling's history holds 1s), and P is cast with the scale it gives
    that tensor, ``448 / 2**margin`` under delayed scaling, 448 under current
    scaling (256 with power-of-2 scales). Deterministic, and carried across
    recipe switches and checkpoints like any delayed-scaling state;
  - ``o``: casts the output O. Alone, attention hands O on dequantized (TE's
    ``fp8_dpa``: FP8 in, FP8 out, cast back at the boundary); followed by a
    linear under ``fp8_mha`` it hands the FP8 O to that linear's GEMM
    (``ops/fused/forward_dpa_linear.py``);
  - ``do``: the output gradient is cast and dequantized before the backward
    kernel (its FP8 grid: E5M2 under HYBRID), as TE's FP8 backward reads dO.

  The backward is the high-precision kernel on the dequantized q, k, v (saved
  as their FP8 bytes) with the FP8 forward's o and lse: straight-through for P's
  rounding. ``backward_override='dequantized'`` keeps dO in high precision;
  ``'high_precision'`` saves the high-precision q, k, v and keeps dO too.
  Block, per-row and MXFP8 quantizers cannot feed the FP8 kernel (one scale per
  tensor): a plan with such quantizers for ``qkv`` or ``s`` is refused at build
  time (:meth:`DotProductAttention.check_shapes`), naming the op and the fields.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ... import backend
from ...kernels.formats import Scaling
from ...kernels.operand import ScaledOperand
from ...kernels.reference.attention import ATTENTION_FP8_HEAD_DIMS, ATTENTION_HEAD_DIMS
from ...quantization.identity import IdentityQuantizer
from ...quantization.role import ATTENTION_MODULE_TYPE
from ...quantization.tensor import QuantizedTensor
from ..op import BasicOperation, OpContext
from .linear import input_needs_columnwise, linear_bias_activation_forward, linear_bias_add_forward

__all__ = ["DotProductAttention", "fp8_attention", "attention_forward", "attention_backward",
           "attention_linear_forward", "check_head_counts"]

_E4M3 = torch.float8_e4m3fn
_FP8_FIELDS = "fp8_dpa / fp8_mha"


def fp8_attention(quantizers: dict) -> bool:
    """Whether attention's quantizers cast (FP8 attention) or are identities (high
    precision): the one place that decides. A plan that does not quantize never
    asks (calibration and high precision run the high-precision kernels)."""
    q = quantizers.get("qkv")
    return q is not None and q.scaling != "identity"


def _positive_int(owner: str, field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{field}: must be a positive integer, got {value!r}")
    return value


def check_head_counts(owner: str, num_heads, head_dim, num_kv_heads) -> tuple[int, int, int]:
    """``(H, D, Hkv)`` validated for ``owner`` (an op's class name): positive, and
    the kv heads dividing the query heads (grouped-query attention)."""
    heads = _positive_int(owner, "num_heads", num_heads)
    dim = _positive_int(owner, "head_dim", head_dim)
    kv = heads if num_kv_heads is None else _positive_int(owner, "num_kv_heads", num_kv_heads)
    if heads % kv:
        raise ValueError(f"{owner}.num_kv_heads: must divide num_heads ({heads}): each kv head serves "
                         f"num_heads / num_kv_heads query heads (grouped-query attention), got {kv}")
    return heads, dim, kv


class DotProductAttention(BasicOperation):
    """``softmax(q kᵀ · softmax_scale [+ causal mask]) v`` per head, on the fused QKV
    tensor (see the module docstring for layouts, precision and roles)."""

    module_type = ATTENTION_MODULE_TYPE
    forward_roles = ("qkv", "s", "o")
    backward_roles = ("do",)

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None, *, causal: bool = True,
                 softmax_scale: float | None = None, name=None) -> None:
        super().__init__(name)
        owner = type(self).__name__
        self.num_heads, self.head_dim, self.num_kv_heads = check_head_counts(owner, num_heads, head_dim,
                                                                             num_kv_heads)
        if head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"{owner}.head_dim: the attention kernels take head dims {list(ATTENTION_HEAD_DIMS)}, "
                             f"got {head_dim}")
        if not isinstance(causal, bool):
            raise TypeError(f"{owner}.causal: must be True or False, got {causal!r}")
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_dim)
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"{owner}.softmax_scale: must be a finite float > 0 or None, got {softmax_scale!r}")
        self.causal, self.softmax_scale = causal, float(softmax_scale)
        self.qkv_width = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.out_width = self.num_heads * head_dim

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_kv_heads={self.num_kv_heads}, "
                f"causal={self.causal}")

    def check_shapes(self, in_shape, quantizers):
        who = self.describe()
        if len(in_shape) not in (2, 3):
            raise ValueError(f"{who}: input must be (tokens, width) or (batch, seq, width), got {tuple(in_shape)}")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if in_shape[-1] != self.qkv_width:
            raise ValueError(f"{who}: input's last dim is {in_shape[-1]}; the fused QKV tensor of {H} query heads "
                             f"and {Hkv} kv heads of head dim {D} is ({H} + 2*{Hkv})*{D} = {self.qkv_width} wide")
        if in_shape[-2] == 0:
            raise ValueError(f"{who}: the sequence must hold at least one token, got input {tuple(in_shape)}")
        if fp8_attention(quantizers):
            self._check_fp8(in_shape, quantizers)
        return torch.Size((*in_shape[:-1], self.out_width))

    def _check_fp8(self, in_shape, quantizers) -> None:
        who = self.describe()
        if self.head_dim not in ATTENTION_FP8_HEAD_DIMS:
            raise ValueError(f"{who}: the recipe's {_FP8_FIELDS} run attention in FP8, whose kernel takes head dims "
                             f"{list(ATTENTION_FP8_HEAD_DIMS)}, got {self.head_dim}")
        for role in ("qkv", "s"):
            q = quantizers[role]
            if q.scaling != Scaling.TENSOR or q.fp8_dtype != _E4M3:
                raise ValueError(
                    f"{who}: the recipe's {_FP8_FIELDS} run attention in FP8, whose kernel takes E4M3 operands with "
                    f"one scale per tensor; the quantizer for {q.role or role} is {q.describe()}: use DelayedScaling "
                    f"or Float8CurrentScaling (E4M3 or HYBRID) for FP8 attention, or fp8_dpa=False and fp8_mha=False")
        rows = math.prod(in_shape[:-1])
        quantizers["qkv"].check_shape((rows, self.qkv_width), rowwise=True)
        for role in ("o", "do"):
            quantizers[role].check_shape((rows, self.out_width), rowwise=True, columnwise=role == "o")

    def install_quantizers(self, quantizers, key: str) -> None:
        """As every op's, and: a recipe that runs attention in high precision (identity
        quantizers, FP8 recipes without fp8_dpa / fp8_mha) leaves the FP8 roles'
        scaling state waiting, as a checkpoint's (saved with the op, continued by the
        next recipe that builds quantizers of its class: a delayed-scaling history
        goes on across ``fp8_dpa`` toggles instead of seeding again)."""
        parked = {t: {"class": type(q).__qualname__, "state": q.state_dict(), "recipe_key": self._quantizer_key}
                  for t, q in self._quantizers.items()
                  if isinstance(quantizers.get(t), IdentityQuantizer) and q.state_dict()}
        super().install_quantizers(quantizers, key)
        if parked:
            self._loaded_state = {**(self._loaded_state or {}), **parked}

    def op_forward(self, ctx: OpContext, x, extra_inputs: Sequence[torch.Tensor]):
        return attention_forward(ctx, self, x), []

    def op_backward(self, ctx: OpContext, dy, grad_extra_outputs):
        return attention_backward(ctx, self, dy), [], []

    # -- layouts ------------------------------------------------------------------
    def batch_and_seq(self, shape) -> tuple[int, int]:
        """``(B, T)`` of an input or output shape (2-D: one sequence)."""
        return (1, shape[0]) if len(shape) == 2 else (shape[0], shape[1])

    def split_heads(self, x: torch.Tensor, batch: int, seq: int):
        """q (B, H, T, D), k and v (B, Hkv, T, D) from the fused (..., W) ``x``: views of
        it, no copies (the kernels take any strides with a contiguous head dim)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        heads = x.reshape(batch, seq, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2 Hkv, T, D), a view
        return heads.split((H, Hkv, Hkv), dim=1)  # one call for the three views

    def merge_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, heads, T, D) -> (B, T, heads·D)."""
        B, n, T, D = t.shape
        return t.transpose(1, 2).reshape(B, T, n * D)


# -- the forward ----------------------------------------------------------------------


def _kernel(name: str, device: torch.device):
    """The backend's attention kernel ``name``, run outside ``torch.autocast``: the plan
    already computes in autocast's dtype, and a kernel's fp32 math (the reference's
    matmuls, the log-sum-exp) must not be cast down by it."""
    fn = backend.resolve(name, device).fn
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return fn

    def call(*args):
        # autocast's switch alone, off for the call and back on after (entering a
        # torch.autocast(enabled=False) region costs some twenty calls into torch a
        # kernel; nothing in a kernel call enters or leaves an autocast region)
        torch.set_autocast_enabled(kind, False)
        try:
            return fn(*args)
        finally:
            torch.set_autocast_enabled(kind, True)

    return call


def probability_scale(quantizer, device: torch.device) -> torch.Tensor:
    """The fp32 0-d scale P is cast with: the ``s`` quantizer's scale for a tensor of
    amax 1, P's bound (it also records that amax, so delayed scaling's history
    holds it)."""
    bound = torch.ones((1, 1), dtype=torch.float32, device=device)
    return torch.reciprocal(quantizer.cast(bound, rowwise=True).rowwise.scale_inv)


def _fp8_core(ctx: OpContext, op: DotProductAttention, x, batch: int, seq: int):
    """``(o, lse, saved q, k, v)`` of the FP8 forward; ``x`` high precision or already
    cast by the ``qkv`` quantizer."""
    run = ctx.run
    dtype = run.compute_dtype
    x_hp = None
    if isinstance(x, QuantizedTensor):
        x_q = x
    else:
        x_hp = x if x.dtype is dtype else x.to(dtype)
        x_q = ctx.quantizers["qkv"].cast(x_hp, rowwise=True)  # (M, W) E4M3, one scale
    data, scale_inv = x_q.rowwise.data, x_q.rowwise.scale_inv
    q8, k8, v8 = (t.view(_E4M3) for t in op.split_heads(data.view(torch.uint8), batch, seq))
    p_scale = probability_scale(ctx.quantizers["s"], data.device)
    o, lse = _kernel("attention_forward_fp8", data.device)(
        q8, k8, v8, scale_inv, scale_inv, scale_inv, p_scale, op.causal, op.softmax_scale, dtype)
    if run.backward_override == "high_precision":  # never with an input cast by the GEMM (the rule declines)
        saved = op.split_heads(x_hp, batch, seq)
    else:
        saved = (data, scale_inv)  # the fused (M, W) FP8 bytes: one dequantization in the backward
    return o, lse, saved


def attention_forward(ctx: OpContext, op: DotProductAttention, x, hand_off: bool | None = None):
    """Attention's forward; saves what :func:`attention_backward` needs in ``ctx``.

    ``x``: the high-precision fused QKV (..., W), or a :class:`QuantizedTensor` cast
    by this op's ``qkv`` quantizer (the QKV GEMM's epilogue cast it). Returns O
    (..., H·D) in the compute dtype; with ``hand_off`` (FP8 attention only) O as
    the ``o`` quantizer's QuantizedTensor, with its column-wise copy when True."""
    run = ctx.run
    dtype = run.compute_dtype
    shape = x.shape
    batch, seq = op.batch_and_seq(shape)
    out_shape = (*shape[:-1], op.out_width)
    fp8 = run.quantizing and fp8_attention(ctx.quantizers)
    if fp8:
        o, lse, saved = _fp8_core(ctx, op, x, batch, seq)
    else:
        x_hp = x if x.dtype is dtype else x.to(dtype)
        if run.calibrating and fp8_attention(ctx.quantizers):
            ctx.quantizers["qkv"].observe(x_hp)
        saved = op.split_heads(x_hp, batch, seq)
        o, lse = _kernel("attention_forward", x_hp.device)(*saved, op.causal, op.softmax_scale)
    if run.needs_backward:
        ctx.saved.update(qkv=saved, o=o, lse=lse, x_shape=shape, fp8=fp8)
    o_hp = op.merge_heads(o)  # (B, T, H·D)
    if len(shape) != 3:
        o_hp = o_hp.reshape(out_shape)  # (T, H·D) of one sequence
    if not fp8:
        if run.calibrating and fp8_attention(ctx.quantizers):
            ctx.quantizers["s"].observe(torch.ones((1, 1), device=o_hp.device))
            ctx.quantizers["o"].observe(o_hp)
        return o_hp
    o_q = ctx.quantizers["o"].cast(o_hp, rowwise=True, columnwise=bool(hand_off))
    return o_q if hand_off is not None else o_q.dequantize(dtype)


def attention_linear_forward(ctxs, ops, qkv, residual: torch.Tensor | None = None):
    """``ops`` = [attention, linear, bias?, add?]: attention's FP8 O (cast by its ``o``
    quantizer) straight into the linear's GEMM (the bias, and the residual
    ``residual`` of an ``AddExtraInput``, in its epilogue), when the plan runs FP8
    attention, the linear's input quantizer scales per tensor like ``o`` and the
    linear's backward may read an FP8 input; else the unfused equivalent (O
    dequantized, cast again by the linear)."""
    attention, linear = ops[0], ops[1]
    ctx_a, ctx_l = ctxs[0], ctxs[1]
    run = ctx_a.run
    x_quantizer = ctx_l.quantizers.get("input")
    if (run.quantizing and fp8_attention(ctx_a.quantizers) and run.backward_override != "high_precision"
            and x_quantizer is not None and x_quantizer.scaling == ctx_a.quantizers["o"].scaling):
        o = attention_forward(ctx_a, attention, qkv, hand_off=input_needs_columnwise(ctx_l, linear))
    else:
        o = attention_forward(ctx_a, attention, qkv)
    if residual is not None:
        return linear_bias_add_forward(ctxs[1:], ops[1:], o, residual)
    return linear_bias_activation_forward(ctxs[1:], ops[1:], o)


# -- the backward ---------------------------------------------------------------------


def _dequantized(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (M, W) FP8 QKV bytes with their one scale in ``dtype``."""
    operand = ScaledOperand(data, scale_inv, Scaling.TENSOR)
    return backend.resolve("dequantize", data.device).fn(operand, dtype)


def attention_backward(ctx: OpContext, op: DotProductAttention, dy: torch.Tensor) -> torch.Tensor | None:
    """dx (the fused QKV's gradient) from the saved q, k, v, o and lse."""
    run, saved = ctx.run, ctx.saved
    dtype = run.compute_dtype
    o, lse, x_shape = saved["o"], saved["lse"], saved["x_shape"]
    if len(saved["qkv"]) == 2:  # the FP8 forward's fused bytes and scale: dequantized once, split as views
        q, k, v = op.split_heads(_dequantized(*saved["qkv"], dtype), *op.batch_and_seq(x_shape))
    else:
        q, k, v = saved["qkv"]
    dy_hp = dy if dy.dtype is dtype else dy.to(dtype)
    if saved["fp8"] and run.fp8_backward:
        dy_hp = ctx.quantizers["do"].cast(dy_hp, rowwise=True).dequantize(dtype)
    B, H, T, D = o.shape
    do = dy_hp.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D), a view
    dq, dk, dv = _kernel("attention_backward", o.device)(q, k, v, o, lse, do, op.causal, op.softmax_scale)
    dx = _fused_gradient(dq, dk, dv)
    if dx is None:
        dx = torch.cat([op.merge_heads(dq), op.merge_heads(dk), op.merge_heads(dv)], dim=-1)  # (B, T, W)
    return dx.reshape(x_shape)


def _fused_gradient(dq, dk, dv) -> torch.Tensor | None:
    """The (B, T, H + 2·Hkv, D) tensor dq, dk and dv are consecutive head ranges of,
    when a kernel wrote them so (the Triton backward does), else None."""
    base = dq._base
    if base is None or dk._base is not base or dv._base is not base or base.dim() != 4:
        return None
    B, H, T, D = dq.shape
    Hkv = dk.shape[1]
    step = D * base.element_size()
    if (tuple(base.shape) != (B, T, H + 2 * Hkv, D) or not base.is_contiguous()
            or dq.data_ptr() != base.data_ptr() or dk.data_ptr() != base.data_ptr() + H * step
            or dv.data_ptr() != base.data_ptr() + (H + Hkv) * step):
        return None
    return base

