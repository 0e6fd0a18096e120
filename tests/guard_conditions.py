"""The conditions that select a fuser's plan, as one table.

Each row is a change between two calls of a model, and what the call after it
does (``expected``) and the call after that, under the same change (``then``):

- ``HIT``: the armed guard runs the published plan (no Python frame);
- ``REVALIDATE``: the guard misses; the miss path (``OperationFuser.run``) finds
  that the published plan still applies, runs it, and arms the guard again;
- ``REBUILD``: the guard misses; the miss path builds and publishes a new plan.

The first call of every row is made under ``te.autocast(recipe=CURRENT)``, with
grad mode on, the model training and its parameters requiring grad, on a
float32 input of ``ROWS_IN x H`` that does not require grad (see
:func:`first_call`). A row's ``change(model, x)`` is a context manager entered
around the calls it describes; it yields their input. ``gap``, when set, says why
the guards do not decide as the row expects (a known limit, tested as such).

``tests/test_hot_guard.py`` runs every row through the compiled guard, the
Python reference guard (``te_fuser/ops/guard.py``) and the miss path alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch.nn.modules import module as module_hooks

import te_fuser as te
from te_fuser import epoch

HIT, REVALIDATE, REBUILD = "hit", "re-validate", "rebuild"

H = 32
ROWS_IN = 6
CURRENT = te.recipe.Float8CurrentScaling()
DELAYED = te.recipe.DelayedScaling(amax_history_len=4)


def model(device="cpu", seed: int = 0) -> te.ops.Sequential:
    """One group of four ops: RMSNorm, Linear (+ bias), GELU, Linear (+ bias)."""
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.RMSNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H)).to(device)


def first_input(device="cpu") -> torch.Tensor:
    return torch.randn(ROWS_IN, H, generator=torch.Generator().manual_seed(1)).to(device)


def first_call(m: te.ops.Sequential, x: torch.Tensor):
    """The call every row changes something after (made twice: the plan built, the guard armed)."""
    with te.autocast(recipe=CURRENT):
        return m(x)


@dataclass(frozen=True)
class Row:
    name: str
    change: Callable[[te.ops.Sequential, torch.Tensor], ContextManager[torch.Tensor]]
    expected: str
    then: str = HIT
    gap: str | None = None


def under(*contexts: Callable[[], ContextManager], make_input: Callable = lambda x: x):
    """The change of entering ``contexts`` (each made when the change is entered), on ``make_input(x)``."""
    @contextlib.contextmanager
    def change(m, x):
        with contextlib.ExitStack() as stack:
            for make in contexts:
                stack.enter_context(make())
            yield make_input(x)
    return change


def current():
    return te.autocast(recipe=CURRENT)


def on_model(edit: Callable[[te.ops.Sequential], Callable[[], None] | None], *contexts, make_input=lambda x: x):
    """The change of ``edit(model)`` (which may return how to undo it, on exit) under ``contexts``."""
    @contextlib.contextmanager
    def change(m, x):
        undo = edit(m)
        try:
            with under(*contexts, make_input=make_input)(m, x) as x2:
                yield x2
        finally:
            if undo is not None:
                undo()
    return change


def _requiring_grad(x):
    return x.clone().requires_grad_(True)


def _freeze(params):
    for p in params:
        p.requires_grad_(False)
    return lambda: [p.requires_grad_(True) for p in params]


def _replace_weight(m):
    """The second linear's weight replaced by an equal new Parameter, through nn.Module's setattr."""
    m[3].linear.weight = torch.nn.Parameter(m[3].linear.weight.detach().clone())


def _write_weight_into_dict(bump: bool):
    def edit(m):
        op = m[3].linear
        op._parameters["weight"] = torch.nn.Parameter(op.weight.detach() * 0.5)
        if bump:
            epoch.bump()
    return edit


def _hook(register):
    def edit(m):
        return register(m).remove
    return edit


def _hook_added_and_removed(m):
    m[2].register_forward_hook(lambda module, args, out: out).remove()


def _scaled_in_place(m):
    with torch.no_grad():
        m[1].linear.weight.mul_(0.5)


def _data_replaced(m):
    m[1].linear.weight.data = m[1].linear.weight.data * 0.5


def _eval(m):
    m.eval()
    return m.train


def _train(m):
    m.train()


def _to_own_device(m):
    m.to(m[1].linear.weight.device)


def _zero_grad(m):
    m.zero_grad()


def _torch_autocast(**kwargs):
    """The change of torch.autocast (on the input's device) around te.autocast(recipe=CURRENT)."""
    @contextlib.contextmanager
    def change(m, x):
        with torch.autocast(x.device.type, **kwargs), current():
            yield x
    return change


def _other_backend():
    """Sets another kernel backend for the process, and sets the old one back on exit."""
    @contextlib.contextmanager
    def context():
        before = te.get_backend()
        te.set_backend("reference" if before != "reference" else "auto")
        try:
            yield
        finally:
            te.set_backend(before)
    return context()


def _same_backend():
    te.set_backend(te.get_backend())
    return contextlib.nullcontext()


def _shared_op_run_under(recipe):
    def edit(m):
        with te.autocast(recipe=recipe):
            te.ops.Sequential(m[1])(torch.randn(2, H, device=m[1].linear.weight.device))
    return edit


def _applied(recipe):
    def edit(m):
        te.apply_recipe(m, recipe)
    return edit


def _equal_recipe_in_a_new_state():
    te.autocast(recipe=DELAYED)  # another state is made (not entered): an equal recipe next gets a new one
    return te.autocast(recipe=te.recipe.Float8CurrentScaling())


ROWS = (
    # te.autocast's state
    Row("the same recipe object", under(current), HIT),
    Row("a new recipe object, equal (te.autocast reuses its state)",
        under(lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling())), HIT),
    Row("an equal recipe in a new te.autocast state", under(_equal_recipe_in_a_new_state), REVALIDATE),
    Row("an unequal recipe (delayed scaling)", under(lambda: te.autocast(recipe=DELAYED)), REBUILD),
    Row("a recipe that differs in one field",
        under(lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling(power_2_scales=True))), REBUILD),
    Row("te.autocast() with no recipe (the default one)", under(te.autocast), REBUILD),
    Row("te.autocast(enabled=False)", under(lambda: te.autocast(enabled=False)), REBUILD),
    Row("calibrating", under(lambda: te.autocast(enabled=False, calibrating=True, recipe=DELAYED)), REBUILD),
    Row("no te.autocast", under(), REBUILD),
    Row("another amax reduction group", under(lambda: te.autocast(recipe=CURRENT, amax_reduction_group=object())),
        REBUILD),
    Row("te.apply_recipe of the region's recipe", on_model(_applied(CURRENT), current), REVALIDATE),
    Row("te.apply_recipe of another recipe, in a region naming one", on_model(_applied(DELAYED), current), REBUILD),
    # grad mode and requires_grad
    Row("torch.no_grad", under(torch.no_grad, current), REBUILD),
    Row("torch.inference_mode", under(torch.inference_mode, current), REBUILD),
    Row("torch.enable_grad (already on)", under(torch.enable_grad, current), HIT),
    Row("the input requires grad", under(current, make_input=_requiring_grad), HIT),
    Row("torch.no_grad, the input requires grad",
        under(torch.no_grad, current, make_input=_requiring_grad), REBUILD),
    Row("every parameter frozen", on_model(lambda m: _freeze(list(m.parameters())), current), REBUILD),
    Row("every parameter frozen, the input requires grad",
        on_model(lambda m: _freeze(list(m.parameters())), current, make_input=_requiring_grad), HIT),
    Row("one parameter frozen", on_model(lambda m: _freeze([m[1].linear.weight]), current), HIT),
    # the compute dtype
    Row("torch.autocast to bf16", _torch_autocast(dtype=torch.bfloat16), REBUILD),
    Row("torch.autocast(enabled=False)", _torch_autocast(enabled=False), HIT),
    Row("a bf16 input", under(current, make_input=lambda x: x.bfloat16()), REBUILD),
    # training
    Row("eval()", on_model(_eval, current), REBUILD),
    Row("train() (already training)", on_model(_train, current), HIT),
    # parameters
    Row("a replaced Parameter (nn.Module's setattr)", on_model(_replace_weight, current), REVALIDATE),
    Row("a Parameter written into _parameters, then te_fuser.epoch.bump()",
        on_model(_write_weight_into_dict(bump=True), current), REVALIDATE),
    Row("a Parameter written into _parameters, without a bump", on_model(_write_weight_into_dict(bump=False), current),
        REVALIDATE),  # the ops' parameter dicts bump the counter themselves (op.py, _WatchedParameters)
    Row("a weight updated in place (an optimizer step)", on_model(_scaled_in_place, current), HIT),
    Row("a weight's .data replaced", on_model(_data_replaced, current), HIT),
    Row("model.to() its own device", on_model(_to_own_device, current), REVALIDATE),
    Row("zero_grad", on_model(_zero_grad, current), HIT),
    # hooks
    Row("a forward hook on an op", on_model(_hook(lambda m: m[2].register_forward_hook(
        lambda module, args, out: out * 1.0)), current), REVALIDATE, then=REVALIDATE),
    Row("a forward pre-hook on an op", on_model(_hook(lambda m: m[0].register_forward_pre_hook(
        lambda module, args: None)), current), REVALIDATE, then=REVALIDATE),
    Row("a hook registered and removed again", on_model(_hook_added_and_removed, current), REVALIDATE),
    Row("a forward hook on the Sequential", on_model(_hook(lambda m: m.register_forward_hook(
        lambda module, args, out: out * 1.0)), current), HIT),
    Row("a global forward hook", on_model(_hook(lambda m: module_hooks.register_module_forward_hook(
        lambda module, args, out: None)), current), REVALIDATE, then=REVALIDATE),
    Row("a global forward pre-hook", on_model(_hook(lambda m: module_hooks.register_module_forward_pre_hook(
        lambda module, args: None)), current), REVALIDATE, then=REVALIDATE),
    # the kernel backend
    Row("te.set_backend to another backend", under(_other_backend, current), REBUILD),
    Row("te.set_backend to the backend in force", under(_same_backend, current), REVALIDATE),
    Row("te.autocast(backend=...) of another backend",
        under(lambda: te.autocast(recipe=CURRENT, backend="reference" if te.get_backend() != "reference" else "auto")),
        REBUILD),
    # other models sharing an op
    Row("another model ran a shared op under another recipe", on_model(_shared_op_run_under(DELAYED), current),
        REBUILD),
    Row("another model ran a shared op under the same recipe", on_model(_shared_op_run_under(CURRENT), current),
        HIT),
    # the input
    Row("fewer rows", under(current, make_input=lambda x: x[:3]), REVALIDATE),
    Row("the rows as a 3-D input", under(current, make_input=lambda x: x.view(2, ROWS_IN // 2, H)), REVALIDATE),
    Row("the same shape, another tensor", under(current, make_input=lambda x: x + 1.0), HIT),
)
