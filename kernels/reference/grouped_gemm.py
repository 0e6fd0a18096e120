"""Reference grouped GEMMs (mixture-of-experts layers): one GEMM per group.

A grouped linear layer of G experts, weights ``w_g`` (N, K) stacked as one
(G·N, K) operand, with the tokens of expert g the rows ``offsets[g]:offsets[g+1]``
of one activation x (M, K) (``offsets`` the prefix sums of the split sizes, from
0 to M; empty groups allowed):

- fprop ``y_g  = x_g · w_gᵀ (+ b_g)``  :func:`grouped_gemm_reference`, a = x (M, K),  b = w   (G·N, K);
  with ``bias_scale`` (M,) each row's bias is ``b_g · bias_scale[row]`` (a router's
  probabilities: TransformerEngine's ``scale_bias``)
- dgrad ``dx_g = dy_g · w_g``           :func:`grouped_gemm_reference`, a = dy (M, N), b = wᵀ's (G·K, N)
- wgrad ``dw_g = dy_gᵀ · x_g``          :func:`grouped_gemm_wgrad_reference`, a = dyᵀ (N, M), b = xᵀ (K, M)

Every operand is K-major (quantized along the reduction dim, as
:mod:`te_fuser.kernels.operand` states): a :class:`ScaledOperand` with ``tensor``
or ``row`` scales (one scale per group of b is a row scale repeated over the
group's rows) or a plain high-precision tensor. In the wgrad the reduction dim
is the grouped one: both operands' columns ``offsets[g]:offsets[g+1]``.
"""

from __future__ import annotations

import torch

from ..operand import ScaledOperand
from .cast import dequantize_reference

__all__ = ["grouped_gemm_reference", "grouped_gemm_wgrad_reference", "check_grouped_gemm", "check_grouped_bias"]


def _as_fp32(op: ScaledOperand | torch.Tensor) -> torch.Tensor:
    if isinstance(op, ScaledOperand):
        return dequantize_reference(op, torch.float32)
    return op.float()


def _matrix(op, kernel: str, name: str) -> torch.Tensor:
    if isinstance(op, ScaledOperand):
        return op.data
    if isinstance(op, torch.Tensor) and op.dim() == 2:
        return op
    got = tuple(op.shape) if isinstance(op, torch.Tensor) else type(op).__name__
    raise ValueError(f"{kernel}: {name} must be a 2-D ScaledOperand or tensor, got {got}")


def check_grouped_gemm(kernel: str, a, b, offsets: torch.Tensor, wgrad: bool) -> tuple[int, int, int, int]:
    """Shapes and devices of a grouped GEMM's arguments (never the values of
    ``offsets``: reading them would wait for the device). Returns ``(G, P, Q, R)``:
    fprop/dgrad a (P, R), b (G·Q, R); wgrad a (Q, P), b (R, P), P the grouped dim."""
    a_mat, b_mat = _matrix(a, kernel, "a"), _matrix(b, kernel, "b")
    if (not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 2
            or offsets.dtype not in (torch.int32, torch.int64)):
        got = (tuple(offsets.shape), offsets.dtype) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise ValueError(f"{kernel}: offsets must be a 1-D int32/int64 tensor of G+1 >= 2 prefix sums, got {got}")
    for name, t in (("b", b_mat), ("offsets", offsets)):
        if t.device != a_mat.device:
            raise ValueError(f"{kernel}: a is on {a_mat.device} but {name} is on {t.device}")
    groups = offsets.numel() - 1
    if a_mat.shape[1] != b_mat.shape[1]:
        raise ValueError(f"{kernel}: reduction dims differ: a is {tuple(a_mat.shape)}, b is {tuple(b_mat.shape)}")
    if wgrad:
        return groups, a_mat.shape[1], a_mat.shape[0], b_mat.shape[0]
    if b_mat.shape[0] % groups:
        raise ValueError(f"{kernel}: b's {b_mat.shape[0]} rows are not {groups} groups of equal size")
    return groups, a_mat.shape[0], b_mat.shape[0] // groups, a_mat.shape[1]


def check_grouped_bias(kernel: str, bias, bias_scale, groups: int, p: int, q: int, device: torch.device):
    """``(bias, bias_scale)`` contiguous, after checking them: bias (G, Q), bias_scale
    (P,) of a floating dtype, only with a bias, both on ``device``."""
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (groups, q) or bias.device != device:
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{kernel}: bias must be a ({groups}, {q}) tensor on {device}, got {got}")
        bias = bias.contiguous()
    if bias_scale is not None:
        if bias is None:
            raise ValueError(f"{kernel}: bias_scale scales the bias, and there is none")
        if (not isinstance(bias_scale, torch.Tensor) or bias_scale.shape != (p,) or bias_scale.device != device
                or not bias_scale.dtype.is_floating_point):
            got = ((tuple(bias_scale.shape), bias_scale.dtype, str(bias_scale.device))
                   if isinstance(bias_scale, torch.Tensor) else type(bias_scale).__name__)
            raise ValueError(f"{kernel}: bias_scale must be a floating ({p},) tensor (one scale per row) on "
                             f"{device}, got {got}")
        bias_scale = bias_scale.contiguous()
    return bias, bias_scale


def _bounds(offsets: torch.Tensor, total: int, kernel: str) -> list[int]:
    bounds = [int(v) for v in offsets.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"{kernel}: offsets must rise from 0 to {total}, got {bounds}")
    return bounds


def grouped_gemm_reference(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    bias_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out (P, Q)`` with rows ``offsets[g]:offsets[g+1]`` equal to
    ``a[those rows] @ b[g·Q:(g+1)·Q].T + bias[g]`` in fp32 (the bias times
    ``bias_scale[row]`` when given), cast to ``out_dtype``; a (P, R), b (G·Q, R),
    offsets (G+1,), bias (G, Q), bias_scale (P,)."""
    groups, p, q, _ = check_grouped_gemm("grouped_gemm", a, b, offsets, wgrad=False)
    a_mat = a.data if isinstance(a, ScaledOperand) else a
    bias, bias_scale = check_grouped_bias("grouped_gemm", bias, bias_scale, groups, p, q, a_mat.device)
    bounds = _bounds(offsets, p, "grouped_gemm")
    a32, b32 = _as_fp32(a), _as_fp32(b)
    out = torch.empty(p, q, dtype=torch.float32, device=a32.device)
    for g in range(groups):
        s, e = bounds[g], bounds[g + 1]
        out[s:e] = a32[s:e] @ b32[g * q:(g + 1) * q].t()
        if bias_scale is not None:
            out[s:e] += bias[g].float() * bias_scale[s:e, None].float()
        elif bias is not None:
            out[s:e] += bias[g].float()
    return out.to(out_dtype)


def grouped_gemm_wgrad_reference(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``out (G·Q, R)`` with ``out[g·Q:(g+1)·Q] = a[:, s:e] @ b[:, s:e].T`` in fp32,
    ``s:e = offsets[g]:offsets[g+1]`` (zeros for an empty group), cast to
    ``out_dtype``; a (Q, P), b (R, P): the grouped dim P is the reduction."""
    groups, p, q, r = check_grouped_gemm("grouped_gemm_wgrad", a, b, offsets, wgrad=True)
    bounds = _bounds(offsets, p, "grouped_gemm_wgrad")
    a32, b32 = _as_fp32(a), _as_fp32(b)
    out = torch.empty(groups * q, r, dtype=torch.float32, device=a32.device)
    for g in range(groups):
        s, e = bounds[g], bounds[g + 1]
        out[g * q:(g + 1) * q] = a32[:, s:e] @ b32[:, s:e].t()
    return out.to(out_dtype)
