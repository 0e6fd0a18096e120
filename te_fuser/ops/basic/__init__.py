"""Basic operations: each owns its parameters and runs its own forward and backward."""

from .activation import (GEGLU, GELU, GLU, QGEGLU, QGELU, Activation, ClampedSwiGLU, ReGLU, ReLU, ScaledActivation,
                         ScaledClampedQGeGLU, ScaledSiTUGLU, ScaledSReLU, ScaledSwiGLU, SiLU, SiTUGLU, SReGLU, SReLU,
                         SwiGLU)
from .attention import DotProductAttention
from .bias import Bias
from .composite import Linear
from .embedding import Embedding
from .extra import AddExtraInput, MakeExtraOutput
from .grouped_linear import GroupedLinear
from .linear import BasicLinear
from .misc import ConstantScale, Dropout, Identity, Quantize, Reshape
from .norm import L2Normalization, LayerNorm, RMSNorm
from .rotary import RotaryEmbedding

__all__ = [
    "Activation", "GELU", "QGELU", "ReLU", "SReLU", "SiLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU", "SwiGLU",
    "ClampedSwiGLU", "SiTUGLU", "ScaledActivation", "ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU",
    "ScaledSReLU",
    "Bias", "Linear", "BasicLinear", "GroupedLinear",
    "AddExtraInput", "MakeExtraOutput", "ConstantScale", "Dropout", "Identity", "Quantize",
    "Reshape", "LayerNorm", "RMSNorm", "L2Normalization", "DotProductAttention", "RotaryEmbedding", "Embedding",
]
