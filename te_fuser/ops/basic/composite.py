"""Linear: BasicLinear followed by Bias, as one module a user can hold."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..op import WatchedModule
from .bias import Bias
from .linear import BasicLinear

__all__ = ["Linear"]


# state-dict keys: nn.Linear's name -> this module's (its basic ops')
_KEYS = {"weight": "linear.weight", "bias": "bias_op.bias", "_extra_state": "linear._extra_state"}


def _as_torch_keys(module, state_dict, prefix, local_metadata) -> None:
    state_dict.pop(prefix + "bias_op._extra_state", None)  # a Bias has no quantizer: nothing to keep
    for torch_name, own in _KEYS.items():
        if prefix + own in state_dict:
            state_dict[prefix + torch_name] = state_dict.pop(prefix + own)


def _from_torch_keys(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    for torch_name, own in _KEYS.items():
        if prefix + torch_name in state_dict:
            state_dict[prefix + own] = state_dict.pop(prefix + torch_name)


class Linear(WatchedModule):
    """``y = x @ weight.T + bias``, initialised like ``torch.nn.Linear``.

    In a ``Sequential`` it contributes its basic ops (BasicLinear, then Bias when
    ``bias=True``), which the fuser may fuse with their neighbours. Its state dict
    has ``nn.Linear``'s keys (``weight``, ``bias``; ``_extra_state`` only while
    there is scaling state to keep), so the checkpoints of either load into the
    other; a load also takes the basic ops' own keys (``linear.weight``, ...).
    ``accumulate_into_main_grad`` is BasicLinear's (the weight gradient goes into
    ``weight.main_grad``); the bias gradient stays in ``.grad``, as in
    TransformerEngine's ``te.ops.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None, name=None,
                 accumulate_into_main_grad: bool = False):
        super().__init__()
        self.linear = BasicLinear(in_features, out_features, device=device, dtype=dtype, name=name,
                                  accumulate_into_main_grad=accumulate_into_main_grad)
        self.bias_op = (Bias(out_features, device=device, dtype=dtype, name=name,
                             init_bound=1.0 / math.sqrt(in_features)) if bias else None)
        self._own_fuser = None
        self._register_state_dict_hook(_as_torch_keys)
        self._register_load_state_dict_pre_hook(_from_torch_keys)

    def reset_parameters(self) -> None:
        """Draw the weight and bias again as construction did (``torch.nn.Linear``'s
        init), in place: after ``to_empty`` or to start over."""
        for op in self.basic_ops:
            op.reset_parameters()

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return None if self.bias_op is None else self.bias_op.bias

    @property
    def basic_ops(self) -> list:
        return [self.linear] + ([self.bias_op] if self.bias_op is not None else [])

    def quantizer(self, tensor_type: str):
        return self.linear.quantizer(tensor_type)

    def own_fuser(self):
        """The fuser that runs this Linear when it is called on its own (made on first use)."""
        if self._own_fuser is None:
            from ..fuser import OperationFuser

            # the basic ops are not called through their own __call__: the fuser runs their hooks
            self._own_fuser = OperationFuser(self.basic_ops, hook_modules=self.basic_ops)
        return self._own_fuser

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._own_fuser or self.own_fuser()).call(x, self.training)
