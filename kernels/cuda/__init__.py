"""The ``cuda`` backend: CUDA C++ FP8 casts and cuBLASLt FP8 GEMMs.

Kernels (same names, signatures and results as the reference ones, casts bit
for bit):

- ``quantize_tensorwise``: delayed-scaling cast; amax, row-wise and transposed
  (column-wise) FP8 copies in one pass;
- ``quantize_tensorwise_column_sums``: the same, and the column sums (a bias
  gradient) from the same read;
- ``quantize_current``: current scaling, two passes (amax, then scale and cast,
  optionally with the transposed copy);
- ``quantize_current_column_sums``: the same, and the column sums from the cast
  pass's read;
- ``quantize_rowwise``: one scale per row (for row-wise scaled GEMMs);
- ``quantize_mxfp8``: MXFP8 (E8M0 scale per 32 elements along the last dim);
- ``delayed_scale_update``: delayed scaling's history, scale and count in one
  block; ``delayed_scale_update_many``: those of many quantizers, a block each,
  read where they are (nothing stacked first);
- ``layer_norm``, ``layer_norm_grad``: LayerNorm, a warp per row (the backward
  with a column-tiled kernel for the parameter gradients), launched from C++;
- ``gemm``: ``torch._scaled_mm`` (cuBLASLt) plus one fused epilogue kernel;
  operand pairs cuBLASLt cannot run go to the reference GEMM
  (:func:`gemm_unsupported_reason` says why);
- ``attention_forward``: cuDNN's fused flash attention (bf16, fp16) through
  torch's SDPA operators; other operands go to Triton;
- ``attention_backward``: deterministic: our Hopper backward (one kernel adding dq
  in a fixed order) at the causal shapes where it beats the Triton kernels, the
  Triton kernels elsewhere; cuDNN's (atomics) when chosen (``set_backward_kernel``);
- ``attention_forward_fp8``: our Hopper FP8 flash attention forward (wgmma, a
  producer warpgroup and two consumers, P·V added in the tensor cores'
  accumulator); head dims other than 64 and 128, other GPUs and layouts its copies
  cannot read go to Triton per call;
- ``rotary``: rotary position embedding of the fused QKV tensor's q and k heads,
  its operands checked and its output made in one C++ call (``rotary.lean``);
- ``dact_dbias``: the backward of Bias -> a unary activation (gelu, relu, silu,
  qgelu, srelu) with the bias gradient, in one C++ call (``dact_dbias.lean``); the
  other kinds go to Triton's.

Not provided (the dispatcher falls back to ``reference`` and says so):
``quantize_block``, ``dequantize``, ``activation``, ``activation_grad``.

Importing this module compiles nothing and needs no GPU. The extension is built
for sm_90a with nvcc on first use (see :mod:`._build`); without a CUDA build of
PyTorch, a Hopper GPU, nvcc or ninja, the kernels raise ``RuntimeError`` naming
what is missing (:func:`unavailable_reason`).
"""

from ._build import extension as load_extension
from ._build import (is_loaded, one_launch_casts, set_one_launch_casts, set_one_launch_casts_in_capture,
                     unavailable_reason)
from .activation import dact_dbias, dact_dbias_unsupported_reason

# The submodule's name is a kernel's (the activations themselves), which this backend
# leaves to triton: the package's attributes are the kernels it provides.
globals().pop("activation")  # bound by the submodule's import above
from .attention import (attention_backward, attention_backward_unsupported_reason, attention_forward,
                        attention_forward_fp8, attention_forward_fp8_unsupported_reason,
                        attention_forward_unsupported_reason)
from .cast import (quantize_current, quantize_current_column_sums, quantize_mxfp8, quantize_rowwise,
                   quantize_tensorwise, quantize_tensorwise_column_sums)
from .gemm import block_scaled_mm_available, gemm, gemm_unsupported_reason
from .norm import layer_norm, layer_norm_grad
from .rotary import rotary, rotary_unsupported_reason
from .scaling import delayed_scale_update, delayed_scale_update_many

__all__ = [
    "quantize_tensorwise",
    "quantize_tensorwise_column_sums",
    "quantize_current",
    "quantize_current_column_sums",
    "quantize_rowwise",
    "quantize_mxfp8",
    "delayed_scale_update",
    "delayed_scale_update_many",
    "layer_norm",
    "layer_norm_grad",
    "attention_forward",
    "attention_backward",
    "attention_forward_unsupported_reason",
    "attention_backward_unsupported_reason",
    "attention_forward_fp8",
    "attention_forward_fp8_unsupported_reason",
    "rotary",
    "rotary_unsupported_reason",
    "dact_dbias",
    "dact_dbias_unsupported_reason",
    "gemm",
    "gemm_unsupported_reason",
    "block_scaled_mm_available",
    "load_extension",
    "is_loaded",
    "set_one_launch_casts",
    "set_one_launch_casts_in_capture",
    "one_launch_casts",
    "unavailable_reason",
]
