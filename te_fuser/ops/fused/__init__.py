"""Fused operations and the default table of fusion rules."""

from __future__ import annotations

from ... import backend
from ...kernels.formats import EPILOGUE_ACTIVATIONS
from ..basic.activation import Activation
from ..basic.attention import DotProductAttention
from ..basic.bias import Bias
from ..basic.extra import AddExtraInput, MakeExtraOutput
from ..basic.linear import BasicLinear
from ..basic.misc import ConstantScale
from ..basic.norm import RMSNorm
from ..basic.rotary import RotaryEmbedding
from ..rules import FusionRule, register_fusion_rule
from .backward_activation_bias import BackwardActivationBias
from .backward_add_rmsnorm import BackwardAddRMSNorm
from .backward_linear_add import BackwardLinearAdd
from .backward_linear_bias import BackwardLinearBias
from .backward_linear_bias_activation import BackwardLinearBiasActivation
from .backward_linear_scale import BackwardLinearScale
from .backward_rotary_dpa import BackwardRotaryDPA
from .forward_dpa_linear import ForwardDPALinear
from .forward_linear_bias_activation import ForwardLinearBiasActivation
from .forward_linear_bias_add import ForwardLinearBiasAdd
from .forward_linear_bias_dpa_linear import ForwardLinearBiasDPALinear
from .forward_linear_bias_linear import ForwardLinearBiasLinear
from .forward_linear_bias_rotary import ForwardLinearBiasRotary
from .forward_linear_scale_add import ForwardLinearScaleAdd

__all__ = [
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "ForwardLinearBiasLinear",
    "ForwardLinearBiasRotary",
    "ForwardLinearBiasDPALinear",
    "ForwardDPALinear",
    "BackwardActivationBias",
    "BackwardLinearBiasActivation",
    "BackwardLinearBias",
    "BackwardLinearAdd",
    "BackwardLinearScale",
    "BackwardRotaryDPA",
    "BackwardAddRMSNorm",
    "DEFAULT_RULES",
]


def _needs_grad_output_quantizer(ops, recipe):
    if recipe is None:
        return "no FP8 recipe: there is no grad_output quantizer to cast the gradient for"
    if recipe.backward_override is not None:
        return f"backward_override={recipe.backward_override!r}: the backward GEMMs run in high precision"
    return None


def _epilogue_applies_activation(ops, recipe):
    """The GEMM epilogues (Triton's, CUDA's) apply only EPILOGUE_ACTIVATIONS; others
    run after the GEMM, as their own op."""
    for op in ops:
        if isinstance(op, Activation) and op.kind not in EPILOGUE_ACTIVATIONS:
            return (f"the GEMM epilogue applies {', '.join(EPILOGUE_ACTIVATIONS)}, not {op.kind}: "
                    f"{type(op).__name__} runs as its own op")
        if isinstance(op, Activation) and op.glu_interleave_size is not None:
            return (f"the GEMM epilogue gates the two halves of its output, not blocks of glu_interleave_size="
                    f"{op.glu_interleave_size}: {type(op).__name__} runs as its own op")
    return None


def _delayed_scaling(recipe):
    """The FP8 hand-off needs the next input's scale before the GEMM runs: delayed
    scaling has it; current, block and MXFP8 scaling need the tensor's amax first."""
    return recipe is not None and recipe.delayed()


def _epilogue_backend_reason(device):
    """Why a GEMM should not cast its output in its epilogue on ``device`` (None: it may)."""
    gemm_backend = backend.resolve("gemm", device).backend
    epilogue_backend = backend.resolve("gemm_fp8_out", device).backend
    if gemm_backend != epilogue_backend:
        return (f"the GEMM runs on the {gemm_backend} backend and the fused cast epilogue only on "
                f"{epilogue_backend}: the {gemm_backend} GEMM plus a separate cast is faster")
    return None


def _hand_off_possible(ops, recipe, context):
    """Declines what the epilogue cannot serve when a backward pass follows (the
    plan's build context says whether one does), and
    on a GPU any step with a backward, where the hand-off measured slower than the
    separate cast (benchmarks/bench_handoff.py); CPU plans keep it, so the fused
    backward stays tested against the reference.
    Also declines where the plain GEMM runs on another backend than the fused cast
    epilogue: under ``auto`` on a GPU the GEMM is cuBLASLt's and the epilogue is a
    Triton GEMM, which is slower than cuBLASLt plus a separate cast (H200: Triton
    FP8 GEMM 0.81x cuBLASLt at 8192^3, the cast under a tenth of the GEMM)."""
    device, needs_backward = context.device, context.needs_backward
    reason = _epilogue_applies_activation(ops, recipe) or _epilogue_backend_reason(device)
    if reason is not None:
        return reason
    if not needs_backward:
        return None
    if device.type == "cuda":
        return ("a backward follows: its wgrad needs the FP8 input transposed, a separate byte transpose after the "
                "epilogue, which costs more than the cast it saves (H200, 8192x4096->14336->4096 under Triton: "
                "6.47 ms with the hand-off, 6.01 ms with a separate cast+transpose)")
    if isinstance(ops[2], Activation):
        return ("the activation's backward needs the pre-activation, which the FP8 epilogue does not write "
                "(the rule fires without a backward, e.g. under torch.no_grad)")
    if recipe.backward_override == "high_precision":
        return "backward_override='high_precision': the second linear's backward needs its input in high precision"
    return None


def _current_scaling(recipe):
    """The amax hand-off saves current scaling's first pass (the amax) over the hidden tensor."""
    return recipe is not None and recipe.float8_current_scaling()


def _amax_hand_off_possible(ops, recipe, context):
    """``Linear -> Bias -> activation -> Linear ...`` under current scaling: the
    activation kernel reduces the amax the second linear's cast then takes as given.
    Only with a backward: without one the first GEMM's epilogue applies the
    activation, and no kernel writes the hidden tensor apart."""
    if not context.needs_backward:
        return ("no backward follows: the first GEMM's epilogue applies the activation (no activation kernel to "
                "reduce the amax in; the second linear's cast computes it)")
    if recipe.backward_override == "high_precision":
        return "backward_override='high_precision': the second linear's backward needs its input in high precision"
    return None


def _amax_hand_off_rules():
    """Linear -> Bias -> activation -> Linear [-> Bias [-> activation | AddExtraInput]] under current scaling."""
    head = ((BasicLinear,), (Bias,), (Activation,))
    return tuple(FusionRule(f"forward_activation_amax_{tail_name}", "forward", head + tail, ForwardLinearBiasLinear,
                            _amax_hand_off_possible, applies_to=_current_scaling)
                 for tail_name, tail in (("linear", ((BasicLinear,),)), ("linear_bias", ((BasicLinear,), (Bias,))),
                                         ("linear_bias_activation", ((BasicLinear,), (Bias,), (Activation,))),
                                         ("linear_bias_add", ((BasicLinear,), (Bias,), (AddExtraInput,)))))


def _hand_off_rules():
    """Linear -> Bias [-> activation] -> Linear [-> Bias [-> activation | AddExtraInput]]: one rule per shape."""
    rules = []
    for head_name, head in (("linear_bias", ((BasicLinear,), (Bias,))),
                            ("linear_bias_activation", ((BasicLinear,), (Bias,), (Activation,)))):
        for tail_name, tail in (("linear", ((BasicLinear,),)), ("linear_bias", ((BasicLinear,), (Bias,))),
                                ("linear_bias_activation", ((BasicLinear,), (Bias,), (Activation,))),
                                ("linear_bias_add", ((BasicLinear,), (Bias,), (AddExtraInput,)))):
            rules.append(FusionRule(f"forward_{head_name}_{tail_name}", "forward", head + tail,
                                    ForwardLinearBiasLinear, _hand_off_possible, applies_to=_delayed_scaling))
    return tuple(rules)


def _quantizing(recipe):
    return recipe is not None


def _o_hand_off_possible(ops, recipe):
    """``DotProductAttention -> BasicLinear``: attention's FP8 O into the projection's GEMM."""
    reason = _in_place_tail(ops)
    if reason is not None:
        return reason
    if not recipe.fp8_mha:
        return "fp8_mha is off: attention hands its output on in high precision (TransformerEngine's fp8_mha=False)"
    if recipe.backward_override == "high_precision":
        return "backward_override='high_precision': the projection's backward needs its input in high precision"
    return None


def _in_place_tail(ops):
    if isinstance(ops[-1], AddExtraInput) and ops[-1].adds_in_place:
        return ("AddExtraInput(in_place=True) writes the sum into its extra input's buffer; the attention "
                "projection's fused forward writes a fresh tensor (ForwardLinearBiasAdd serves it)")
    return None


def _qkv_hand_off_possible(ops, recipe, context):
    """``BasicLinear [-> Bias] -> DotProductAttention [-> BasicLinear]``: the QKV GEMM's
    epilogue casts attention's input (and, with the projection, O goes on in FP8)."""
    if not recipe.fp8_mha:
        return "fp8_mha is off: the QKV projection hands attention its output in high precision"
    if not recipe.delayed():
        return (f"the QKV GEMM's epilogue casts with a scale known before the GEMM runs; delayed scaling has it, "
                f"{type(recipe).__name__} needs the amax of q, k, v first (the GEMM writes them in high precision "
                "and attention casts them)")
    if context.needs_backward and recipe.backward_override == "high_precision":
        return ("backward_override='high_precision': attention's backward reads q, k, v in high precision, which "
                "the FP8 epilogue does not write")
    reason = _epilogue_backend_reason(context.device) or _in_place_tail(ops)
    if reason is None and not isinstance(ops[-1], DotProductAttention):
        reason = _o_hand_off_possible(ops, recipe)
    return reason


def _attention_rules():
    """The fp8_mha hand-offs, [Linear [-> Bias]] -> DotProductAttention [-> Linear [-> Bias [-> AddExtraInput]]]:
    one rule per shape (the projection's bias and residual stay in its GEMM's epilogue)."""
    dpa = ((DotProductAttention,),)
    heads = (("linear", ((BasicLinear,),)), ("linear_bias", ((BasicLinear,), (Bias,))))
    tails = (("linear", ((BasicLinear,),)), ("linear_bias", ((BasicLinear,), (Bias,))),
             ("linear_bias_add", ((BasicLinear,), (Bias,), (AddExtraInput,))))
    rules = [FusionRule(f"forward_dpa_{tail_name}", "forward", dpa + tail, ForwardDPALinear, _o_hand_off_possible,
                        applies_to=_quantizing) for tail_name, tail in tails]
    for head_name, head in heads:
        for tail_name, tail in ((None, ()),) + tails:
            name = f"forward_{head_name}_dpa" + (f"_{tail_name}" if tail_name else "")
            rules.append(FusionRule(name, "forward", head + dpa + tail, ForwardLinearBiasDPALinear,
                                    _qkv_hand_off_possible, applies_to=_quantizing))
    return tuple(rules)


DEFAULT_RULES = _hand_off_rules() + _amax_hand_off_rules() + _attention_rules() + (
    FusionRule("forward_linear_bias_activation", "forward", ((BasicLinear,), (Bias,), (Activation,)),
               ForwardLinearBiasActivation, _epilogue_applies_activation),
    FusionRule("forward_linear_bias_add", "forward", ((BasicLinear,), (Bias,), (AddExtraInput,)), ForwardLinearBiasAdd),
    FusionRule("forward_linear_scale_add", "forward", ((BasicLinear,), (ConstantScale,), (AddExtraInput,)),
               ForwardLinearScaleAdd),
    FusionRule("forward_linear_add", "forward", ((BasicLinear,), (AddExtraInput,)), ForwardLinearBiasAdd),
    FusionRule("forward_linear_bias_rotary", "forward", ((BasicLinear,), (Bias,), (RotaryEmbedding,)),
               ForwardLinearBiasRotary),
    FusionRule("forward_linear_rotary", "forward", ((BasicLinear,), (RotaryEmbedding,)), ForwardLinearBiasRotary),
    FusionRule("forward_linear_bias", "forward", ((BasicLinear,), (Bias,)), ForwardLinearBiasActivation),
    FusionRule("backward_linear_bias_activation", "backward", ((BasicLinear,), (Bias,), (Activation,)),
               BackwardLinearBiasActivation, _needs_grad_output_quantizer),
    FusionRule("backward_linear_bias", "backward", ((BasicLinear,), (Bias,)), BackwardLinearBias,
               _needs_grad_output_quantizer),
    FusionRule("backward_linear_scale", "backward", ((BasicLinear,), (ConstantScale,)), BackwardLinearScale),
    FusionRule("backward_activation_bias", "backward", ((Bias,), (Activation,)), BackwardActivationBias),
    FusionRule("backward_linear_add", "backward", ((MakeExtraOutput,), (BasicLinear,)), BackwardLinearAdd),
    FusionRule("backward_add_rmsnorm", "backward", ((MakeExtraOutput,), (RMSNorm,)), BackwardAddRMSNorm),
    FusionRule("backward_rotary_dpa", "backward", ((RotaryEmbedding,), (DotProductAttention,)), BackwardRotaryDPA),
)

for _rule in DEFAULT_RULES:
    register_fusion_rule(_rule)
