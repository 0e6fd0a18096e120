"""Sequential: a list of modules whose runs of fusible ops are fused as groups.

Fusible ops (basic ops, and composites such as ``Linear`` that expand into basic
ops) that stand next to each other form a group run by one
:class:`~te_fuser.ops.fuser.OperationFuser`; any other ``nn.Module`` runs as it
is between groups. ``model(x, *extra_inputs)`` returns ``y``, or
``(y, *extra_outputs)`` when ops such as ``MakeExtraOutput`` emit branches.

Module hooks of the ops in a group. A group runs as one unit, so its ops'
forward hooks run around the unit, as if it were one module: every forward
pre-hook of the group's modules (a composite such as ``Linear`` first, then its
basic ops; torch's global hooks too, as for any call) runs before the group,
in order, sees the group's input and may replace it; every forward hook runs
after the group, in order, sees that input and the group's output and may
replace the output. This is what FSDP2's ``fully_shard`` on single ops needs
(gather before, free after, its backward hooks on the group's input and
output), and what profilers and module trackers see. A module *backward* hook
(``register_full_backward_hook``) on an op inside a group cannot run (the op's
own gradients are never formed) and is refused with an error at the call;
register it on the ``Sequential`` instead. Hooks on the ``Sequential`` itself,
and on plain modules between groups, run as usual.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from .fuser import FusionStats, OperationFuser, compute_dtype
from .rules import RuleTable
from .op import BasicOperation
from .report import PlanReport, plan_report

__all__ = ["Sequential"]

_is_compiling = torch.compiler.is_compiling  # looked up once: forward is the hot path


def _accept_item_list_keys(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Checkpoints that held the items under ``_items.``: their keys as today's."""
    old = prefix + "_items."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)


def _basic_ops_of(module: nn.Module) -> list[BasicOperation] | None:
    if isinstance(module, BasicOperation):
        return [module]
    ops = getattr(module, "basic_ops", None)
    if isinstance(ops, list) and ops and all(isinstance(op, BasicOperation) for op in ops):
        return ops
    return None


def _explain_channels_across_modules(groups: list) -> None:
    """A channel written in one group and read in a later one (a plain module splits
    them): both fusers' channel problem says so, naming the modules between. Channels
    are scoped to one fuser (as in TransformerEngine); raised when a plan is built."""
    written: dict = {}  # channel -> (group index, op index) of its latest write
    for g, group in enumerate(groups):
        routes = group.routes if isinstance(group, OperationFuser) else None
        if routes is None:
            continue
        for i, channel in routes.unwritten:
            if channel in written:
                w, j = written[channel]
                writer = groups[w].ops[j]
                between = ", ".join(type(m).__name__ for m in groups[w + 1 : g] if not isinstance(m, OperationFuser))
                problem = (f"channel {channel!r}: {writer.describe()} (group {w}) writes it and "
                           f"{group.ops[i].describe()} (group {g}) reads it, across the plain module(s) {between}; "
                           "a channel stays inside one group of fusible ops: make the module a te.ops op, or pass "
                           "the tensor as a public extra output and input (channel=None)")
                group.channel_problem = problem
                if (j, channel) in groups[w].routes.unread:  # the writer's unread write: the same mistake
                    groups[w].channel_problem = problem
        for j, op in enumerate(group.ops):
            for channel in getattr(op, "extra_output_channels", ()):
                if channel is not None:
                    written[channel] = (g, j)


class Sequential(nn.Module):
    _fast_extra_inputs = -1  # the extra inputs its one fuser takes (-1: it has several groups, or extra outputs)

    def __init__(self, *modules: nn.Module, fuse: bool = True, rules: RuleTable | None = None) -> None:
        super().__init__()
        if not isinstance(fuse, bool):
            raise TypeError(f"Sequential(fuse=...): must be True or False, got {fuse!r}")
        if rules is not None and not isinstance(rules, RuleTable):
            raise TypeError(f"Sequential(rules=...): must be a te.ops.RuleTable or None, got {type(rules).__name__}")
        self.fuse = fuse  # False: every op runs on its own (the unfused baseline)
        self.rules = rules  # its own fusion rules (None: the table in force when a plan is built)
        self._own_recipe: tuple | None = None  # (recipe or None, pinned) from te.apply_recipe
        # the items are the module's children "0", "1", ... as in nn.Sequential, so the
        # state-dict keys are nn.Sequential's (a load also takes the older "_items." keys)
        self._register_load_state_dict_pre_hook(_accept_item_list_keys)
        self.extend(modules)

    # -- list semantics --------------------------------------------------------
    def _changed(self) -> None:
        """The list changed: its groups are made again now (not at the first call, so
        that torch.compile's tracing finds them made)."""
        self._groups: list | None = None
        self._fast_fuser: OperationFuser | None = None
        self.groups()

    def _check(self, module) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential: items must be torch.nn.Module, got {type(module).__name__}")
        return module

    @property
    def _items(self) -> list[nn.Module]:
        return list(self._modules.values())

    def _renumber(self, items: list[nn.Module]) -> None:
        self._modules.clear()
        for i, module in enumerate(items):
            self._modules[str(i)] = module
        self._changed()

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise TypeError(f"Sequential: indices must be integers or slices, got {type(idx).__name__}")
        if not -n <= idx < n:
            raise IndexError(f"Sequential: index {idx} is out of range for {n} items")
        return idx % n

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return Sequential(*self._items[idx], fuse=self.fuse, rules=self.rules)
        return self._items[self._index(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        self._modules[str(self._index(idx))] = self._check(module)
        self._changed()

    def __delitem__(self, idx) -> None:
        items = self._items
        if isinstance(idx, slice):
            del items[idx]
        else:
            del items[self._index(idx)]
        self._renumber(items)

    def pop(self, idx: int = -1) -> nn.Module:
        """Remove the module at ``idx`` and return it (as ``nn.Sequential.pop``)."""
        module = self[idx]
        del self[idx]
        return module

    def append(self, module: nn.Module) -> "Sequential":
        self._modules[str(len(self._modules))] = self._check(module)
        self._changed()
        return self

    def extend(self, modules: Iterable[nn.Module]) -> "Sequential":
        for m in modules:
            self._modules[str(len(self._modules))] = self._check(m)
        self._changed()
        return self

    def insert(self, index: int, module: nn.Module) -> "Sequential":
        items = self._items
        items.insert(index, self._check(module))
        self._renumber(items)
        return self

    def __add__(self, other: "Sequential") -> "Sequential":
        if not isinstance(other, Sequential):
            return NotImplemented
        return Sequential(*self._items, *other._items, fuse=self.fuse and other.fuse)

    # -- grouping ------------------------------------------------------------------
    def groups(self) -> list:
        """Each entry is an OperationFuser (a run of fusible ops) or a plain module."""
        if self._groups is None:
            groups: list = []
            run: list[BasicOperation] = []
            hooked: list[nn.Module] = []  # the modules of the run whose forward hooks the fuser runs
            for module in self._items:
                ops = _basic_ops_of(module)
                if ops is not None:
                    run.extend(ops)
                    hooked.extend([module] if isinstance(module, BasicOperation) else [module, *ops])
                    continue
                if run:
                    groups.append(OperationFuser(run, fuse=self.fuse, hook_modules=hooked, rules=self.rules))
                    run, hooked = [], []
                groups.append(module)
            if run:
                groups.append(OperationFuser(run, fuse=self.fuse, hook_modules=hooked, rules=self.rules))
            for group in groups:
                if isinstance(group, OperationFuser):
                    group.own_recipe = self.__dict__.get("_own_recipe")
            _explain_channels_across_modules(groups)
            self._groups = groups
            single = len(groups) == 1 and isinstance(groups[0], OperationFuser) and groups[0].num_extra_outputs == 0
            self._fast_fuser = groups[0] if single else None
            self._fast_extra_inputs = groups[0].num_extra_inputs if single else -1
        return self._groups

    # -- running -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        fast = self._fast_fuser
        if fast is not None and not _is_compiling():  # one group without extra outputs, kept short
            if not extra_inputs:
                if not self._fast_extra_inputs:
                    return fast.entry(x, self.training)
            elif len(extra_inputs) == self._fast_extra_inputs:  # a residual, seq(x, x)
                return fast.entry_with_extras(x, self.training, extra_inputs)
        return self._forward_groups(x, *extra_inputs)

    @property
    def own_recipe(self) -> "tuple | None":
        """``(recipe or None, pinned)`` given by ``te.apply_recipe``, or None; the
        fusers this Sequential makes again (when its list of items changes) take it."""
        return self.__dict__.get("_own_recipe")

    @own_recipe.setter
    def own_recipe(self, setting: "tuple | None") -> None:
        self.__dict__["_own_recipe"] = setting

    def _forward_groups(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        groups = self._groups if self._groups is not None else self.groups()
        training = self.training
        used, extra_out = 0, []
        for group in groups:
            if not isinstance(group, OperationFuser):
                x = group(x)
                continue
            n = group._num_extra_inputs
            if used + n > len(extra_inputs):
                raise ValueError(
                    f"Sequential: ops need {sum(g.num_extra_inputs for g in self._fusers())} extra input(s), "
                    f"got {len(extra_inputs)}"
                )
            out = group.call(x, training, extra_inputs[used : used + n]) if n else group.call(x, training)
            used += n
            if isinstance(out, tuple):
                x, extra_out = out[0], extra_out + list(out[1:])
            else:
                x = out
        if used < len(extra_inputs):
            raise ValueError(f"Sequential: {len(extra_inputs) - used} extra input(s) left unused")
        return (x, *extra_out) if extra_out else x

    def prepare(self, x: torch.Tensor, *extra_inputs: torch.Tensor, recipe=None, calibrating: bool = False,
                needs_backward: bool | None = None) -> None:
        """Build and publish every group's plan for an input like ``x`` under
        ``recipe`` (default: the recipe of the current ``te.autocast``, or high
        precision) without running any op: quantizers are created (continuing any
        delayed-scaling state), fusion passes run and the plans are validated, all
        of them before any is published, so a bad recipe is rejected here with no
        group changed, and the next call is a hot-path hit. Plain modules between
        groups are traced on the meta device for their shapes."""
        from ..autocast import current_state

        if recipe is None and current_state().enabled:
            recipe = current_state().recipe
        shape, dtype, device = x.shape, compute_dtype(x), x.device
        if needs_backward is None:
            needs_backward = torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())
            )
        candidates = []  # every group's plan is built and validated before any is published
        for group in self.groups():
            if isinstance(group, OperationFuser):
                plan = group.candidate(recipe, calibrating, shape, dtype, device, needs_backward, self.training,
                                       current_state().amax_reduction_group)
                candidates.append((group, plan))
                shape = plan.out_shape
            else:
                with torch.no_grad():
                    shape = group(torch.empty(shape, dtype=dtype, device="meta")).shape
        for group, plan in candidates:
            group.publish(plan)

    def _fusers(self) -> list[OperationFuser]:
        return [g for g in self.groups() if isinstance(g, OperationFuser)]

    # -- introspection ---------------------------------------------------------------
    def fusion_stats(self) -> FusionStats:
        total = FusionStats()
        for fuser in self._fusers():
            total.add(fuser.stats)
        return total

    def fusion_plan(self) -> PlanReport:
        """The published plan of every group: printable text that also carries the
        plans as data (``.groups``, ``.rules()``; see ``ops/report.py``)."""
        return plan_report(self.groups())
