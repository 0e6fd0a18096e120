"""Reference scaled dot-product attention: forward, backward, and the FP8 forward.

Layout: ``q`` (B, H, Tq, D); ``k``, ``v`` (B, Hkv, Tk, D) with ``H % Hkv == 0``
(grouped-query attention: query head ``h`` reads kv head ``h // (H // Hkv)``).
``causal``: query ``i`` sees the keys ``j <= i`` (top-left aligned, as torch SDPA's
``is_causal``). ``softmax_scale`` multiplies ``q kᵀ`` before the softmax.

- forward: ``o = softmax(s) v`` with ``s = softmax_scale · q kᵀ`` (masked), and
  ``lse = log Σ_j exp(s_ij)`` (natural log), the statistic the backward reads.
- backward: from the forward's ``o`` and ``lse`` (as the fast kernels do),
  ``p = exp(s - lse)``, ``dv = pᵀ do``, ``dp = do vᵀ``, ``delta = rowsum(o ∘ do)``,
  ``ds = p ∘ (dp - delta)``, ``dq = softmax_scale · ds k``,
  ``dk = softmax_scale · dsᵀ q``; dk and dv are summed over the query heads that
  share a kv head.
- FP8 forward (see :func:`attention_forward_fp8_reference`).

Everything is computed in fp32 for bf16 / fp16 / fp32 / FP8 inputs and in float64
for float64 inputs (float64 on the CPU is the oracle). Grouped heads are handled
by viewing ``q`` as (B, Hkv, H / Hkv, Tq, D) against a broadcast ``k``: K and V are
never repeated.
"""

from __future__ import annotations

import math

import torch

from .cast import saturating_cast_reference

__all__ = ["attention_forward_reference", "attention_backward_reference", "attention_forward_fp8_reference"]

ATTENTION_INPUTS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ATTENTION_FP8_OUTPUTS = (torch.bfloat16, torch.float16, torch.float32)
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)  # what the Triton kernels tile (a whole head per tile)
ATTENTION_FP8_HEAD_DIMS = (32, 64, 128)  # FP8 tensor-core dots reduce over 32 or more elements


# ------------------------------------------------------------------- checks


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_qkv(q, k, v, kernel: str, dtypes: tuple, head_dims: tuple) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, H, Tq, D)" if name == "q" else "(B, Hkv, Tk, D)"
            raise ValueError(f"{kernel}: {name} must be 4-D {layout}, got shape {_shape(t)}")
    if q.dtype not in dtypes:
        raise ValueError(f"{kernel}: q must be one of {[str(d) for d in dtypes]}, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{kernel}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{kernel}: {name} is on {t.device} but q is on {q.device}")
    B, H, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{kernel}: k and v must have one shape (B, Hkv, Tk, D), got {_shape(k)} and {_shape(v)}")
    Bk, Hkv, Tk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"{kernel}: k and v must have q's batch size {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"{kernel}: k and v must have q's head dim {D}, got {Dk}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{kernel}: the query heads ({H}) must be a multiple of the kv heads ({Hkv})")
    if D not in head_dims:
        raise ValueError(f"{kernel}: head dim must be one of {list(head_dims)}, got {D}")
    if Tk == 0:
        raise ValueError(f"{kernel}: k and v must hold at least one key (Tk >= 1), got shape {_shape(k)}")
    return B, H, Hkv, Tq, Tk, D


def _check_flags(causal, softmax_scale, kernel: str) -> None:
    if not isinstance(causal, bool):
        raise ValueError(f"{kernel}: causal must be a bool, got {causal!r}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"{kernel}: softmax_scale must be a finite float > 0, got {softmax_scale!r}")


def check_attention(q, k, v, causal, softmax_scale, kernel: str = "attention_forward") -> tuple:
    """``(B, H, Hkv, Tq, Tk, D)`` of valid forward arguments, else a ValueError
    (TypeError for a non-tensor) naming the argument and the constraint. Every
    backend runs it before a launch."""
    dims = _check_qkv(q, k, v, kernel, ATTENTION_INPUTS, ATTENTION_HEAD_DIMS)
    _check_flags(causal, softmax_scale, kernel)
    return dims


def check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale) -> tuple:
    """:func:`check_attention` plus the forward's ``o``, ``lse`` and the gradient
    ``do``: o and do of q's shape, dtype and device; lse (B, H, Tq) in fp32 (float64
    for float64 inputs)."""
    kernel = "attention_backward"
    dims = check_attention(q, k, v, causal, softmax_scale, kernel)
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{kernel}: {name} must match q (shape {_shape(q)}, {q.dtype}, {q.device}), "
                             f"got shape {_shape(t)}, {t.dtype}, {t.device}")
    want = torch.float64 if q.dtype == torch.float64 else torch.float32
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"{kernel}: lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.shape != q.shape[:3] or lse.dtype != want or lse.device != q.device:
        raise ValueError(f"{kernel}: lse must be (B, H, Tq) = {tuple(q.shape[:3])} {want} on {q.device}, "
                         f"got shape {_shape(lse)}, {lse.dtype}, {lse.device}")
    return dims


def check_attention_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale,
                        out_dtype) -> tuple:
    """:func:`check_attention` for E4M3 ``q``, ``k``, ``v`` with their fp32 0-d
    scale_invs, the fp32 0-d ``p_scale`` and an ``out_dtype`` of bf16, fp16 or fp32."""
    kernel = "attention_forward_fp8"
    dims = _check_qkv(q, k, v, kernel, (torch.float8_e4m3fn,), ATTENTION_FP8_HEAD_DIMS)
    _check_flags(causal, softmax_scale, kernel)
    scales = (("q_scale_inv", q_scale_inv), ("k_scale_inv", k_scale_inv), ("v_scale_inv", v_scale_inv),
              ("p_scale", p_scale))
    for name, s in scales:
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32:
            what = f"{s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{kernel}: {name} must be a 0-d float32 tensor, got {what}")
        if s.device != q.device:
            raise ValueError(f"{kernel}: {name} is on {s.device} but q is on {q.device}")
    if out_dtype not in ATTENTION_FP8_OUTPUTS:
        raise ValueError(f"{kernel}: out_dtype must be one of {[str(d) for d in ATTENTION_FP8_OUTPUTS]}, "
                         f"got {out_dtype}")
    return dims


def keys_inner(v: torch.Tensor) -> bool:
    """Whether ``v`` (B, Hkv, Tk, D) lies with its keys inner (a view of a transposed
    copy: key stride 1), the layout the FP8 forward's P·V product reads; the FP8
    kernels take such a V as it lies where their alignment allows."""
    return v.dim() == 4 and v.shape[3] > 1 and v.stride(2) == 1 and v.stride(3) != 1


# ---------------------------------------------------------------- the math


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, T, D) as (B, Hkv, H / Hkv, T, D): query head h is (h // G, h % G)."""
    B, H, T, D = q.shape
    return q.reshape(B, hkv, H // hkv, T, D)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Scaled, masked scores (B, Hkv, G, Tq, Tk) of grouped q (B, Hkv, G, Tq, D)
    against k (B, Hkv, Tk, D); masked entries are -inf."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * softmax_scale
    if causal:
        Tq, Tk = s.shape[-2:]
        i = torch.arange(Tq, device=s.device)[:, None]
        j = torch.arange(Tk, device=s.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s


def attention_forward_reference(q, k, v, causal, softmax_scale):
    """``(o, lse)``: ``o`` (B, H, Tq, D) in q's dtype, ``lse`` (B, H, Tq) in fp32
    (float64 for float64 inputs), the natural log of each row's ``Σ exp(s)``."""
    B, H, Hkv, Tq, Tk, D = check_attention(q, k, v, causal, softmax_scale)
    acc = _compute_dtype(q.dtype)
    s = _scores(_grouped(q.to(acc), Hkv), k.to(acc), causal, softmax_scale)  # (B, Hkv, G, Tq, Tk)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Tq)
    p = torch.exp(s - lse[..., None])
    o = torch.matmul(p, v.to(acc).unsqueeze(2))  # (B, Hkv, G, Tq, D)
    return o.reshape(B, H, Tq, D).to(q.dtype), lse.reshape(B, H, Tq)


def attention_backward_reference(q, k, v, o, lse, do, causal, softmax_scale):
    """``(dq, dk, dv)`` in the inputs' dtypes, from the forward's ``o`` and ``lse``
    (see the module docstring for the formulas)."""
    B, H, Hkv, Tq, Tk, D = check_attention_backward(q, k, v, o, lse, do, causal, softmax_scale)
    acc = _compute_dtype(q.dtype)
    qg, kf, vf = _grouped(q.to(acc), Hkv), k.to(acc), v.to(acc)
    og, dog = _grouped(o.to(acc), Hkv), _grouped(do.to(acc), Hkv)
    s = _scores(qg, kf, causal, softmax_scale)  # (B, Hkv, G, Tq, Tk)
    p = torch.exp(s - lse.to(acc).reshape(B, Hkv, H // Hkv, Tq, 1))
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)  # (B, Hkv, Tk, D)
    dp = torch.matmul(dog, vf.unsqueeze(2).transpose(-1, -2))
    delta = (og * dog).sum(dim=-1, keepdim=True)  # (B, Hkv, G, Tq, 1)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf.unsqueeze(2)) * softmax_scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * softmax_scale
    return dq.reshape(B, H, Tq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_forward_fp8_reference(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal, softmax_scale,
                                    out_dtype):
    """The FP8 forward: E4M3 ``q``, ``k``, ``v`` (real value = fp8 value · scale_inv);
    returns ``(o, lse)``, ``o`` in ``out_dtype``, ``lse`` fp32 (B, H, Tq).

    In fp32: ``s = softmax_scale · (q kᵀ)`` on the dequantized operands; per row
    ``m = max_j s_ij``, ``p̃ = exp(s - m)`` in [0, 1], ``l = Σ_j p̃`` (unquantized);
    the probabilities are quantized as the kernels quantize their tiles,
    ``p8 = e4m3(p̃ · p_scale)`` (nearest even, saturated to ±448), and
    ``o = (p8 v) / (p_scale · l)``, ``lse = m + log l``.

    What this cannot reproduce: a flash kernel quantizes ``exp(s - m_t)`` against
    the running maximum ``m_t`` of the key tiles read so far (``m_t <= m``), then
    rescales its accumulator by ``exp(m_t - m)``; the products it quantizes are
    the reference's times ``exp(m - m_t) >= 1``, so they fall on other points of
    the E4M3 grid. Each probability is off by at most one rounding of E4M3 either
    way (relative 2^-4, or the subnormal step 2^-9 / p_scale absolute), so
    kernel and reference each differ from exact attention by at most
    ``2^-4 · Σ_j p_j |v_j| + Tk · 2^-10 / p_scale · max|v|`` per output element
    (the bound ``tests/tolerances.py``'s ``attention_fp8`` entry rests on), and
    from each other by twice that; both are exact on inputs whose probabilities
    lie on the grid. ``lse`` uses the unquantized sum and matches exact
    attention to fp32 rounding.
    """
    B, H, Hkv, Tq, Tk, D = check_attention_fp8(q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, p_scale, causal,
                                                softmax_scale, out_dtype)
    qf = _grouped(q.float() * q_scale_inv.float().reshape(()), Hkv)
    kf = k.float() * k_scale_inv.float().reshape(())
    vf = v.float() * v_scale_inv.float().reshape(())
    s = _scores(qf, kf, causal, softmax_scale)  # (B, Hkv, G, Tq, Tk)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    ps = p_scale.float().reshape(())
    p8 = saturating_cast_reference(p * ps, torch.float8_e4m3fn).float()
    o = torch.matmul(p8, vf.unsqueeze(2)) / (ps * l)
    lse = (m + torch.log(l)).squeeze(-1)
    return o.reshape(B, H, Tq, D).to(out_dtype), lse.reshape(B, H, Tq)
