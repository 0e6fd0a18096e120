"""The kernel layer's contract: which kernels exist, and what each backend owes.

Every kernel has a reference in ``reference/`` named ``<kernel>_reference`` (plain
torch: the oracle); a backend module (``triton``, ``cuda``) exposes a kernel under
its bare name with exactly the reference's signature (parameter names, order and
defaults), or does not expose it and the dispatcher (``te_fuser.backend``) falls
back. A backend may also expose ``<kernel>_unsupported_reason(...)``: operands it
names a reason for go to the fallback per call. ``tests/test_kernel_contract.py``
checks every backend against this table.

The vocabulary the kernels share is spelled once: the FP8 formats and the
scaling schemes in ``formats.py``, the quantized operand in ``operand.py``, and
the argument checks every backend runs before launching next to the reference
(``check_matrix``, ``check_given_amax``, ``check_update_arguments``,
``check_attention``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

__all__ = ["KERNELS", "BACKEND_MODULES", "reference", "signature_mismatch"]

KERNELS = (
    "quantize_tensorwise",             # delayed scaling's cast: a given scale, the amax, a transposed copy
    "quantize_tensorwise_column_sums",  # the same with the columns' sums (a bias gradient) from its read
    "quantize_current",                # current scaling: the amax first, then the cast
    "amax_column_sums",                # the amax and the column sums in one read
    "quantize_current_column_sums",    # current scaling's cast with the columns' sums (a bias gradient)
    "quantize_rowwise",                # one scale per row
    "quantize_block",                  # 1x128 and 128x128 block scales
    "quantize_mxfp8",                  # MXFP8: E8M0 scales per 32 elements
    "dequantize",
    "gemm",                            # FP8 GEMM with a bias / activation / residual epilogue
    "gemm_fp8_out",                    # the same whose epilogue casts the result to FP8
    "grouped_gemm",                    # one GEMM per group of rows (MoE experts' fprop and dgrad), one launch
    "grouped_gemm_wgrad",              # one GEMM per group of the reduction dim (the experts' wgrad), one launch
    "activation",
    "activation_grad",
    "dact_dbias",                      # an activation's backward with the bias gradient
    "layer_norm",                      # LayerNorm in fp32 from operands of any float dtype, with mean and rstd
    "layer_norm_grad",                 # its dx, dweight, dbias from the forward's mean and rstd
    "rms_norm",
    "rms_norm_grad",
    "delayed_scale_update",            # delayed scaling's history, scale and counters in one step
    "delayed_scale_update_many",       # the same for many quantizers of one configuration, in one pass
    "rotary",                          # rotary position embedding of the leading heads (forward or inverse)
    "embedding_grad",                  # the embedding's weight gradient in a fixed order
    "attention_forward",               # flash attention: o and the rows' log-sum-exp (causal, grouped kv heads)
    "attention_backward",              # its gradients dq, dk, dv from o and the log-sum-exp
    "attention_forward_fp8",           # the forward on E4M3 q, k, v with the probabilities cast to E4M3
)

BACKEND_MODULES = {"reference": "reference", "triton": "triton", "cuda": "cuda"}  # backend -> subpackage


def _package() -> str:
    return __name__.rsplit(".", 1)[0]


def reference(kernel: str) -> Callable:
    """The reference implementation of ``kernel``."""
    if kernel not in KERNELS:
        raise KeyError(f"kernel contract: no kernel named {kernel!r}")
    return getattr(importlib.import_module(f"{_package()}.reference"), f"{kernel}_reference")


def signature_mismatch(kernel: str, fn: Callable) -> str | None:
    """How ``fn``'s signature differs from ``kernel``'s reference (None: it does not)."""
    want = [(p.name, p.kind, p.default) for p in inspect.signature(reference(kernel)).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    if got == want:
        return None
    return f"{kernel}: has ({', '.join(n for n, _, _ in got)}), the reference ({', '.join(n for n, _, _ in want)})"
