"""Quantizers and the quantized-tensor storage.

``quantizer_for(recipe, role)`` builds the quantizer a recipe prescribes for one
tensor role. ``quantizer.cast(x, rowwise=..., columnwise=...)`` returns the
internal :class:`QuantizedTensor` the ops hand to the GEMMs (or ``x`` itself for
:class:`IdentityQuantizer`); ``quantizer(x)``, TransformerEngine's call, returns
a :class:`Float8Tensor` holding the same copies.
"""

from .base import EpilogueCast, Quantizer
from .block import Float8BlockQuantizer
from .current import Float8CurrentScalingQuantizer
from .delayed import DelayedScalingQuantizer
from .float8 import Float8Quantizer
from .factory import quantizer_for
from .identity import IdentityQuantizer
from .mxfp8 import MXFP8Quantizer
from .role import QuantizerRole
from .rowwise import Float8RowwiseQuantizer
from .tensor import QuantizedTensor

__all__ = [
    "QuantizerRole",
    "QuantizedTensor",
    "Quantizer",
    "EpilogueCast",
    "IdentityQuantizer",
    "Float8CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "Float8Quantizer",
    "MXFP8Quantizer",
    "Float8BlockQuantizer",
    "Float8RowwiseQuantizer",
    "quantizer_for",
]
