"""RotaryEmbedding: rotary position embedding (RoPE) of q and k inside the fused QKV tensor.

The input is laid out as :class:`~te_fuser.ops.DotProductAttention` reads it:
(tokens, (H + 2·Hkv)·D) for one sequence or (B, T, (H + 2·Hkv)·D), the H query
heads, then the Hkv key heads, then the Hkv value heads. The q and k heads are
rotated, the v heads pass unchanged. Token ``t`` of a sequence sits at position
``position_offset + t`` (an attribute: set it per call for decoding after a
cache).

The rotation is the "rotate half" form (GPT-NeoX, LLaMA; TE's non-interleaved
RoPE): with ``inv_freq_i = base ** (-2i / D)`` for ``i < D/2``, angle
``θ = position · inv_freq``, ``cos`` and ``sin`` each repeated over the two halves,

    y = x · cos + rotate_half(x) · sin,   rotate_half(x) = (-x[D/2:], x[:D/2])

computed in fp32 (the tables from a float64 angle, :func:`rotary_tables`), the
result in the compute dtype, by the backend's ``rotary`` kernel (one pass over the
tensor; :func:`apply_rotary` is the same in plain torch, for a torch twin). The backward is the inverse rotation,
``dx = dy · cos - rotate_half(dy) · sin``.
"""

from __future__ import annotations

import torch

from ... import backend
from ..op import BasicOperation
from .attention import check_head_counts

__all__ = ["RotaryEmbedding", "rotary_tables", "apply_rotary"]

_TABLES_KEPT = 8  # (length, offset, device) tables an op keeps


def rotary_tables(seq: int, head_dim: int, base: float, offset: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each (seq, head_dim) fp32, for positions ``offset .. offset + seq - 1``;
    the angles in float64 (every device gives the same tables)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = torch.arange(offset, offset + seq, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x · cos + rotate_half(x) · sin`` for ``x`` (B, T, heads, D) and tables (T, D)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D)
    return x * cos + _rotate_half(x) * sin


class RotaryEmbedding(BasicOperation):
    """RoPE of the q and k heads of the fused QKV tensor (see the module docstring)."""

    module_type = "rope"

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None, *, base: float = 10000.0,
                 position_offset: int = 0, name=None) -> None:
        super().__init__(name)
        owner = type(self).__name__
        self.num_heads, self.head_dim, self.num_kv_heads = check_head_counts(owner, num_heads, head_dim,
                                                                             num_kv_heads)
        if head_dim % 2:
            raise ValueError(f"{owner}.head_dim: must be even (the rotation pairs the two halves), got {head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0 \
                or base == float("inf"):
            raise ValueError(f"{owner}.base: must be a finite number > 1, got {base!r}")
        self.base = float(base)
        self.position_offset = position_offset
        self.qkv_width = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self._tables: dict = {}

    def __setattr__(self, name, value) -> None:
        if name == "position_offset" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{type(self).__name__}.position_offset: must be an integer >= 0, got {value!r}")
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_kv_heads={self.num_kv_heads}, "
                f"base={self.base}")

    def check_shapes(self, in_shape, quantizers):
        if len(in_shape) not in (2, 3):
            raise ValueError(f"{self.describe()}: input must be (tokens, width) or (batch, seq, width), "
                             f"got {tuple(in_shape)}")
        if in_shape[-1] != self.qkv_width:
            H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
            raise ValueError(f"{self.describe()}: input's last dim is {in_shape[-1]}; the fused QKV tensor of {H} "
                             f"query heads and {Hkv} kv heads of head dim {D} is ({H} + 2*{Hkv})*{D} = "
                             f"{self.qkv_width} wide")
        return in_shape

    def tables(self, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables of a sequence of ``seq`` tokens at the current offset (kept)."""
        key = (seq, self.position_offset, device)
        found = self._tables.get(key)
        if found is None:
            if len(self._tables) >= _TABLES_KEPT:
                self._tables.clear()
            found = self._tables[key] = rotary_tables(seq, self.head_dim, self.base, self.position_offset, device)
        return found

    def _rotate(self, t: torch.Tensor, dtype: torch.dtype, inverse: bool, in_place: bool = False) -> torch.Tensor:
        shape = t.shape
        batch, seq = (1, shape[0]) if len(shape) == 2 else (shape[0], shape[1])
        cos, sin = self.tables(seq, t.device)
        heads = t.reshape(batch, seq, -1, self.head_dim)  # (B, T, H + 2 Hkv, D): a view of a contiguous t
        rotary = backend.resolve("rotary", t.device).fn  # the q and k heads rotated in fp32, v copied: one pass
        out = backend.lean_first(rotary, heads, cos, sin, self.num_heads + self.num_kv_heads, inverse, dtype,
                                 in_place=in_place)
        return t if in_place else out.reshape(shape)

    def op_forward(self, ctx, x, extra_inputs):
        return self._rotate(x, ctx.run.compute_dtype, inverse=False), []

    def rotate_fresh(self, ctx, y: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """The forward (``inverse``: the backward) of ``y``, a tensor no one else holds
        (a GEMM's output, attention's input gradient, just made): its q and k heads
        rotated where they are when ``y`` is contiguous and of the result's dtype (the
        v heads neither read nor copied), else the copy :meth:`op_forward` and
        :meth:`op_backward` make. The same bits either way."""
        dtype = y.dtype if inverse else ctx.run.compute_dtype
        return self._rotate(y, dtype, inverse, in_place=y.dtype is dtype and y.is_contiguous())

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return self._rotate(dy, dy.dtype, inverse=True), [], []
