"""The ``reference`` backend: plain torch, any device; the numerics oracle."""

from .activation import *  # noqa: F401,F403
from .activation import __all__ as _act_all
from .attention import *  # noqa: F401,F403
from .attention import __all__ as _attn_all
from .cast import *  # noqa: F401,F403
from .cast import __all__ as _cast_all
from .embedding import *  # noqa: F401,F403
from .embedding import __all__ as _embedding_all
from .gemm import *  # noqa: F401,F403
from .gemm import __all__ as _gemm_all
from .grouped_gemm import *  # noqa: F401,F403
from .grouped_gemm import __all__ as _grouped_gemm_all
from .norm import *  # noqa: F401,F403
from .norm import __all__ as _norm_all
from .rotary import *  # noqa: F401,F403
from .rotary import __all__ as _rotary_all
from .scaling import *  # noqa: F401,F403
from .scaling import __all__ as _scaling_all

__all__ = _act_all + _attn_all + _cast_all + _embedding_all + _gemm_all + _grouped_gemm_all + _norm_all + _rotary_all + _scaling_all
