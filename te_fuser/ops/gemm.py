"""The GEMM entry point of the ops: picks the FP8 kernel or the high-precision path.

``gemm(a, b, ...)`` computes ``activation(a @ b.T + bias) + residual`` where each
operand is either a :class:`~te_fuser.kernels.operand.ScaledOperand` (FP8,
quantized along its last dim) or a high-precision tensor. Two FP8 operands go to
the backend's ``gemm`` kernel (epilogue in fp32, one rounding to ``out_dtype``).
When either operand is high precision (no recipe, an identity quantizer, a
``backward_override``), the other is dequantized and the product runs in
``out_dtype`` through torch (a bias in torch's linear, the rest of the epilogue
op by op) — so a model under an identity-only recipe matches a plain
high-precision model bit for bit.

``gemm_fp8_out(a, b, cast, round_to, ...)`` is the same GEMM whose epilogue also
casts the result, rounded to ``round_to`` first, as a quantizer's
:class:`~te_fuser.quantization.EpilogueCast` prescribes: the FP8 data equal
``quantizer(gemm(a, b, round_to, ...))``'s bit for bit.
"""

from __future__ import annotations

import torch

from .. import backend
from ..kernels.operand import ScaledOperand
from ..quantization.base import EpilogueCast
from ..quantization.tensor import QuantizedTensor

__all__ = ["gemm", "gemm_fp8_out", "rowwise", "columnwise", "apply_activation", "activation_backward", "bias_in"]

Operand = "ScaledOperand | torch.Tensor"


def rowwise(q: "QuantizedTensor | torch.Tensor") -> Operand:
    """The (M, K) operand of a quantized or plain 2-D tensor."""
    return q.rowwise if isinstance(q, QuantizedTensor) else q


def columnwise(q: "QuantizedTensor | torch.Tensor") -> Operand:
    """The transposed (K, M) operand of a quantized or plain 2-D tensor."""
    return q.columnwise if isinstance(q, QuantizedTensor) else q.t()


def _high_precision(op: Operand, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(op, ScaledOperand):
        return backend.resolve("dequantize", op.data.device).fn(op, dtype)
    return op if op.dtype == dtype else op.to(dtype)


def apply_activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``kind(x)`` computed in fp32 by the backend kernel, returned in ``x.dtype``."""
    return backend.resolve("activation", x.device).fn(x, kind, out_dtype=x.dtype)


def activation_backward(dy: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    dx = backend.resolve("activation_grad", x.device).fn(dy, x, kind)
    return dx if dx.dtype is x.dtype else dx.to(x.dtype)


def bias_in(bias: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``bias`` as ``dtype`` (itself when it already is, or when either is None)."""
    return bias if bias is None or dtype is None or bias.dtype is dtype else bias.to(dtype)


def gemm(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    fast_accum: bool = False,
    compute_dtype: torch.dtype | None = None,
    bias_round: torch.dtype | None = None,
    a_shape: torch.Size | None = None,
) -> torch.Tensor:
    """``activation(a (P, R) @ b (Q, R).T + bias) + residual`` as ``out_dtype``;
    ``fast_accum`` lets an FP8 GEMM promote its partial sums to fp32 only at the end.
    In high precision the product and its bias run in ``compute_dtype`` (default
    ``out_dtype``) as one torch linear (the bias added before the one rounding, as
    ``torch.nn.Linear`` does), then the activation, and the residual is added in
    torch's promoted dtype before the result becomes ``out_dtype``. ``bias_round``:
    the bias is ``bias.to(bias_round)`` (an fp32 parameter in a bf16 step); a kernel
    that can round it as it reads it gets it as it is, every other path a copy.
    ``a_shape``: the shape (..., R) of the tensor whose 2-D flattening ``a`` is; the
    result then has its dims, (..., Q), and ``residual`` may have them too (a kernel
    entry that takes them so spares the host a reshape on either side)."""
    if isinstance(a, ScaledOperand) and isinstance(b, ScaledOperand):
        fn = backend.resolve("gemm", a.data.device).fn
        tensorwise = getattr(fn, "tensorwise", None)  # the kernel's lean entry, where it has one
        if tensorwise is not None:
            out = tensorwise(a, b, out_dtype, bias, fast_accum, activation, residual, bias_round, a_shape)
            if out is not None:
                return out
        out = fn(a, b, out_dtype, bias=bias_in(bias, bias_round), activation=activation, residual=_rows(residual),
                 fast_accum=fast_accum)
        return _in_dims(out, a_shape)
    if a_shape is not None and len(a_shape) != 2 or residual is not None and residual.dim() != 2:
        return _in_dims(gemm(a, b, out_dtype, bias, activation, _rows(residual), fast_accum, compute_dtype,
                             bias_round), a_shape)
    bias = bias_in(bias, bias_round)
    compute = out_dtype if compute_dtype is None else compute_dtype
    a_hp = _high_precision(a, compute) if isinstance(a, ScaledOperand) or a.dtype is not compute else a
    b_hp = _high_precision(b, compute) if isinstance(b, ScaledOperand) or b.dtype is not compute else b
    if residual is not None and compute in _NARROW:
        return _gemm_residual_rounded_once(a_hp, b_hp, out_dtype, bias, activation, residual)
    if bias is not None and bias.dtype is not compute:
        bias = bias.to(compute)
    out = torch.nn.functional.linear(a_hp, b_hp, bias)  # the bias in the GEMM's epilogue, as torch.nn.Linear
    if activation is not None:
        out = apply_activation(out, activation)
    if residual is not None:
        out = out + residual
    return out if out.dtype is out_dtype else out.to(out_dtype)


_NARROW = (torch.bfloat16, torch.float16)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as its 2-D flattening (itself when it is 2-D, or None)."""
    return t if t is None or t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _in_dims(out: torch.Tensor, a_shape: torch.Size | None) -> torch.Tensor:
    """A 2-D result (P, Q) in the leading dims of ``a_shape``: (..., Q) (itself
    without a shape or with a 2-D one)."""
    return out if a_shape is None or len(a_shape) == 2 else out.reshape(*a_shape[:-1], out.shape[-1])


def _gemm_residual_rounded_once(a_hp, b_hp, out_dtype, bias, activation, residual) -> torch.Tensor:
    """The high-precision GEMM with a residual in bf16/fp16: the product accumulated
    and kept in fp32, bias, activation and residual added in fp32, one rounding to
    ``out_dtype`` — as an FP8 GEMM's epilogue (and cuBLAS's ``beta = 1``) does, so a
    residual add does not round the product first."""
    if a_hp.is_cuda:
        out = torch.mm(a_hp, b_hp.t(), out_dtype=torch.float32)  # bf16/fp16 tensor cores, fp32 result
    else:
        out = a_hp.float() @ b_hp.float().t()  # exact products, fp32 sums
    if bias is not None:
        out += bias  # in fp32: a narrower bias is widened exactly, in the add's own read
    if activation is not None:
        out = apply_activation(out, activation)
    out += residual
    return out.to(out_dtype)


def gemm_fp8_out(
    a: Operand,
    b: Operand,
    cast: EpilogueCast,
    round_to: torch.dtype,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The FP8 data (P, Q') of :func:`gemm`'s result in ``round_to``, cast as ``cast``
    prescribes (its amax written into ``cast.amax``): in the epilogue of one FP8
    kernel when both operands are FP8, else a high-precision GEMM and a cast."""
    if isinstance(a, ScaledOperand) and isinstance(b, ScaledOperand):
        fn = backend.resolve("gemm_fp8_out", a.data.device).fn
        data, _ = fn(a, b, cast.scale, cast.fp8_dtype, bias=bias, activation=activation, amax_out=cast.amax,
                     round_to=round_to, fast_accum=fast_accum)
        return data
    y = gemm(a, b, round_to, bias=bias, activation=activation, fast_accum=fast_accum)
    quantize = backend.resolve("quantize_tensorwise", y.device).fn
    data, _, _ = quantize(y, cast.scale, cast.fp8_dtype, rowwise=True, columnwise=False, amax_out=cast.amax)
    return data
