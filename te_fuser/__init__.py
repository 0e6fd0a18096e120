"""te_fuser: FP8 training with fusible operations, re-fused whenever the recipe changes.

    import te_fuser as te
    model = te.ops.Sequential(te.ops.RMSNorm(h), te.ops.Linear(h, f), te.ops.GELU(), te.ops.Linear(f, h))
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = model(x)
"""

from . import ops, quantization, recipe
from .apply import apply_recipe, fusion_plan, fusion_stats
from .convert import convert
from .fp8 import DType
from .autocast import DEFAULT_RECIPE, autocast
from .backend import get_backend, set_backend
from .checkpoint import checkpoint
from .graphs import make_graphed, make_graphed_step
from .ops.fp8_all_gather import enable_fsdp_fp8_all_gather, fp8_all_gather_stats
from .ops.weight_cache import reuse_quantized_weights
from .ops.fp8_parameters import fp8_model_init, parameter_bytes, quantized_model_init
from .parallel import sequence_parallel
from .warmup import warmup

__all__ = ["ops", "quantization", "recipe", "DType", "autocast", "DEFAULT_RECIPE", "set_backend", "get_backend", "warmup",
           "make_graphed", "make_graphed_step", "reuse_quantized_weights", "quantized_model_init", "fp8_model_init", "parameter_bytes", "sequence_parallel", "apply_recipe", "fusion_plan", "fusion_stats", "convert",
           "enable_fsdp_fp8_all_gather", "fp8_all_gather_stats", "checkpoint"]
__version__ = "0.1.0"
