"""LayerNorm and RMSNorm forward and backward in Triton: one pass over the data each.

LayerNorm. Forward, one program per row: the mean, then the biased variance of
the centred row (two passes over the registers, not over memory), ``rstd = 1 /
sqrt(var + eps)``, ``y = (x - mean) * rstd * weight + bias`` in fp32 and one
rounding to the output dtype; mean and rstd are kept for the backward. Backward,
a block of rows per program, with ``x̂ = (x - mean) * rstd`` and ``g = dy * weight``:

    dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))
    dweight = sum over rows of dy * x̂        dbias = sum over rows of dy

each program adds its rows into two fp32 partial rows, which torch sums in one
reduction. The operands come in their own dtypes (an fp32 residual stream, a bf16
gradient), read once and widened in registers: no fp32 copies of them.

RMSNorm. Forward, one program per row: ``rstd = 1 / sqrt(mean(x**2) + eps)``, ``y = x *
rstd * weight`` in fp32, one rounding to the output dtype; ``rstd`` is kept for
the backward. Backward, a block of rows per program, with ``x̂ = x * rstd`` and
``g = dy * weight``:

    dx = rstd * (g - x̂ * mean(g * x̂))        dweight = sum over rows of dy * x̂

each program adds its rows' ``dy * x̂`` into one fp32 partial row; the partial
rows are summed by torch.

Both hold a row in registers: rows up to :data:`MAX_N` wide; wider rows go to the
reference (the ``*_unsupported_reason`` functions). The row sums add in a fixed
order: the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.norm import check_grad_add
from ._common import (
    TL_FLOAT, add_rounded, cdiv, check_input, compiled_for_gpu, next_power_of_2, sm_count, sum_rows, to_output)
from ._launch import launch

__all__ = ["layer_norm", "layer_norm_grad", "layer_norm_unsupported_reason", "layer_norm_grad_unsupported_reason",
           "rms_norm", "rms_norm_grad", "rms_norm_unsupported_reason", "rms_norm_grad_unsupported_reason", "MAX_N"]

MAX_N = 8192


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride_x, stride_y, eps,
                       OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    centred = tl.where(ok, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / N
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = centred * rstd * w + b
    tl.store(y_ptr + row * stride_y + cols, to_output(y, OUT_DTYPE), mask=ok)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_grad_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, add_ptr, M, N, programs,
                            stride_dy, stride_x, stride_dx, stride_add, ROWS, OUT_DTYPE: tl.constexpr,
                            BLOCK_N: tl.constexpr, ADD: tl.constexpr, HW_ADD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        row_ok = ok & (row + 0 * cols < M)  # a vector mask (the interpreter rejects a scalar one)
        x = tl.load(x_ptr + row * stride_x + cols, mask=row_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=row_ok, other=0.0).to(tl.float32)
        last = tl.minimum(row, M - 1)  # rows past M read the last row's statistics; their dy is 0
        mean = tl.load(mean_ptr + last)
        rstd = tl.load(rstd_ptr + last)
        x_hat = tl.where(row_ok, (x - mean) * rstd, 0.0)
        g = dy * w
        c_g = tl.sum(g, axis=0) / N
        c_gx = tl.sum(g * x_hat, axis=0) / N
        dx = rstd * (g - c_g - x_hat * c_gx)
        if ADD:  # another use's gradient of x, added in fp32 before the one rounding
            dx = add_rounded(dx, tl.load(add_ptr + row * stride_add + cols, mask=row_ok, other=0.0).to(tl.float32),
                             HW_ADD)
        tl.store(dx_ptr + row * stride_dx + cols, to_output(dx, OUT_DTYPE), mask=row_ok)
        dw += dy * x_hat
        db += dy
    tl.store(part_ptr + pid * N + cols, dw, mask=ok)
    tl.store(part_ptr + (programs + pid) * N + cols, db, mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, stride_y, eps,
                     OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + row * stride_y + cols, to_output(y, OUT_DTYPE), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_grad_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, N, stride_dy, stride_x,
                          stride_dx, ROWS, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        row_ok = ok & (row + 0 * cols < M)  # a vector mask (the interpreter rejects a scalar one)
        x = tl.load(x_ptr + row * stride_x + cols, mask=row_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=row_ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # rows past M load zeros: no effect
        x_hat = x * rstd
        g = dy * w
        c = tl.sum(g * x_hat, axis=0) / N
        dx = rstd * (g - x_hat * c)
        tl.store(dx_ptr + row * stride_dx + cols, to_output(dx, OUT_DTYPE), mask=row_ok)
        dw += dy * x_hat
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=ok)


def _reason(x: torch.Tensor) -> str | None:
    if x.dim() == 2 and x.shape[1] > MAX_N:
        return f"the triton RMSNorm holds a row in registers: rows up to {MAX_N} wide, got {x.shape[1]}"
    return None


def layer_norm_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`layer_norm` would not run these operands here (``None``: it runs)."""
    return _reason(x)


def layer_norm_grad_unsupported_reason(dy: torch.Tensor, x: torch.Tensor) -> str | None:
    return _reason(x)


def rms_norm_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`rms_norm` would not run these operands here (``None``: it runs)."""
    return _reason(x)


def rms_norm_grad_unsupported_reason(dy: torch.Tensor, x: torch.Tensor) -> str | None:
    return _reason(x)


def _check(x: torch.Tensor, weight: torch.Tensor, kernel: str, param: str = "weight") -> None:
    check_input(x, kernel)
    check_input(weight, kernel, param, dims=1)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{kernel}: {param} must have shape ({x.shape[1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{kernel}: {param} is on {weight.device} but x is on {x.device}")
    reason = _reason(x)
    if reason is not None:
        raise ValueError(f"{kernel}: {reason}")


def _warps(block_n: int) -> int:
    return 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _check_stats(x: torch.Tensor, kernel: str, **stats: torch.Tensor) -> None:
    for name, stat in stats.items():
        if stat.shape != (x.shape[0],) or stat.dtype != torch.float32 or stat.device != x.device:
            raise ValueError(f"{kernel}: {name} must be float32 of shape ({x.shape[0]},) on {x.device}, "
                             f"got {stat.dtype} {tuple(stat.shape)} on {stat.device}")


def _check_grad(dy: torch.Tensor, x: torch.Tensor, kernel: str) -> None:
    check_input(dy, kernel, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"{kernel}: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if x.dtype not in TL_FLOAT:
        raise ValueError(f"{kernel}: x must be bf16, fp16 or fp32, got {x.dtype}")


def _grad_grid(x: torch.Tensor) -> tuple[int, int]:
    """``(programs, rows per program)`` of a backward: a few programs per SM, each
    adding its rows into its own partial sums."""
    rows = x.shape[0]
    programs = min(rows, 4 * sm_count(x))
    per_program = cdiv(rows, programs)
    return cdiv(rows, per_program), per_program


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y (rows, N) in out_dtype (default x.dtype), mean (rows,), rstd (rows,))``
    for x (rows, N), weight and bias (N,); the statistics in fp32."""
    _check(x, weight, "layer_norm")
    _check(x, bias, "layer_norm", "bias")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in TL_FLOAT:
        raise ValueError(f"layer_norm: out_dtype must be one of {[str(d) for d in TL_FLOAT]}, got {out_dtype}")
    x = _row_major(x)
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    stats = torch.empty((2, rows), dtype=torch.float32, device=x.device)
    if rows and n:
        block_n = next_power_of_2(n)
        launch(_layer_norm_kernel, (rows,), x, weight, bias, y, stats[0], stats[1], n, x.stride(0), y.stride(0),
               float(eps), OUT_DTYPE=TL_FLOAT[out_dtype], BLOCK_N=block_n, num_warps=_warps(block_n))
    return y, stats[0], stats[1]


def layer_norm_grad(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    grad_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx (rows, N) in x.dtype, dweight (N,), dbias (N,))`` from the forward's
    ``mean`` and ``rstd``; the parameter gradients in fp32; ``grad_add`` added to dx
    in fp32 before its rounding (see the reference)."""
    _check(x, weight, "layer_norm_grad")
    _check_grad(dy, x, "layer_norm_grad")
    _check_stats(x, "layer_norm_grad", mean=mean, rstd=rstd)
    check_grad_add(grad_add, x, "layer_norm_grad")
    x, dy = _row_major(x), _row_major(dy)
    add = _row_major(grad_add) if grad_add is not None else None
    rows, n = x.shape
    dx = torch.empty_like(x)
    if rows == 0 or n == 0:
        zeros = torch.zeros((2, n), dtype=torch.float32, device=x.device)
        return dx, zeros[0], zeros[1]
    programs, per_program = _grad_grid(x)
    partial = torch.empty((2, programs, n), dtype=torch.float32, device=x.device)
    block_n = next_power_of_2(n)
    launch(_layer_norm_grad_kernel, (programs,), dy, x, weight, mean, rstd, dx, partial, dx if add is None else add,
           rows, n, programs, dy.stride(0), x.stride(0), dx.stride(0), 0 if add is None else add.stride(0),
           ROWS=per_program, OUT_DTYPE=TL_FLOAT[x.dtype], BLOCK_N=block_n, ADD=add is not None,
           HW_ADD=add is not None and compiled_for_gpu(x), num_warps=_warps(block_n))
    sums = sum_rows(partial)  # (2, N)
    return dx, sums[0], sums[1]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y (rows, N) in out_dtype (default x.dtype), rstd (rows,) fp32)`` for x (rows, N)."""
    _check(x, weight, "rms_norm")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in TL_FLOAT:
        raise ValueError(f"rms_norm: out_dtype must be one of {[str(d) for d in TL_FLOAT]}, got {out_dtype}")
    x = _row_major(x)
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and n:
        block_n = next_power_of_2(n)
        launch(_rms_norm_kernel, (rows,), x, weight, y, rstd, n, x.stride(0), y.stride(0), float(eps),
               OUT_DTYPE=TL_FLOAT[out_dtype], BLOCK_N=block_n, num_warps=_warps(block_n))
    return y, rstd


def rms_norm_grad(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx (rows, N) in x.dtype, dweight (N,) fp32)`` from the forward's ``rstd``."""
    _check(x, weight, "rms_norm_grad")
    _check_grad(dy, x, "rms_norm_grad")
    _check_stats(x, "rms_norm_grad", rstd=rstd)
    x, dy = _row_major(x), _row_major(dy)
    rows, n = x.shape
    dx = torch.empty_like(x)
    if rows == 0 or n == 0:
        return dx, torch.zeros(n, dtype=torch.float32, device=x.device)
    programs, per_program = _grad_grid(x)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    block_n = next_power_of_2(n)
    launch(_rms_norm_grad_kernel, (programs,), dy, x, weight, rstd, dx, partial, rows, n, dy.stride(0), x.stride(0),
           dx.stride(0), ROWS=per_program, OUT_DTYPE=TL_FLOAT[x.dtype], BLOCK_N=block_n, num_warps=_warps(block_n))
    return dx, sum_rows(partial)
