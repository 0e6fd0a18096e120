"""LayerNorm, RMSNorm and L2Normalization over the last dim, computed in fp32.

LayerNorm runs the backend's ``layer_norm`` / ``layer_norm_grad`` kernels, RMSNorm
its ``rms_norm`` / ``rms_norm_grad``: on the GPU one pass each, forward and
backward (Triton; a LayerNorm of fewer than 32M elements CUDA launched from
C++, whose launch costs the host less), reading the operands in their own dtypes
(an fp32 residual stream, a bf16 gradient) and writing the output in the compute
dtype, so no fp32 copy goes in and no dtype copy comes out; the reference is
torch's own fp32 ops (``native_layer_norm`` and ``native_layer_norm_backward``
for LayerNorm). The forward keeps the rows' statistics (mean and reciprocal standard deviation) for
the backward, which does not recompute them. LayerNorm's backward can also add a
residual branch's gradient of its input in its kernel (``op_backward_adding``; the
fuser uses it for ``seq(x, x)``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import backend
from ..op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm", "L2Normalization", "rms_norm_backward"]


class _Norm(BasicOperation):
    """Normalizes over the trailing ``normalized_shape`` dims (an int: the last dim).

    ``zero_centered_gamma`` (TransformerEngine's argument): the weight is stored as
    ``gamma - 1`` and starts at zero (weight decay then pulls gamma towards 1, not
    0); the norm scales by ``weight + 1``, computed in fp32.
    """

    module_type = "norm"

    def __init__(self, normalized_shape, eps: float, bias: bool, device, dtype, name,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__(name)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
            raise ValueError(f"{type(self).__name__}.normalized_shape: must be a positive integer or a tuple of "
                             f"them, got {normalized_shape!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"{type(self).__name__}.eps: must be a positive float, got {eps!r}")
        if not isinstance(zero_centered_gamma, bool):
            raise TypeError(f"{type(self).__name__}.zero_centered_gamma: must be a bool, got {zero_centered_gamma!r}")
        self.normalized_shape, self.size, self.eps = shape, math.prod(shape), float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The scale 1 (its weight 0 under ``zero_centered_gamma``) and the bias 0
        again, in place (after ``to_empty``, or to start over)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def gamma(self) -> torch.Tensor:
        """The scale the norm applies, flattened (N,): the weight, or ``weight + 1`` in
        fp32 under ``zero_centered_gamma``."""
        w = self.weight
        if w.dim() != 1:
            w = w.reshape(self.size)
        return w.float() + 1.0 if self.zero_centered_gamma else w

    def extra_repr(self) -> str:
        size = self.size if len(self.normalized_shape) == 1 else self.normalized_shape
        return f"{size}, eps={self.eps}" + (", zero_centered_gamma=True" if self.zero_centered_gamma else "")

    def check_shapes(self, in_shape, quantizers):
        k = len(self.normalized_shape)
        if tuple(in_shape[-k:]) != self.normalized_shape:
            if k == 1:
                raise ValueError(f"{self.describe()}: input's last dim is {in_shape[-1] if len(in_shape) else None}, "
                                 f"expected {self.normalized_shape[0]}")
            raise ValueError(f"{self.describe()}: input's trailing dims are {tuple(in_shape[-k:])}, expected "
                             f"{self.normalized_shape}")
        return in_shape


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias``, as torch.nn.LayerNorm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None, name=None,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__(normalized_shape, eps, True, device, dtype, name, zero_centered_gamma)

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        """The scale, flattened (N,): the weight as it is (the kernels widen it to
        fp32), or ``weight + 1`` in fp32."""
        scale = weight.float() + 1.0 if self.zero_centered_gamma else weight
        return scale if scale.dim() == 1 else scale.reshape(-1)

    def op_forward(self, ctx, x, extra_inputs):
        # the trailing normalized_shape dims of x normalized as x flattened to (M, N)
        run = ctx.run
        bias = self.bias
        bias = bias if bias.dim() == 1 else bias.reshape(-1)
        scale = self._scale(self.weight)
        norm = backend.resolve("layer_norm", x.device).fn
        lean = getattr(norm, "lean", None)
        # a lean entry normalizes x of any dims over its last as it comes, y of x's shape
        out = lean(x, scale, bias, self.eps, run.compute_dtype) if (
            lean is not None and len(self.normalized_shape) == 1) else None
        x2d = x
        if out is None:
            x2d = x if x.dim() == 2 and len(self.normalized_shape) == 1 else x.reshape(-1, self.size)
            out = norm(x2d, scale, bias, self.eps, run.compute_dtype)
        y, mean, rstd = out
        if run.needs_backward:
            ctx.saved["x"], ctx.saved["stats"] = x2d, (mean, rstd)  # x as the kernel read it
        return (y if y.shape == x.shape else y.reshape(x.shape)), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        """The LayerNorm gradient in fp32 from the saved input and statistics (no
        autograd: it also runs inside custom ops, below it); dweight and dbias come in
        the parameters' shape and dtype."""
        dx, pgrads = self.op_backward_adding(ctx, dy, None)
        return dx, pgrads, []

    adds_input_grad = True

    def op_backward_adding(self, ctx, dy, grad_add):
        """:meth:`op_backward`'s dx and parameter gradients, with ``grad_add`` (x's
        shape, or None) added to dx by the kernel in fp32 before its rounding."""
        x_s, (mean, rstd) = ctx.saved["x"], ctx.saved["stats"]  # x as the forward's kernel read it
        weight, bias = self.weight, self.bias
        need_w, need_b = ctx.param_needs_grad or (weight.requires_grad, bias.requires_grad)
        grad = backend.resolve("layer_norm_grad", x_s.device).fn
        scale, lean = self._scale(weight), getattr(grad, "lean", None)
        # a lean entry takes dy and grad_add of x's shape as they come, dx of it too
        out = None if lean is None else lean(dy, x_s, scale, mean, rstd, grad_add)
        if out is None:
            x2d = x_s if x_s.dim() == 2 else x_s.reshape(-1, self.size)  # (M, N)
            as_x = (lambda t: t if t.dim() == 2 and t.shape == x2d.shape else t.reshape(x2d.shape))
            out = grad(as_x(dy), x2d, scale, mean, rstd, grad_add=None if grad_add is None else as_x(grad_add))
        dx, dw, db = out
        pgrads = [None if not need else _as_param(g, p) for g, p, need in ((dw, weight, need_w), (db, bias, need_b))]
        return (dx if dx.shape == dy.shape else dx.reshape(dy.shape)), pgrads


class RMSNorm(_Norm):
    """``x / sqrt(mean(x**2) + eps) * weight``, as torch.nn.RMSNorm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, device=None, dtype=None, name=None,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__(normalized_shape, eps, False, device, dtype, name, zero_centered_gamma)

    def op_forward(self, ctx, x, extra_inputs):
        x2d = x.reshape(-1, self.size)  # (M, N)
        y2d, rstd = backend.resolve("rms_norm", x.device).fn(x2d, self.gamma(), self.eps, ctx.run.compute_dtype)
        if ctx.run.needs_backward:
            ctx.saved["x"], ctx.saved["rstd"] = x, rstd
        return y2d.reshape(x.shape), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        dx, dw = rms_norm_backward(ctx, self, dy)
        return dx, [dw], []


def _as_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient ``g`` in parameter ``p``'s shape and dtype (no call where it already is)."""
    g = g if g.dim() == p.dim() else g.reshape(p.shape)
    return g if g.dtype is p.dtype else g.to(p.dtype)


def rms_norm_backward(ctx, op: RMSNorm, dy: torch.Tensor, grad_add: torch.Tensor | None = None):
    """``(dx, dweight)`` of ``op``; with ``grad_add`` (the gradient of a branch taken
    before the norm, ``MakeExtraOutput -> RMSNorm``) dx is the norm's gradient plus
    it, summed in fp32 and rounded once to x's dtype: the two terms may cancel, and
    a norm gradient rounded first would leave that rounding's error in the sum."""
    x, rstd = ctx.saved["x"], ctx.saved["rstd"]
    x2d = x.reshape(-1, op.size)  # (M, N)
    dy2d = dy.reshape(-1, op.size)
    grad = backend.resolve("rms_norm_grad", x.device).fn
    gamma = op.gamma()
    if grad_add is None:
        dx2d, dw = grad(dy2d, x2d, gamma, rstd, op.eps)
    else:
        dx2d, dw = grad(dy2d, x2d.float(), gamma, rstd, op.eps)  # dx in fp32
        dx2d = (dx2d + grad_add.reshape(-1, op.size)).to(x.dtype)
    return dx2d.reshape(x.shape), _as_param(dw, op.weight)


class L2Normalization(BasicOperation):
    """``x / sqrt(sum(x**2) + eps)`` over the last dim, without parameters
    (TransformerEngine's L2Normalization: query-key normalization in attention).

    Computed in fp32 (float64 for float64 input) and rounded once to the compute
    dtype; the backward, ``dx = r·dy - r³·x·Σ(dy·x)`` with ``r = 1/sqrt(Σx² + eps)``,
    reads the forward's ``r``. ``seq_length`` and ``micro_batch_size`` (TE's JIT
    warm-up sizes) are accepted and need nothing here.
    """

    module_type = "norm"

    def __init__(self, *, eps: float = 1e-6, seq_length: int | None = None, micro_batch_size: int | None = None,
                 name=None) -> None:
        super().__init__(name)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise ValueError(f"L2Normalization.eps: must be a finite float > 0, got {eps!r}")
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def op_forward(self, ctx, x, extra_inputs):
        x32 = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        r = torch.rsqrt(x32.square().sum(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        if ctx.run.needs_backward:
            ctx.saved["x"], ctx.saved["r"] = x, r
        return (x32 * r).to(ctx.run.compute_dtype), []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x, r = ctx.saved["x"], ctx.saved["r"]
        x32, dy32 = x.to(r.dtype), dy.to(r.dtype)
        dx = r * dy32 - r.pow(3) * x32 * (dy32 * x32).sum(dim=-1, keepdim=True)
        return dx.to(x.dtype), [], []
