"""Launchers of the CUDA FP8 casts: check, allocate, launch.

Same names, signatures and results as the reference casts
(:mod:`te_fuser.kernels.reference.cast`), bit for bit. Inputs are bf16, fp16 or
fp32 CUDA tensors; a non-contiguous or misaligned input is copied first.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..formats import Scaling, fp8_max
from ..operand import ScaledOperand
from ..reference.cast import check_given_amax, check_matrix, check_sums_dtype, column_sums_as
from ._build import extension, raw_stream, stream_of_index

__all__ = ["quantize_tensorwise", "quantize_tensorwise_column_sums", "quantize_current", "quantize_current_column_sums",
           "quantize_rowwise", "quantize_mxfp8"]

# Delayed scaling's margin in steps of 2**64: after 6 divisions any fp32 is 0, inf or
# NaN, so more change nothing (the state update's kernels take at most these).
MARGIN_STEPS = 6

HP_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
ALIGNMENT = 16  # bytes: the kernels use 16-byte vector accesses
# The index of the current CUDA device: torch's C entry (torch.cuda.current_device()
# without its checks) where it has one, else its Python call.
current_device_index = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _fp8_code(fp8_dtype: torch.dtype, op: str) -> int:
    try:
        return FP8_CODES[fp8_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") from None


def check_cuda_tensor(t: torch.Tensor, op: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise RuntimeError(f"{op}: the cuda backend needs {name} on a CUDA device, got a {t.device.type} tensor")


def aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor whose data starts on a 16-byte boundary."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % ALIGNMENT:
        t = t.clone()
    return t


def _hp_input(x: torch.Tensor, op: str) -> torch.Tensor:
    check_cuda_tensor(x, op, "x")
    if x.dtype not in HP_CODES:
        raise TypeError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    return aligned_contiguous(x)


_NO_SWITCH = contextlib.nullcontext()  # reusable: a nullcontext holds no state


def on_device(device: torch.device):
    """Make ``device`` current for the launch (a no-op when it already is)."""
    index = device.index
    if index is None or index == current_device_index():
        return _NO_SWITCH
    return torch.cuda.device(device)


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on the CUDA ``device`` (which has an index), without building a device object."""
    return t.is_cuda and t.get_device() == device.index


def _matrix_shape(x: torch.Tensor, columnwise: bool, op: str) -> tuple[int, int]:
    """(rows, cols) the kernel sees: a 2-D x as is; other ranks flattened (row-wise only)."""
    if x.dim() == 2:
        return x.shape[0], x.shape[1]
    if columnwise:
        raise ValueError(f"{op}: a column-wise (transposed) copy needs a 2-D x, got shape {tuple(x.shape)}")
    return 1, x.numel()


def _scale_tensor(scale: torch.Tensor, device: torch.device, op: str) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"{op}: scale must be a one-element tensor")
    if not _same_device(scale, device):
        raise RuntimeError(f"{op}: scale is on {scale.device} but x is on {device}")
    return scale if scale.dtype == torch.float32 else scale.float()


def _amax_target(amax_out: torch.Tensor | None, device: torch.device, op: str) -> torch.Tensor:
    if amax_out is None:
        return torch.empty((), dtype=torch.float32, device=device)
    if not isinstance(amax_out, torch.Tensor) or amax_out.numel() != 1:
        raise ValueError(f"{op}: amax_out must be a one-element tensor (e.g. a slot of the amax history)")
    if not _same_device(amax_out, device):
        raise RuntimeError(f"{op}: amax_out is on {amax_out.device} but x is on {device}")
    if amax_out.dtype != torch.float32:
        return torch.empty((), dtype=torch.float32, device=device)  # copied into amax_out afterwards
    return amax_out


def _check_epsilon(epsilon: float, op: str) -> float:
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}")
    return epsilon


def quantize_tensorwise(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Delayed-scaling cast with the given 0-d fp32 ``scale``; also ``amax(|x|)``.

    One pass over ``x``: returns ``(data (M, K) or None, data_t (K, M) or None,
    amax)``; the amax is written into ``amax_out`` when given (and that tensor
    returned), as the reference does.
    """
    data, data_t, amax, _ = _tensorwise("quantize_tensorwise", x, scale, fp8_dtype, rowwise, columnwise, amax_out,
                                        False)
    return data, data_t, amax


def quantize_tensorwise_column_sums(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_out: torch.Tensor | None = None,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensorwise` of 2-D ``x`` (M, N), and ``x`` summed over its rows
    in fp32 (N,), a bias gradient. With the transposed copy, from the cast's one
    read: each 128x128 tile's column sums, then their sum over the row tiles;
    without it (no tile kernel runs), torch sums apart. ``round_bf16``: the cast
    and its amax read x rounded to bf16, the sums x as given (without the
    transposed copy, the cast is of ``x.to(torch.bfloat16)``). ``sums_dtype``
    (fp32 or bf16): with bf16 the kernel that adds the tiles' sums writes each
    total rounded once (a bf16 bias's gradient, no conversion after).

    Returns ``(data or None, data_t or None, amax, sums)``.
    """
    op = "quantize_tensorwise_column_sums"
    check_matrix(x, op)
    check_sums_dtype(sums_dtype, op)
    if not columnwise or x.numel() == 0:
        xc = _through_bf16(x, round_bf16, op)
        data, data_t, amax, _ = _tensorwise(op, xc, scale, fp8_dtype, rowwise, columnwise, amax_out, False)
        return data, data_t, amax, column_sums_as(x.sum(dim=0, dtype=torch.float32), sums_dtype)
    return _tensorwise(op, x, scale, fp8_dtype, rowwise, columnwise, amax_out, True, bool(round_bf16),
                       sums_dtype is torch.bfloat16)


def _through_bf16(x: torch.Tensor, round_bf16: bool, op: str) -> torch.Tensor:
    """``x`` converted to bf16 with ``round_bf16`` (a cast without the tile kernel,
    which is the one that rounds as it reads), else as it is."""
    if not round_bf16:
        return x
    check_cuda_tensor(x, op, "x")
    return x.to(torch.bfloat16)


def _no_rounding(op: str) -> ValueError:
    """Only the column-sums casts read x through bf16 (a gradient that arrives in fp32)
    and return sums; a prepared cast of another kernel given ``round_bf16`` or a
    ``sums_dtype`` raises this before anything else."""
    return ValueError(f"{op}: round_bf16 and sums_dtype are arguments of the column-sums casts only")


def _sums_bf16(sums_dtype: torch.dtype, op: str) -> bool:
    """Whether the prepared casts' launch writes bf16 sums (fp32: the common case, first)."""
    if sums_dtype is torch.float32:
        return False
    check_sums_dtype(sums_dtype, op)
    return True


def _tensorwise(op: str, x, scale, fp8_dtype, rowwise: bool, columnwise: bool, amax_out, sums: bool,
                round_bf16: bool = False, sums_bf16: bool = False):
    """The delayed-scaling cast; with ``sums`` (x 2-D, ``columnwise``), also the column
    sums (``sums_bf16``: rounded to bf16), and with ``round_bf16`` of x rounded to bf16."""
    code = _fp8_code(fp8_dtype, op)
    x = _hp_input(x, op)
    device = x.device
    rows, cols = _matrix_shape(x, columnwise, op)
    scale = _scale_tensor(scale, device, op)
    amax = _amax_target(amax_out, device, op)
    with on_device(device):
        data, data_t, column_sums, _ = extension().cast_tensorwise(
            x, HP_CODES[x.dtype], code, rows, cols, scale, amax, rowwise, columnwise, sums, round_bf16, sums_bf16,
            raw_stream(device))
    if amax_out is not None and amax is not amax_out:
        amax = amax_out.copy_(amax.reshape(amax_out.shape))
    return data, data_t, amax, column_sums


def _prepared_tensorwise(fp8_dtype: torch.dtype, sums: bool = False):
    """:func:`quantize_tensorwise` (``sums``: :func:`quantize_tensorwise_column_sums`)
    of a 2-D ``x`` with the format checked once: ``cast(x, scale, rowwise, columnwise,
    round_bf16=False, sums_dtype=torch.float32) -> (data or None, data_t or None, sums
    or None, amax)``, the same bits, with amax(|x|) in a new (1,) fp32 tensor
    (``round_bf16`` and ``sums_dtype``, with the column sums only: see
    :func:`quantize_tensorwise_column_sums`). ``scale`` is an
    fp32 one-element tensor on x's device (a quantizer's state); any other case, or
    another device current, goes through the checked launcher, whose checks say
    what is wrong."""
    op = "quantize_tensorwise_column_sums" if sums else "quantize_tensorwise"
    code = _fp8_code(fp8_dtype, op)
    call = extension().cast_tensorwise
    codes, fp32 = HP_CODES, torch.float32
    checked = quantize_tensorwise_column_sums if sums else quantize_tensorwise

    def cast(x: torch.Tensor, scale: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
             sums_dtype: torch.dtype = fp32):
        if (round_bf16 or sums_dtype is not fp32) and not sums:
            raise _no_rounding(op)
        hp = codes.get(x.dtype)
        index = x.get_device()
        if (hp is None or not x.is_cuda or x.dim() != 2 or (sums and (not columnwise or x.numel() == 0))
                or scale.dtype is not fp32 or scale.get_device() != index or scale.numel() != 1
                or index != current_device_index()):
            amax = torch.empty(1, dtype=fp32, device=x.device)  # the checked launcher names what is wrong
            if sums:
                out = checked(x, scale, fp8_dtype, rowwise, columnwise, amax, round_bf16, sums_dtype)
                return out[0], out[1], out[3], out[2]
            out = checked(x, scale, fp8_dtype, rowwise, columnwise, amax)
            return out[0], out[1], None, out[2]
        if not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
            x = aligned_contiguous(x)
        rows, cols = x.shape
        return call(x, hp, code, rows, cols, scale, None, rowwise, columnwise, sums, round_bf16,
                    _sums_bf16(sums_dtype, op), stream_of_index(index))

    call_update = extension().cast_tensorwise_update_lean
    fmax = fp8_max(fp8_dtype)

    def with_update(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, count: torch.Tensor, margin: int,
                    algo_max: bool, rowwise: bool, columnwise: bool, round_bf16: bool = False,
                    sums_dtype: torch.dtype = fp32):
        """The cast and delayed scaling's state update from its amax in one call: ``(data
        or None, data_t or None, sums or None, amax, history, scale, scale_inv, count)``,
        the state as ``delayed_scale_update`` gives it after this amax, bit for bit; or
        None for a case it does not take (the caller casts, then updates apart): x and
        the state are checked in the extension (``cast_tensorwise_update_lean``: x
        contiguous, 16-byte aligned, on torch's current device; the state fp32 and int64
        tensors on x's device), x of two or more dims cast as its 2-D flattening."""
        if (round_bf16 or sums_dtype is not fp32) and not sums:
            raise _no_rounding(op)
        steps, rest = divmod(margin, 64)
        index = current_device_index()
        return call_update(x, code, scale, history, count, min(steps, MARGIN_STEPS), float(2**rest), fmax, algo_max,
                           rowwise, columnwise, sums, round_bf16, _sums_bf16(sums_dtype, op), index,
                           stream_of_index(index))

    cast.with_update = with_update
    return cast


def quantize_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax of ``x`` (pass 1), then scale and cast (pass 2); with
    ``amax`` given (0-d fp32), pass 2 only.

    Returns ``(data, data_t, scale, scale_inv, amax)``, all 0-d fp32 but the data.
    """
    return _current("quantize_current", x, fp8_dtype, power_2, epsilon, rowwise, columnwise, amax, False)[:5]


def quantize_current_column_sums(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    round_bf16: bool = False,
    sums_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_current` of 2-D ``x`` (M, N) and ``x`` summed over its rows in
    fp32 (N,), a bias gradient. With the transposed copy the sums come from the
    cast pass's read (each 128x128 tile's column sums, then their sum over the row
    tiles); without it, torch sums apart. ``round_bf16``: the cast (its amax, scale
    and copies) of x rounded to bf16, the sums of x as given (without the
    transposed copy, the cast is of ``x.to(torch.bfloat16)``). ``sums_dtype``: as
    :func:`quantize_tensorwise_column_sums`'s.

    Returns ``(data or None, data_t or None, scale, scale_inv, amax, sums)``.
    """
    op = "quantize_current_column_sums"
    check_matrix(x, op)
    check_sums_dtype(sums_dtype, op)
    if not columnwise or x.numel() == 0:
        xc = _through_bf16(x, round_bf16, op)
        out = _current(op, xc, fp8_dtype, power_2, epsilon, rowwise, columnwise, None, False)[:5]
        return (*out, column_sums_as(x.sum(dim=0, dtype=torch.float32), sums_dtype))
    return _current(op, x, fp8_dtype, power_2, epsilon, rowwise, columnwise, None, True, bool(round_bf16),
                    sums_dtype is torch.bfloat16)


def _current(op: str, x, fp8_dtype, power_2, epsilon, rowwise: bool, columnwise: bool, given, sums: bool,
             round_bf16: bool = False, sums_bf16: bool = False):
    """Current scaling's two passes (one C++ call that also allocates the outputs);
    with ``sums`` (x 2-D, ``columnwise``), also the column sums from the cast pass
    (``sums_bf16``: rounded to bf16), and with ``round_bf16`` of x rounded to bf16."""
    code = _fp8_code(fp8_dtype, op)
    epsilon = _check_epsilon(epsilon, op)
    x = _hp_input(x, op)
    device = x.device
    rows, cols = _matrix_shape(x, columnwise, op)
    if given is not None:
        check_given_amax(given, x, op)
    with on_device(device):
        return extension().cast_current(x, HP_CODES[x.dtype], code, rows, cols, bool(power_2), epsilon, rowwise,
                                        columnwise, given, sums, round_bf16, sums_bf16, raw_stream(device))


def _prepared_current(fp8_dtype: torch.dtype, power_2: bool = False, epsilon: float = 0.0, sums: bool = False):
    """:func:`quantize_current` (``sums``: :func:`quantize_current_column_sums`) of a
    2-D ``x`` with its constant arguments checked once: ``cast(x, rowwise, columnwise,
    round_bf16=False, sums_dtype=torch.float32) -> (data or None, data_t or None,
    scale_inv, sums or None)``, the same bits (``round_bf16`` and ``sums_dtype``: with
    the column sums only). A
    call does only what the launch needs (x's dtype code, a contiguous 16-byte
    aligned x). An x it does not take as it is (not a CUDA tensor, not 2-D, not a
    high-precision dtype, not on the current device) goes through the checked launcher,
    whose checks say what is wrong; so do the column sums without the transposed
    copy (torch sums apart) or of an empty x. ``cast.with_scale``: the same cast
    returning everything the launcher returns, ``(data or None, data_t or None,
    scale, scale_inv, amax, sums or None)`` (a delayed-scaling quantizer's first
    cast takes its scale and amax). ``cast.any_shape``: :func:`cast`'s call on x of
    two or more dims, cast as its 2-D flattening, with x's checks in the extension
    (``cast_current_lean``: no reshape, no Python checks); None for an x they do not
    take (not contiguous or 16-byte aligned, on another device, ...), which the
    caller then casts through ``cast``. ``cast.given_amax(x, amax, rowwise,
    columnwise)`` (without the column sums): the cast's second pass alone of x of two
    or more dims whose amax(|x|) its producer reduced (one fp32 element on x's
    device), ``(data or None, data_t or None, scale_inv)``, the bits of
    :func:`quantize_current` given that amax on x's flattening; None for an x or
    amax it does not take as they are."""
    op = "quantize_current_column_sums" if sums else "quantize_current"
    code = _fp8_code(fp8_dtype, op)
    epsilon = _check_epsilon(epsilon, op)
    power_2 = bool(power_2)
    call = extension().cast_current
    codes, fp32 = HP_CODES, torch.float32

    def with_scale(x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
                   sums_dtype: torch.dtype = fp32):
        if (round_bf16 or sums_dtype is not fp32) and not sums:
            raise _no_rounding(op)
        hp = codes.get(x.dtype)
        index = x.get_device()
        if (hp is None or not x.is_cuda or x.dim() != 2 or (sums and (not columnwise or x.numel() == 0))
                or index != current_device_index()):
            if sums:
                return quantize_current_column_sums(x, fp8_dtype, power_2, epsilon, rowwise, columnwise, round_bf16,
                                                    sums_dtype)
            return (*quantize_current(x, fp8_dtype, power_2, epsilon, rowwise, columnwise), None)
        if not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
            x = aligned_contiguous(x)
        rows, cols = x.shape
        return call(x, hp, code, rows, cols, power_2, epsilon, rowwise, columnwise, None, sums, round_bf16,
                    _sums_bf16(sums_dtype, op), stream_of_index(index))

    def cast(x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
             sums_dtype: torch.dtype = fp32):
        out = with_scale(x, rowwise, columnwise, round_bf16, sums_dtype)
        return out[0], out[1], out[3], out[5]  # out[5]: None without sums

    call_lean = extension().cast_current_lean

    def any_shape(x: torch.Tensor, rowwise: bool, columnwise: bool, round_bf16: bool = False,
                  sums_dtype: torch.dtype = fp32):
        if (round_bf16 or sums_dtype is not fp32) and not sums:
            raise _no_rounding(op)
        index = current_device_index()
        return call_lean(x, code, power_2, epsilon, rowwise, columnwise, sums, round_bf16, _sums_bf16(sums_dtype, op),
                         index, stream_of_index(index))

    def given_amax(x: torch.Tensor, amax: torch.Tensor, rowwise: bool, columnwise: bool):
        if (x.dim() < 2 or not x.is_cuda or x.dtype not in codes or not x.is_contiguous()
                or x.data_ptr() % ALIGNMENT or amax.dtype is not fp32 or amax.numel() != 1 or not amax.is_cuda):
            return None
        index = current_device_index()
        cols = x.shape[-1]
        if cols == 0 or x.numel() == 0 or x.get_device() != index or amax.get_device() != index:
            return None
        out = call(x, codes[x.dtype], code, x.numel() // cols, cols, power_2, epsilon, rowwise, columnwise, amax,
                   False, False, False, stream_of_index(index))
        return out[0], out[1], out[3]

    cast.with_scale = with_scale
    cast.any_shape = any_shape
    if not sums:
        cast.given_amax = given_amax
    return cast


quantize_current.prepare = _prepared_current
quantize_current_column_sums.prepare = functools.partial(_prepared_current, sums=True)
quantize_tensorwise.prepare = _prepared_tensorwise
quantize_tensorwise_column_sums.prepare = functools.partial(_prepared_tensorwise, sums=True)


def quantize_rowwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, power_2: bool = False, epsilon: float = 0.0
) -> ScaledOperand:
    """One scale per row of 2-D ``x`` (the layout of row-wise scaled GEMMs)."""
    op = "quantize_rowwise"
    code = _fp8_code(fp8_dtype, op)
    epsilon = _check_epsilon(epsilon, op)
    x = _hp_input(x, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols == 0:
        raise ValueError(f"{op}: x has no columns to take a row amax over (shape {tuple(x.shape)})")
    data = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    with on_device(x.device):
        extension().quantize_rowwise(
            x.data_ptr(), HP_CODES[x.dtype], code, rows, cols, data.data_ptr(), scale_inv.data_ptr(),
            bool(power_2), epsilon, raw_stream(x.device),
        )  # fmt: skip
    return ScaledOperand(data, scale_inv, Scaling.ROW)


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> ScaledOperand:
    """MXFP8 along the last dim of 2-D ``x``: one E8M0 scale per 32 elements."""
    op = "quantize_mxfp8"
    code = _fp8_code(fp8_dtype, op)
    x = _hp_input(x, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if cols % 32:
        raise ValueError(f"MXFP8: the quantized dimension ({cols}) must be a multiple of 32")
    data = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scales = torch.empty((rows, cols // 32), dtype=torch.uint8, device=x.device)
    with on_device(x.device):
        extension().quantize_mxfp8(
            x.data_ptr(), HP_CODES[x.dtype], code, x.numel(), data.data_ptr(), scales.data_ptr(),
            raw_stream(x.device),
        )  # fmt: skip
    return ScaledOperand(data, scales, Scaling.MX_32)
