"""Quantizer roles: which tensor of which op a quantizer is for."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["QuantizerRole", "TENSOR_TYPES", "FORWARD_TENSOR_TYPES", "BACKWARD_TENSOR_TYPES", "ATTENTION_MODULE_TYPE",
           "ATTENTION_TENSOR_TYPES"]

# The module type of attention's roles (``te.ops.DotProductAttention``), as TransformerEngine names it,
# and its tensors: ``qkv`` the fused Q, K, V input (one per-tensor scale), ``s`` the softmax
# probabilities P, ``o`` the output, ``do`` the output's gradient.
ATTENTION_MODULE_TYPE = "dpa"
ATTENTION_TENSOR_TYPES = ("qkv", "s", "o", "do")
FORWARD_TENSOR_TYPES = ("input", "weight", "output", "qkv", "s", "o")
BACKWARD_TENSOR_TYPES = ("grad_output", "grad_input", "do")
TENSOR_TYPES = FORWARD_TENSOR_TYPES + BACKWARD_TENSOR_TYPES


class QuantizerRole(NamedTuple):
    """``QuantizerRole('linear', 'weight', 'fc1')``.

    ``module_type`` names the kind of op (``'linear'``, ``'quantize'``, ``'dpa'``...),
    ``tensor_type`` the tensor (one of :data:`TENSOR_TYPES`) and ``name`` the op's
    user-given name (``''`` when it has none). Every field may be left out, as in
    TransformerEngine (``QuantizerRole(tensor_type="weight")``); :meth:`make`
    validates all three.
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    @classmethod
    def make(cls, module_type: str, tensor_type: str, name: str | None = None) -> "QuantizerRole":
        if tensor_type not in TENSOR_TYPES:
            raise ValueError(f"QuantizerRole.tensor_type: must be one of {list(TENSOR_TYPES)}, got {tensor_type!r}")
        if not isinstance(module_type, str) or not module_type:
            raise ValueError(f"QuantizerRole.module_type: must be a non-empty string, got {module_type!r}")
        return cls(module_type, tensor_type, name or "")

    @property
    def is_backward(self) -> bool:
        return self.tensor_type in BACKWARD_TENSOR_TYPES

    def __str__(self) -> str:
        name = f":{self.name}" if self.name else ""
        return f"{self.module_type}{name}.{self.tensor_type}"
