"""FP8 GEMMs through cuBLASLt plus one CUDA epilogue kernel.

Tensor-scaled and block-scaled pairs go straight to cuBLASLt
(``cublaslt_gemm.cpp``: the matmul descriptor, layouts and algorithm are built
once per problem and kept, where ``torch._scaled_mm`` builds them and asks the
heuristic on every call); row-scaled pairs go through ``torch._scaled_mm``.

``out = activation(a @ b.T + bias) + residual`` with ``a`` (M, K) and ``b``
(N, K), both quantized along K (:mod:`te_fuser.kernels.operand`). cuBLASLt wants
A row-major and B column-major: ``b.data`` is (N, K) row-major, so
``b.data.t()`` is the column-major (K, N) operand it takes, with no copy.

Scaling pairs run by cuBLASLt:

- ``tensor x tensor``; ``row x row`` (scale_a (M, 1), scale_b (1, N)); a tensor
  scale paired with a row one is expanded to rows;
- ``block_1x128 x block_128x128`` and ``block_1x128 x block_1x128`` on a Hopper
  GPU with cuBLASLt >= 12.9 (its block scale modes), with M % 4 == 0 (cuBLASLt
  refuses other M) and K % 128 == 0; for ``block_128x128`` weights also
  K % 512 == 0: cuBLASLt reads the 128x128 scales with K padded to a multiple of
  4 blocks, and gave wrong results for other K through ``torch._scaled_mm``
  (measured on an H200). cuBLASLt reads 1x128 scales K-block by K-block with the
  rows inner, the order the block cast writes them in (:func:`_block_scales`).

Anything else falls back, inside :func:`gemm`, to the reference GEMM (correct,
slow): MXFP8 operands (no MXFP8 cuBLASLt path on Hopper), other pairs, two E5M2
operands, high-precision operands, and K or N not multiples of 16.
:func:`gemm_unsupported_reason` says which case applies, so callers can report it.

Epilogue: a bias alone is fused into cuBLASLt when the output and the bias are
both bf16 (or both fp16). When there is an activation or a residual, cuBLASLt
writes fp32 and one CUDA kernel applies bias, activation and residual and casts
once, so the result is rounded once as in the reference (a bf16 intermediate
would round twice and lose the small differences a residual add can leave).
"""

from __future__ import annotations

import torch

from ..formats import ACTIVATION_CODES, ACTIVATIONS, EPILOGUE_ACTIVATIONS, Scaling
from ..operand import ScaledOperand
from ..reference.gemm import check_epilogue_activation, gemm_reference
from ._build import extension, raw_stream, stream_of_index
from .cast import ALIGNMENT, HP_CODES, aligned_contiguous, check_cuda_tensor, current_device_index, on_device

__all__ = ["gemm", "gemm_unsupported_reason", "block_scaled_mm_available", "set_workspace_limit",
           "WORKSPACE_BYTES"]

WORKSPACE_BYTES = 32 << 20  # the workspace cublaslt_gemm.cpp hands every matmul (kWorkspaceBytes)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TENSOR_ROW_PAIRS = {(Scaling.TENSOR, Scaling.TENSOR), (Scaling.ROW, Scaling.ROW), (Scaling.TENSOR, Scaling.ROW), (Scaling.ROW, Scaling.TENSOR)}
_BLOCK_PAIRS = {(Scaling.BLOCK_1X128, Scaling.BLOCK_128X128), (Scaling.BLOCK_1X128, Scaling.BLOCK_1X128)}
# an operand's scale mode in the extension's block-scaled GEMM (cublaslt_gemm.cpp)
_SCALE_MODES = {Scaling.TENSOR: 0, Scaling.BLOCK_1X128: 1, Scaling.BLOCK_128X128: 2}
# Block-scaled pairs through the extension's own cuBLASLt call (True) or through
# torch._scaled_mm (False; the same scales, no copies either way)
BLOCK_GEMM_DIRECT = True


def set_workspace_limit(nbytes: int) -> int:
    """The most workspace the algorithm of a tensor-scaled GEMM planned from now on
    may ask for, in bytes, from 0 to :data:`WORKSPACE_BYTES` (the start value);
    returns the limit before. With 0 the heuristic picks among algorithms that ask
    for none (on an H200 the GPT's fprop and dgrad GEMMs still make one memset a
    call that way, and its GEMMs ran 1.5% slower: RESULTS.md, run 166; the full
    workspace stays the default). GEMMs already planned keep their algorithm
    under the limit they were planned with (the limit is part of a plan's key);
    another algorithm may sum in another order, so the bits of a GEMM can change
    with the limit."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= WORKSPACE_BYTES:
        raise ValueError(f"set_workspace_limit: nbytes must be an int in [0, {WORKSPACE_BYTES}], got {nbytes!r}")
    return int(extension().fp8_gemm_set_workspace_limit(nbytes))


_block_supported: dict[int, bool] = {}


def block_scaled_mm_available(device: torch.device) -> bool:
    """Whether 1x128 / 128x128 block-scaled GEMMs run on cuBLASLt here: a Hopper GPU
    (sm_90) and cuBLASLt 12.9 or later, both in the extension's build and loaded."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    known = _block_supported.get(index)
    if known is None:
        known = (torch.cuda.get_device_capability(index) == (9, 0)
                 and bool(extension().fp8_gemm_block_supported()))
        _block_supported[index] = known
    return known


def _structural_reason(a: ScaledOperand, b: ScaledOperand) -> str | None:
    pair = (a.scaling, b.scaling)
    if pair not in _TENSOR_ROW_PAIRS and pair not in _BLOCK_PAIRS:
        return f"cuBLASLt on Hopper has no {a.scaling} x {b.scaling} FP8 GEMM"
    if a.fp8_dtype == torch.float8_e5m2 and b.fp8_dtype == torch.float8_e5m2:
        return "cuBLASLt does not multiply two E5M2 operands"
    m, k = a.shape
    n = b.shape[0]
    if k % 16 or n % 16:
        return f"cuBLASLt FP8 GEMMs need K and N to be multiples of 16, got K={k}, N={n}"
    if pair in _BLOCK_PAIRS:
        k_multiple = 512 if b.scaling == Scaling.BLOCK_128X128 else 128
        if m % 4 or k % k_multiple:
            return (
                f"block-scaled cuBLASLt GEMMs ({a.scaling} x {b.scaling}) need M % 4 == 0 and "
                f"K % {k_multiple} == 0, got M={m}, K={k}"
            )
    return None


def gemm_unsupported_reason(
    a: ScaledOperand | torch.Tensor, b: ScaledOperand | torch.Tensor
) -> str | None:
    """Why :func:`gemm` would run these operands on the reference path (``None``: cuBLASLt)."""
    if not (isinstance(a, ScaledOperand) and isinstance(b, ScaledOperand)):
        return "a high-precision operand: the cuda backend only runs FP8 x FP8 GEMMs"
    reason = _structural_reason(a, b)
    if reason is not None:
        return reason
    if not a.data.is_cuda:
        return f"the operands are on {a.data.device.type}, not on a CUDA device"
    if (a.scaling, b.scaling) in _BLOCK_PAIRS and not block_scaled_mm_available(a.data.device):
        return "block-scaled cuBLASLt GEMMs need a Hopper GPU (sm_90) and cuBLASLt >= 12.9"
    return None


def _check_args(a, b, out_dtype, bias, activation, residual) -> tuple[int, int, int]:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"gemm: out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"gemm: activation must be None or one of {list(ACTIVATIONS)}, got {activation!r}")
    check_epilogue_activation(activation)
    m, k = a.shape
    n, k_b = b.shape
    if k != k_b:
        raise ValueError(f"gemm: reduction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    if activation == "swiglu" and n % 2:
        raise ValueError(f"gemm: swiglu halves the output columns, which must be even, got N={n}")
    out_cols = n // 2 if activation == "swiglu" else n
    if residual is not None and residual.shape != (m, out_cols):
        raise ValueError(f"gemm: residual must have shape ({m}, {out_cols}), got {tuple(residual.shape)}")
    return m, n, out_cols


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 else t.float()


def _rows_scale(op: ScaledOperand, rows: int) -> torch.Tensor:
    """(rows, 1) fp32 contiguous scales of a tensor- or row-scaled operand."""
    scale = op.scale_inv.float()
    return scale.reshape(1, 1).expand(rows, 1).contiguous() if op.scaling == Scaling.TENSOR else scale.contiguous()


def _scale_16(scale_inv: torch.Tensor) -> torch.Tensor:
    """A tensor scale as cuBLASLt reads it: one fp32 element at a 16-byte aligned address."""
    scale = _fp32(scale_inv)
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def _scaled_mm_scales(a: ScaledOperand, b: ScaledOperand) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_a, scale_b in the shapes and strides torch._scaled_mm reads them."""
    if (a.scaling, b.scaling) in _BLOCK_PAIRS:  # views of what cuBLASLt reads: (M, K/128) with stride (1, M), ...
        scale_b = _block_scales(b)  # ... (K/128, N) for 1x128, (K/128, N/128) transposed from the row-major grid
        return _block_scales(a).t(), (scale_b.t() if b.scaling == Scaling.BLOCK_128X128 else scale_b)
    if (a.scaling, b.scaling) == (Scaling.TENSOR, Scaling.TENSOR):
        return _fp32(a.scale_inv), _fp32(b.scale_inv)
    return _rows_scale(a, a.shape[0]), _rows_scale(b, b.shape[0]).reshape(1, b.shape[0])  # (M, 1), (1, N)


def _block_scales(op: ScaledOperand) -> torch.Tensor:
    """A block-scaled operand's scales in the order cuBLASLt reads them: 1x128 scales
    as (ceil(K/128), rows), the rows inner; 128x128 as the row-major tile grid. The
    block cast writes 1x128 scales in that order (its ``scale_inv`` is the
    transposed view), so this copies only scales made elsewhere."""
    scales = op.scale_inv.t() if op.scaling == Scaling.BLOCK_1X128 else op.scale_inv
    if scales.dtype is not torch.float32:
        scales = scales.float()
    if not scales.is_contiguous() or scales.data_ptr() % ALIGNMENT:
        scales = aligned_contiguous(scales)
    return scales


# The epilogue kernel's bias code for an fp32 bias it rounds to bf16 as it reads it
# (launchers.cuh: kBiasFp32AsBf16).
_BIAS_FP32_AS_BF16 = 3


def _epilogue(y: torch.Tensor, bias, activation, residual, out_dtype, bias_as_bf16: bool = False) -> torch.Tensor:
    """``activation(y + bias) + residual`` in fp32, written once as ``out_dtype``;
    ``bias_as_bf16``: an fp32 bias, rounded to bf16 as the kernel reads it."""
    rows, in_cols = y.shape
    out_cols = in_cols // 2 if activation == "swiglu" else in_cols
    in_place = out_dtype == y.dtype and out_cols == in_cols
    out = y if in_place else torch.empty((rows, out_cols), dtype=out_dtype, device=y.device)
    if bias is not None:
        bias = aligned_contiguous(bias if bias.dtype in HP_CODES else bias.float())
    if residual is not None:
        residual = aligned_contiguous(residual if residual.dtype in HP_CODES else residual.float())
    extension().epilogue(
        y.data_ptr(), HP_CODES[y.dtype],
        0 if bias is None else bias.data_ptr(),
        0 if bias is None else (_BIAS_FP32_AS_BF16 if bias_as_bf16 else HP_CODES[bias.dtype]),
        0 if residual is None else residual.data_ptr(), 0 if residual is None else HP_CODES[residual.dtype],
        out.data_ptr(), HP_CODES[out.dtype], rows, out_cols, ACTIVATION_CODES[activation], raw_stream(y.device),
    )  # fmt: skip
    return out


def gemm(
    a: ScaledOperand | torch.Tensor,
    b: ScaledOperand | torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``activation(a (P, R) @ b (Q, R).T + bias (Q,)) + residual (P, Q')`` as ``out_dtype``.

    cuBLASLt FP8 GEMM where it applies (see the module docstring), else the
    reference GEMM; same contract as ``gemm_reference``. ``fast_accum`` is
    cuBLASLt's fast-accumulation mode for tensor- and row-scaled pairs (block-scaled
    GEMMs promote per 128-wide block whatever it says).
    """
    for name, op in (("a", a), ("b", b)):
        check_cuda_tensor(op.data if isinstance(op, ScaledOperand) else op, "gemm", name)
    if gemm_unsupported_reason(a, b) is not None:
        return gemm_reference(a, b, out_dtype, bias, activation, residual)
    return _gemm_cublaslt(a, b, out_dtype, bias, activation, residual, fast_accum)


def _gemm_supported(
    a: ScaledOperand,
    b: ScaledOperand,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`gemm` for operands :func:`gemm_unsupported_reason` has already
    accepted (``te_fuser.backend`` asks it before every call): no second check."""
    check_cuda_tensor(b.data, "gemm", "b")  # the reason looked at a's device only
    return _gemm_cublaslt(a, b, out_dtype, bias, activation, residual, fast_accum)


gemm.when_supported = _gemm_supported

_E5M2 = torch.float8_e5m2
_FP32 = torch.float32
# the epilogue activations whose output keeps the GEMM's column count (swiglu halves it)
_SAME_WIDTH = tuple(a for a in EPILOGUE_ACTIVATIONS if a != "swiglu")


def _tensorwise(a, b, out_dtype: torch.dtype, bias: torch.Tensor | None = None, fast_accum: bool = False,
                activation: str | None = None, residual: torch.Tensor | None = None,
                bias_round: torch.dtype | None = None, a_shape: torch.Size | None = None):
    """:func:`gemm` of two per-tensor scaled operands with the checks a launch needs
    and no more: the same bits, or None for a case it does not take as it is (any
    other scaling, two E5M2 operands, K or N not a multiple of 16, operands apart or
    not on the current GPU, an unusual dtype, swiglu, a bias or residual of another shape or
    device), which then goes through :func:`gemm` and its checks. A bias of the
    output's dtype is cuBLASLt's epilogue; an activation, a residual or another
    bias take the fp32 product through the epilogue kernel, as :func:`gemm` does.
    ``bias_round``: the bias is added as ``bias.to(bias_round)`` (an fp32 bias of a
    bf16 step); with an activation or a residual the epilogue kernel rounds an fp32
    bias to bf16 as it reads it (no converted copy, no launch for it), else the bias
    is converted first. The ops' GEMMs call it first (``gemm.tensorwise``). The
    extension's ``fp8_gemm_lean`` makes the common call with these checks in C++
    (the same bits; None hands a case back to the checks here). ``a_shape``: the
    shape (..., K) of the tensor whose 2-D flattening ``a`` is; the result then
    comes in its dims, (..., N), and the residual may too."""
    if a.scaling != Scaling.TENSOR or b.scaling != Scaling.TENSOR:
        return None
    x, w = a.data, b.data
    as_bf16 = None  # whether the C++ entry reads an fp32 bias as bf16; None: a bias to convert first, not there
    if bias_round is None or bias is None or bias.dtype is bias_round:
        as_bf16 = False
    elif (activation is not None or residual is not None) and bias.dtype is _FP32 and bias_round is torch.bfloat16:
        as_bf16 = True
    if as_bf16 is not None:  # the checks in C++, on torch's current device and its current stream
        index = current_device_index()
        out = extension().fp8_gemm_lean(x, w, a.scale_inv, b.scale_inv, bias, residual, out_dtype, fast_accum,
                                        ACTIVATION_CODES.get(activation, -1), as_bf16, index, stream_of_index(index),
                                        a_shape)
        if out is not None:
            return out
    if a_shape is not None and len(a_shape) != 2:  # the checks below on (M, N); the result in a_shape's dims
        rows = None if residual is None else residual.reshape(-1, residual.shape[-1])
        out = _tensorwise(a, b, out_dtype, bias, fast_accum, activation, rows, bias_round)
        return None if out is None else out.reshape(*a_shape[:-1], out.shape[-1])
    xs, ws = x.shape, w.shape
    if len(xs) != 2 or len(ws) != 2:
        return None
    m, k = xs
    n, k_b = ws
    if k != k_b or k % 16 or n % 16 or (x.dtype is _E5M2 and w.dtype is _E5M2) or out_dtype not in OUT_DTYPES:
        return None
    if not x.is_cuda or not w.is_cuda:
        return None
    index = x.get_device()
    if w.get_device() != index or index != current_device_index():
        return None
    fused = activation is not None or residual is not None
    if activation is not None and activation not in _SAME_WIDTH:
        return None
    if residual is not None and (residual.shape != (m, n) or residual.dtype not in HP_CODES or not residual.is_cuda
                                 or residual.get_device() != index):
        return None
    if bias is not None and (bias.shape != (n,) or bias.dtype not in HP_CODES or not bias.is_cuda
                             or bias.get_device() != index):
        return None
    as_bf16 = False
    if bias_round is not None and bias is not None and bias.dtype is not bias_round:
        as_bf16 = fused and bias.dtype is _FP32 and bias_round is torch.bfloat16
        if not as_bf16:
            bias = bias.to(bias_round)
    in_gemm = bias is not None and not fused and out_dtype is not torch.float32 and bias.dtype is out_dtype
    epilogue = fused or (bias is not None and not in_gemm)
    sa, sb = a.scale_inv, b.scale_inv
    if sa.dtype is not torch.float32 or sa.data_ptr() % 16:
        sa = _scale_16(sa)
    if sb.dtype is not torch.float32 or sb.data_ptr() % 16:
        sb = _scale_16(sb)
    if not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
        x = aligned_contiguous(x)
    if not w.is_contiguous() or w.data_ptr() % ALIGNMENT:
        w = aligned_contiguous(w)
    gemm_bias = (bias if bias.is_contiguous() else bias.contiguous()) if in_gemm else None
    y = extension().fp8_gemm_tensorwise(x, w, sa, sb, gemm_bias, torch.float32 if epilogue else out_dtype,
                                        fast_accum, stream_of_index(index))  # (M, N)
    return _epilogue(y, bias, activation, residual, out_dtype, as_bf16) if epilogue else y


gemm.tensorwise = _tensorwise


def _gemm_cublaslt(a, b, out_dtype, bias, activation, residual, fast_accum) -> torch.Tensor:
    """The cuBLASLt path of :func:`gemm` (operands already found supported)."""
    fast_accum = fast_accum and (a.scaling, b.scaling) in _TENSOR_ROW_PAIRS
    m, n, _ = _check_args(a, b, out_dtype, bias, activation, residual)
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None:
            check_cuda_tensor(t, "gemm", name)
    fused = activation is not None or residual is not None
    bias_in_gemm = bias is not None and not fused and out_dtype != torch.float32 and bias.dtype == out_dtype
    needs_epilogue = fused or (bias is not None and not bias_in_gemm)
    x_fp8 = aligned_contiguous(a.data)  # (M, K) row-major
    w_fp8 = aligned_contiguous(b.data)  # (N, K) row-major; .t() is (K, N) column-major
    out_dtype_gemm = torch.float32 if needs_epilogue else out_dtype
    if a.scaling == Scaling.TENSOR and b.scaling == Scaling.TENSOR:
        with on_device(x_fp8.device):
            y = extension().fp8_gemm_tensorwise(
                x_fp8, w_fp8, _scale_16(a.scale_inv), _scale_16(b.scale_inv), bias.contiguous() if bias_in_gemm else None,
                out_dtype_gemm, fast_accum, raw_stream(x_fp8.device),
            )  # (M, N)  # fmt: skip
            return _epilogue(y, bias, activation, residual, out_dtype) if needs_epilogue else y
    if (a.scaling, b.scaling) in _BLOCK_PAIRS and BLOCK_GEMM_DIRECT:
        with on_device(x_fp8.device):
            y = extension().fp8_gemm_scaled(
                x_fp8, w_fp8, _block_scales(a), _block_scales(b), _SCALE_MODES[a.scaling], _SCALE_MODES[b.scaling],
                bias if bias_in_gemm else None, out_dtype_gemm, raw_stream(x_fp8.device),
            )  # (M, N)  # fmt: skip
            return _epilogue(y, bias, activation, residual, out_dtype) if needs_epilogue else y
    scale_a, scale_b = _scaled_mm_scales(a, b)
    with on_device(x_fp8.device):
        y = torch._scaled_mm(
            x_fp8,
            w_fp8.t(),
            scale_a=scale_a,
            scale_b=scale_b,
            bias=bias if bias_in_gemm else None,
            out_dtype=out_dtype_gemm,
            use_fast_accum=fast_accum,
        )  # (M, N)
        if not needs_epilogue:
            return y
        return _epilogue(y, bias, activation, residual, out_dtype)
