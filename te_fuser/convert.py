"""``te.convert``: an existing PyTorch model's layers as te_fuser ops, in place.

    model = te.convert(model)                      # nn.Linear, nn.LayerNorm, nn.RMSNorm -> te_fuser ops
    te.apply_recipe(model, te.recipe.Float8CurrentScaling(), example_inputs=(x,))

What is replaced, keeping the very Parameter objects (an optimizer built before
the call keeps training them) and the state-dict keys (``weight``, ``bias``), so a
checkpoint of either model loads into the other:

- ``nn.Linear`` -> ``te.ops.Linear``;
- ``nn.LayerNorm`` over one dim with weight and bias -> ``te.ops.LayerNorm``;
- ``nn.RMSNorm`` over one dim with a weight -> ``te.ops.RMSNorm`` (``eps=None``, which
  torch resolves per input dtype, becomes fp32's machine epsilon: te's norms compute
  in fp32);
- an ``nn.Sequential`` -> a ``te.ops.Sequential`` of its converted items, so that
  neighbours fuse; inside it ``nn.GELU(approximate="tanh")``, ``nn.ReLU`` and
  ``nn.SiLU`` become te ops too (te's GELU is the tanh approximation: an exact
  ``nn.GELU()`` stays a torch module).

Everything else stays as it is, and so does a module ``skip`` names (a module path,
or a predicate on ``(path, module)``), with all below it. A layer te_fuser cannot
take as it is (a LayerNorm without bias, a norm over several dims) stays torch's,
and so does one whose te op would drop something of it: a parametrization
(``torch.nn.utils.parametrize``), a pruning mask (``torch.nn.utils.prune``) or
module hooks.
:func:`convert` returns the model; with ``report=True`` also a
:class:`ConversionReport` of what changed and what was left, with the reason.
Inside an enabled ``te.quantized_model_init`` it refuses to run: FP8 parameters
are made by linears built there, and the converted ones keep the model's own.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import ops
from .ops.fp8_parameters import fp8_init_recipe
from .ops.fuser import pruned_names

__all__ = ["convert", "ConversionReport"]

Skip = "Callable[[str, nn.Module], bool] | Iterable[str] | None"


def _linear(m: nn.Linear) -> ops.Linear:
    new = ops.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    new.linear.weight = m.weight
    if m.bias is not None:
        new.bias_op.bias = m.bias
    return new


def _layer_norm(m: nn.LayerNorm):
    if len(m.normalized_shape) != 1:
        return f"normalizes over {len(m.normalized_shape)} dims (te's LayerNorm: the last one)"
    if m.weight is None or m.bias is None:
        return "has no weight or no bias (te's LayerNorm has both)"
    new = ops.LayerNorm(m.normalized_shape[0], eps=m.eps, device="meta")
    new.weight, new.bias = m.weight, m.bias
    return new


def _rms_norm(m: nn.RMSNorm):
    if len(m.normalized_shape) != 1:
        return f"normalizes over {len(m.normalized_shape)} dims (te's RMSNorm: the last one)"
    if m.weight is None:
        return "has no weight (te's RMSNorm has one)"
    eps = torch.finfo(torch.float32).eps if m.eps is None else m.eps
    new = ops.RMSNorm(m.normalized_shape[0], eps=eps, device="meta")
    new.weight = m.weight
    return new


def _activation(m: nn.Module):
    if isinstance(m, nn.GELU):
        return ops.GELU() if m.approximate == "tanh" else "is the exact (erf) GELU; te's GELU is the tanh one"
    return ops.ReLU() if isinstance(m, nn.ReLU) else ops.SiLU()


_LAYERS = {nn.Linear: _linear, nn.LayerNorm: _layer_norm}
if hasattr(nn, "RMSNorm"):
    _LAYERS[nn.RMSNorm] = _rms_norm
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU)


def _skipper(skip) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return lambda path, module: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        raise TypeError("convert(skip=...): a module path must be given in a list, e.g. skip=['head']")
    paths = set(skip)
    return lambda path, module: path in paths


class ConversionReport:
    """What :func:`convert` replaced (``converted``) and what it left, with the reason (``kept``)."""

    def __init__(self) -> None:
        self.converted: list[str] = []
        self.kept: list[tuple[str, str]] = []

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} modules"] + [f"  {p}" for p in self.converted]
        lines += [f"kept {len(self.kept)}:"] + [f"  {p}: {why}" for p, why in self.kept]
        return "\n".join(lines)


def _held_back(module: nn.Module) -> "str | None":
    """Why a layer of a convertible kind is kept as it is: what its te op would drop
    (a parametrization, a pruning mask, module hooks); None when nothing."""
    if parametrize.is_parametrized(module):
        return f"is parametrized ({', '.join(module.parametrizations)}: torch.nn.utils.parametrize)"
    pruned = pruned_names(module)
    if pruned:
        return f"is pruned ({', '.join(sorted(pruned))}: torch.nn.utils.prune)"
    if module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks:
        return "has module hooks, which the te op standing for it would not carry"
    return None


def _convert_one(module: nn.Module, path: str, in_sequential: bool, report: ConversionReport):
    """The te module standing for ``module``, or ``None`` to keep it."""
    kind = type(module)
    if parametrize.is_parametrized(module):  # its class is torch's subclass of the layer's
        kind = kind.__bases__[0]
    make = _LAYERS.get(kind)
    if make is None and in_sequential and kind in _ACTIVATIONS:
        make = _activation
    if make is None:
        return None
    held = _held_back(module)
    if held is not None:
        report.kept.append((path, f"{kind.__name__} {held}"))
        return None
    new = make(module)
    if isinstance(new, str):
        report.kept.append((path, f"{type(module).__name__} {new}"))
        return None
    new.train(module.training)
    report.converted.append(f"{path or '(the model)'}: {type(module).__name__} -> te.ops.{type(new).__name__}")
    return new


def _walk(module: nn.Module, path: str, skip, report: ConversionReport, in_sequential: bool = False) -> nn.Module:
    """``module`` converted (its children first); the module to put in its place."""
    if skip(path, module):
        report.kept.append((path, "skipped"))
        return module
    replaced = _convert_one(module, path, in_sequential, report)
    if replaced is not None:
        return replaced
    sequential = type(module) is nn.Sequential
    for name, child in list(module.named_children()):
        new = _walk(child, f"{path}.{name}" if path else name, skip, report, sequential)
        if new is not child:
            setattr(module, name, new)
    if sequential:
        items = list(module)
        if any(isinstance(m, (ops.BasicOperation, ops.Linear)) for m in items):
            new = ops.Sequential(*items)
            new.train(module.training)
            report.converted.append(f"{path or '(the model)'}: nn.Sequential -> te.ops.Sequential")
            return new
    return module


def convert(model: nn.Module, *, skip: Skip = None, report: bool = False):
    """Replace ``model``'s torch layers by te_fuser ops in place (see the module doc);
    returns the model (its replacement when ``model`` itself is converted), and with
    ``report=True`` the pair ``(model, ConversionReport)``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert(model): must be a torch.nn.Module, got {type(model).__name__}")
    if report is not True and report is not False:
        raise TypeError(f"convert(report=...): must be True or False, got {report!r}")
    if fp8_init_recipe() is not None:
        raise RuntimeError(
            "convert: called inside te.quantized_model_init, whose FP8 parameters are made by linears built there; "
            "convert keeps the model's own Parameters (an optimizer built before keeps training them), so none "
            "would be FP8. Call it outside, or build the te_fuser model inside quantized_model_init instead")
    log = ConversionReport()
    out = _walk(model, "", _skipper(skip), log)
    return (out, log) if report else out
