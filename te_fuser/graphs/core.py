"""The capture core both CUDA-graph front ends share (``sequential.py``'s
``make_graphed``, ``step.py``'s ``make_graphed_step``): the counters, the
scaling state held at fixed addresses, what a capture read from the model and
must still hold at replay, and the ops whose weight casts a capture keeps.
Built on the ops' and quantizers' public handles only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..epoch import CHANGES as _EPOCH
from ..ops.op import BasicOperation
from ..quantization.amax_reduction import default_group

__all__ = ["GraphStats", "StateSlot", "CaptureGuard", "state_slots", "quantizers_seeded", "weight_casting_ops",
           "drop_weight_caches", "reduces_amax"]


def reduces_amax(state) -> bool:
    """Whether te.autocast's ``state`` makes delayed scaling all-reduce its amaxes (a
    group given, or the default process group of several ranks): such steps run
    eager, the collectives outside any graph."""
    if state.amax_reduction_group is not None:
        return True
    recipe = state.active_recipe
    return (recipe is not None and recipe.delayed() and recipe.reduce_amax and default_group() is not None)


@dataclass
class GraphStats:
    """What a :class:`GraphedSequential` has done: captures, replays and eager steps."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    capture_seconds: float = 0.0  # wall time of the last capture (warm-up runs included)


class StateSlot:
    """One tensor of a quantizer's scaling state, kept at a fixed address for the graphs.

    ``home`` is the tensor the graphs read; the quantizer rebinds its attribute
    whenever it updates (it never writes in place), and the captured graphs copy
    the rebound tensor back into ``home``."""

    __slots__ = ("quantizer", "name", "home")

    def __init__(self, quantizer, name: str) -> None:
        self.quantizer, self.name = quantizer, name
        self.home: torch.Tensor = quantizer.state_tensors()[name]

    def live(self) -> torch.Tensor:
        return self.quantizer.state_tensors()[self.name]

    def adopt(self, live: torch.Tensor | None = None) -> None:
        """Make ``home`` hold the quantizer's current value (``live``, when the caller
        has read it) and bind the quantizer to it."""
        live = self.live() if live is None else live
        if live is not self.home:
            self.home.copy_(live)
            self.quantizer.bind_state_tensor(self.name, self.home)

    def rebind(self) -> None:
        """Bind the quantizer to ``home`` again (discarding a value it was rebound to)."""
        self.quantizer.bind_state_tensor(self.name, self.home)

    def bound(self) -> bool:
        return self.live() is self.home


class CaptureGuard:
    """What a capture read from the model: the parameters' storage and trainable
    flags and the installed quantizers. A change to any of them means the graphs
    would replay stale reads, so they are recaptured."""

    def __init__(self, key, all_params: tuple[torch.Tensor, ...], slots: list[StateSlot], quantizers) -> None:
        self.key = key
        self.all_params = all_params
        self.trainable_flags = tuple(p.requires_grad for p in all_params)  # freezing a parameter means a new capture
        self.params = tuple(p for p in all_params if p.requires_grad)  # the ones the graphs compute gradients for
        self.param_ptrs = tuple(p.data_ptr() for p in all_params)
        self.slots = slots
        # the slots by quantizer: a replay reads each quantizer's state once
        groups: dict = {}
        for slot in slots:
            groups.setdefault(id(slot.quantizer), (slot.quantizer, []))[1].append(slot)
        self.slot_groups = tuple((q, tuple(group)) for q, group in groups.values())
        self.quantizers = quantizers  # (op, its quantizer dict) at capture time
        self.epoch = _EPOCH[0]

    def adopt_rebound(self) -> None:
        """Before a replay: adopt every state tensor a quantizer rebound since the
        graphs last ran (an eager step in between updated it). One read of each
        quantizer's state (delayed scaling's: about 400 slots of a GPT, each read on
        its own, cost a replay hundreds of microseconds of host time)."""
        for quantizer, group in self.slot_groups:
            live = quantizer.state_tensors()
            for slot in group:
                tensor = live[slot.name]
                if tensor is not slot.home:
                    slot.adopt(tensor)

    def still_valid(self) -> bool:
        if self.epoch != _EPOCH[0]:
            for op, qs in self.quantizers:
                if op.installed_quantizers is not qs:
                    return False
            self.epoch = _EPOCH[0]
        for p, ptr, flag in zip(self.all_params, self.param_ptrs, self.trainable_flags):
            if p.data_ptr() != ptr or p.requires_grad is not flag:
                return False
        return True


def state_slots(model: nn.Module) -> tuple[list, list[StateSlot]]:
    """``(op, quantizer dict)`` of every op, and a slot for every tensor of their
    quantizers' scaling state, each bound to its home."""
    quantizers = [(op, op.installed_quantizers) for op in model.modules() if isinstance(op, BasicOperation)]
    slots = [StateSlot(q, name) for _, qs in quantizers for q in qs.values() for name in q.state_tensors()]
    for slot in slots:
        slot.adopt()
    return quantizers, slots


def quantizers_seeded(model: nn.Module) -> bool:
    """Whether every quantizer has seeded its state: a first step under a recipe
    seeds delayed scaling from the tensor itself, and that step must not be replayed."""
    for op in model.modules():
        if isinstance(op, BasicOperation):
            for q in op.installed_quantizers.values():
                if not q.seeded:
                    return False
    return True


def weight_casting_ops(model: nn.Module) -> list:
    """The ops that cast a weight (and may keep the cast)."""
    return [op for op in model.modules() if isinstance(op, BasicOperation) and op.casts_weights]


def drop_weight_caches(ops) -> None:
    for op in ops:
        op.drop_caches()
