"""The ``triton`` backend: fused FP8 casts, FP8 GEMMs with epilogues, activations.

Same names, signatures and return types as :mod:`te_fuser.kernels.reference`
(without the ``_reference`` suffix), bit-exact for the casts. Runs on CUDA tensors,
and on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).
Extra fused kernels: :func:`gemm_fp8_out` (the GEMM epilogue also casts its result
to FP8 with a given scale and reduces its amax) and :func:`dact_dbias` (activation
gradient and bias gradient in one pass). :func:`embedding_grad` is the
embedding's weight gradient, each id's rows gathered a group at a time. :func:`layer_norm`,
:func:`layer_norm_grad`, :func:`rms_norm` and :func:`rms_norm_grad` make one pass
each over the data. :func:`delayed_scale_update`
is the whole delayed-scaling state update (history, scale, scale_inv, count) in one
launch; :func:`delayed_scale_update_many` that of many quantizers, one program each. :func:`amax_column_sums` reads a gradient once for its current-scaling amax
and its bias gradient (:func:`quantize_current_column_sums` then casts it); :func:`quantize_tensorwise_column_sums` is the delayed-scaling
cast that also returns the bias gradient from its one read. :func:`attention_forward`,
:func:`attention_backward` and :func:`attention_forward_fp8` are flash attention
(online softmax, causal tiles skipped, grouped kv heads by index); float64 inputs
go to the reference (``*_unsupported_reason``). :func:`grouped_gemm` and
:func:`grouped_gemm_wgrad` run every expert of a mixture-of-experts layer in one launch.
"""

from .activation import activation, activation_grad, dact_dbias
from .attention import (attention_backward, attention_backward_unsupported_reason, attention_forward,
                        attention_forward_fp8, attention_forward_fp8_unsupported_reason,
                        attention_forward_unsupported_reason)
from .cast import (amax_column_sums, dequantize, quantize_block, quantize_current, quantize_current_column_sums,
                   quantize_mxfp8, quantize_rowwise, quantize_tensorwise, quantize_tensorwise_column_sums)
from .embedding import embedding_grad
from .gemm import gemm, gemm_fp8_out
from .grouped_gemm import (grouped_gemm, grouped_gemm_unsupported_reason, grouped_gemm_wgrad,
                           grouped_gemm_wgrad_unsupported_reason)
from .norm import (layer_norm, layer_norm_grad, layer_norm_grad_unsupported_reason, layer_norm_unsupported_reason,
                   rms_norm, rms_norm_grad, rms_norm_grad_unsupported_reason, rms_norm_unsupported_reason)
from .rotary import rotary, rotary_unsupported_reason
from .scaling import delayed_scale_update, delayed_scale_update_many

__all__ = [
    "quantize_tensorwise",
    "quantize_tensorwise_column_sums",
    "quantize_current",
    "amax_column_sums",
    "quantize_current_column_sums",
    "quantize_rowwise",
    "quantize_block",
    "quantize_mxfp8",
    "dequantize",
    "embedding_grad",
    "gemm",
    "gemm_fp8_out",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "grouped_gemm_unsupported_reason",
    "grouped_gemm_wgrad_unsupported_reason",
    "activation",
    "activation_grad",
    "dact_dbias",
    "layer_norm",
    "layer_norm_grad",
    "layer_norm_unsupported_reason",
    "layer_norm_grad_unsupported_reason",
    "rms_norm",
    "rms_norm_grad",
    "rms_norm_unsupported_reason",
    "rms_norm_grad_unsupported_reason",
    "delayed_scale_update",
    "delayed_scale_update_many",
    "rotary",
    "rotary_unsupported_reason",
    "attention_forward",
    "attention_backward",
    "attention_forward_fp8",
    "attention_forward_unsupported_reason",
    "attention_backward_unsupported_reason",
    "attention_forward_fp8_unsupported_reason",
]
