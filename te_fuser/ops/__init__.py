"""Fusible operations, the op fuser and Sequential (the names follow TransformerEngine's te.ops)."""

from . import fused  # noqa: F401  (registers the default fusion rules)
from .basic import *  # noqa: F401,F403
from .basic import __all__ as _basic_all
from .find import fuser_owners, fusers_of
from .fuser import FusionPlan, FusionStats, OperationFuser, PlanKey
from .init import reset_parameters
from .op import BasicOperation, FusedOperation, OpContext
from .rules import (FusionRule, RuleTable, fusion_rule_table, fusion_rules, register_fusion_rule,
                    unregister_fusion_rule, without_fusion_rules)
from .sequential import Sequential

__all__ = _basic_all + [
    "Sequential", "BasicOperation", "FusedOperation", "OpContext", "OperationFuser", "FusionPlan",
    "FusionStats", "FusionRule", "RuleTable", "register_fusion_rule", "unregister_fusion_rule",
    "without_fusion_rules", "fusion_rules", "fusion_rule_table", "fusers_of", "fuser_owners", "PlanKey",
    "reset_parameters",
]
