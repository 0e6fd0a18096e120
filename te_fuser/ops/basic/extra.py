"""Residual branches: AddExtraInput adds a second input; MakeExtraOutput emits a copy.

Extra-tensor channels (TransformerEngine's ``set_extra_input_channel`` /
``set_extra_output_channel``). Without a channel, an extra input is an argument
of the call (``seq(x, residual)``) and an extra output is returned with ``y``.
With one, the tensor stays inside the fuser: an op's extra output published on
channel ``"res"`` is the extra input of every later op of the same group that
reads ``"res"``, so a pre-norm transformer layer is one ``Sequential``::

    te.ops.Sequential(
        te.ops.MakeExtraOutput(channel="res"), te.ops.RMSNorm(d), te.ops.Linear(d, 3 * d),
        te.ops.DotProductAttention(h, d // h), te.ops.Linear(d, d), te.ops.AddExtraInput(channel="res"),
        te.ops.MakeExtraOutput(channel="res2"), te.ops.RMSNorm(d), te.ops.Linear(d, f), te.ops.GELU(),
        te.ops.Linear(f, d), te.ops.AddExtraInput(channel="res2"),
    )  # called as layer(x)

The rules (checked by :func:`resolve_channels` when a fuser is made, raised when
its plan is built, before anything changes):

- a read takes the latest earlier write of its name in the same group; a read
  with none is an error;
- a name may be written again once read (two layers in one ``Sequential`` may
  both use ``"res"``); a write that is overwritten, or that ends the group,
  unread and not returned to the caller, is an error (the tensor would be lost);
- a channel is scoped to one group (one ``OperationFuser``): a plain
  ``nn.Module`` in a ``Sequential`` splits its ops into groups, and a channel
  across it is an error naming the module (``Sequential.groups``);
- the tensor read must have the reader's input shape (checked with every
  input shape the plan validates).

TransformerEngine's rules, except the re-write after a read (TE allows one
producer per name) and the unread internal write (TE drops it silently). Its
methods, ``set_extra_input_channel(index, channel)`` and
``set_extra_output_channel(index, channel, output_to_caller=True)``, are here
with its defaults; the constructors' ``channel=`` is a shorthand whose output
stays internal (``output_to_caller=False``), as a residual inside a layer does.
As in TE, a fuser captures the bindings when it is made and locks them: later
calls of the setters raise.

In the backward, the gradient of a channel's readers (summed when several read
it) is the gradient of the writer's extra output, added to the main path's
gradient where they meet (in ``MakeExtraOutput``'s backward, or a fused op's
such as ``backward_add_rmsnorm``).

``in_place=True`` (TransformerEngine's): ``AddExtraInput`` adds the main input into
the extra input's own buffer and returns that buffer (``y`` shares the caller's
extra tensor's storage; the sum has the extra tensor's dtype); ``MakeExtraOutput``
adds the main path's gradient into the gradient of its extra output in place in
the backward. Autograd stays correct: the in-place add goes through a detached
alias that shares the tensor's version counter, so a backward that saved the
overwritten tensor raises instead of reading the sum. Both stay out of place on
a channel: the tensor a channel carries is its writer's input, which earlier ops
of the group may keep for their backward (our saved state has no version
counter), and its gradient is the readers' own incoming gradient. Fusion rules see channel ops as they see
public ones, and fire across them; a rule whose window would hold both the writer
and a reader of one channel is declined (``rules.match``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..op import BasicOperation

__all__ = ["AddExtraInput", "MakeExtraOutput", "ChannelRoutes", "resolve_channels"]


def _check_channel(owner: str, channel) -> None:
    if channel is not None and (not isinstance(channel, str) or not channel):
        raise ValueError(f"{owner}: a channel must be a non-empty string or None, got {channel!r}")


def _check_in_place(owner: str, in_place) -> None:
    if not isinstance(in_place, bool):
        raise TypeError(f"{owner}(in_place=...): must be True or False, got {in_place!r}")


class _Channels:
    """The channel bindings of an op's extra inputs and outputs (a mixin of the ops here)."""

    def _init_channels(self, in_channel: "str | None" = None, out_channel: "str | None" = None,
                       output_to_caller: "bool | None" = None) -> None:
        self.extra_input_channels = [None] * self.num_extra_inputs
        self.extra_output_channels = [None] * self.num_extra_outputs
        self.extra_output_to_caller = [True] * self.num_extra_outputs
        self.channels_locked = False
        if in_channel is not None:
            self.set_extra_input_channel(0, in_channel)
        if out_channel is not None:
            self.set_extra_output_channel(0, out_channel, output_to_caller=bool(output_to_caller))
        elif output_to_caller is not None:
            raise ValueError(f"{type(self).__name__}(output_to_caller=...): only with a channel")

    def _unlocked(self, what: str, index: int, count: int) -> None:
        owner = self.describe()
        if not (isinstance(index, int) and 0 <= index < count):
            raise IndexError(f"{owner}.{what}: index {index!r} out of range for {count} slot(s)")
        if self.channels_locked:
            raise RuntimeError(
                f"{owner}.{what}: a fuser (a Sequential, or the op's own call) has captured this op's channel "
                "bindings; bind channels before the op joins one, or build new ops")

    def set_extra_input_channel(self, index: int, channel: "str | None"):
        """Read extra input ``index`` from ``channel`` (written by an earlier op of the
        same group) instead of the call's arguments; ``None`` makes it public again."""
        _check_channel(f"{self.describe()}.set_extra_input_channel", channel)
        self._unlocked("set_extra_input_channel", index, self.num_extra_inputs)
        self.extra_input_channels[index] = channel
        return self

    def set_extra_output_channel(self, index: int, channel: "str | None", *, output_to_caller: bool = True):
        """Publish extra output ``index`` on ``channel`` for later ops of the same group;
        ``output_to_caller`` also returns it from the call (TE's default); ``None``
        unbinds it (public again)."""
        owner = f"{self.describe()}.set_extra_output_channel"
        _check_channel(owner, channel)
        if not isinstance(output_to_caller, bool):
            raise TypeError(f"{owner}: output_to_caller must be True or False, got {output_to_caller!r}")
        self._unlocked("set_extra_output_channel", index, self.num_extra_outputs)
        self.extra_output_channels[index] = channel
        self.extra_output_to_caller[index] = output_to_caller or channel is None
        return self

    def describe(self) -> str:
        base = super().describe()
        ins = [f"<-{c!r}" for c in self.extra_input_channels if c is not None]
        outs = [f"->{c!r}" for c in self.extra_output_channels if c is not None]
        return f"{base}[{' '.join(ins + outs)}]" if ins or outs else base


class AddExtraInput(_Channels, BasicOperation):
    """``y = x + extra`` where ``extra`` is passed to the Sequential call after ``x``,
    or, with ``channel``, read from that channel (see the module doc).

    The sum has torch's promoted dtype: under ``torch.autocast`` a residual stream
    kept in fp32 stays fp32 (``bf16 x + fp32 extra`` is fp32), as in plain torch."""

    module_type = "add"
    num_extra_inputs = 1

    def __init__(self, name: "str | None" = None, *, channel: "str | None" = None, in_place: bool = False) -> None:
        super().__init__(name)
        _check_in_place(type(self).__name__, in_place)
        self.in_place = in_place
        self._init_channels(in_channel=channel)

    @property
    def adds_in_place(self) -> bool:
        """Whether the sum goes into the extra input's buffer (``in_place``, off a channel)."""
        return self.in_place and self.extra_input_channels[0] is None

    def check_shapes(self, in_shape, quantizers):
        return in_shape

    def output_dtype(self, in_dtype, compute_dtype, extra_dtypes):
        return extra_dtypes[0] if self.adds_in_place else torch.promote_types(in_dtype, extra_dtypes[0])

    def place(self, y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """``y`` (the sum, computed by a fused op) as this op's output: written into
        ``extra``'s buffer when the op adds in place, else ``y`` itself."""
        if not self.adds_in_place:
            return y
        out = extra.detach()
        out.copy_(y.reshape(out.shape))
        return out

    def op_forward(self, ctx, x, extra_inputs):
        (extra,) = extra_inputs
        if extra.shape != x.shape:
            raise ValueError(f"{self.describe()}: extra input shape {tuple(extra.shape)} != input shape {tuple(x.shape)}")
        if self.adds_in_place:
            out = extra.detach()  # shares extra's version counter: a backward that saved extra raises
            out += x
            return out, []
        return x + extra, []

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy, [], [dy]


class MakeExtraOutput(_Channels, BasicOperation):
    """``y = x`` and ``x`` is also returned by the Sequential call (a residual branch),
    or, with ``channel``, published on that channel for later ops of the group
    (returned too only with ``output_to_caller=True``; see the module doc)."""

    module_type = "branch"
    accepts_fp8_input = True  # hands the tensor on as it is, FP8 too
    num_extra_outputs = 1

    def __init__(self, name: "str | None" = None, *, channel: "str | None" = None,
                 output_to_caller: "bool | None" = None, in_place: bool = False) -> None:
        super().__init__(name)
        _check_in_place(type(self).__name__, in_place)
        self.in_place = in_place
        self._init_channels(out_channel=channel, output_to_caller=output_to_caller)

    @property
    def adds_in_place(self) -> bool:
        """Whether the backward adds into the extra output's gradient (``in_place``, off a channel)."""
        return self.in_place and self.extra_output_channels[0] is None

    def output_dtype(self, in_dtype, compute_dtype, extra_dtypes):
        return in_dtype

    def op_forward(self, ctx, x, extra_inputs):
        return x, [x]

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (dextra,) = grad_extra_outputs
        if dextra is None or dy is None:  # no gradient from the branch, or none asked of the main path
            return (dextra if dy is None else dy), [], []
        if self.adds_in_place and dextra is not dy and dextra.shape == dy.shape:
            return dextra.add_(dy), [], []
        return dy + dextra, [], []


@dataclass(frozen=True)
class ChannelRoutes:
    """A group's routing of extra tensors, from its ops' channel bindings.

    Slots are ``(op index, slot index)``. ``sources[i][k]``: the output slot that
    op ``i``'s extra input ``k`` reads, or None (a public input);
    ``reads[i]``: op ``i``'s ``(k, writer op, writer slot)`` triples; ``public_inputs``
    / ``public_outputs``: the call's extra inputs and returned extra outputs, in
    op and slot order; ``links``: ``(writer op, reader op, channel)``; ``problem``:
    the first unresolved binding (raised when a plan is built), else None;
    ``unread`` / ``unwritten``: ``(op index, channel)`` of the writes nobody reads
    and the reads nobody writes (a Sequential explains those across a plain module)."""

    sources: tuple
    reads: tuple
    public_inputs: tuple
    public_outputs: tuple
    links: tuple
    problem: "str | None"
    unread: tuple
    unwritten: tuple

    def place_inputs(self, n_extra_in, extra_inputs) -> list[list]:
        """Per op, its extra inputs: the call's public ones placed, channel slots None."""
        out = [[None] * n for n in n_extra_in]
        for (i, k), t in zip(self.public_inputs, extra_inputs):
            out[i][k] = t
        return out

    def place_output_grads(self, n_extra_out, grads) -> list[list]:
        """Per op, the gradients of its extra outputs: the caller's for public ones, else None."""
        out = [[None] * n for n in n_extra_out]
        for (i, o), g in zip(self.public_outputs, grads):
            out[i][o] = g
        return out

    def check_shapes(self, ops, in_shapes) -> None:
        """Each channel read against the shape written (an extra output has its op's
        input shape); ``in_shapes[i]`` is op ``i``'s input shape."""
        for p, c, channel in self.links:
            if in_shapes[p] != in_shapes[c]:
                raise ValueError(
                    f"channel {channel!r}: {ops[p].describe()} (op {p}) writes a tensor of shape "
                    f"{tuple(in_shapes[p])}, and {ops[c].describe()} (op {c}) reads it for an input of shape "
                    f"{tuple(in_shapes[c])}")


def resolve_channels(ops) -> "ChannelRoutes | None":
    """The routing of ``ops`` (one group), or None when no op binds a channel (every
    extra tensor public, in order). Locks the ops' bindings (a fuser captured them)."""
    bound = [op for op in ops if isinstance(op, _Channels)]
    for op in bound:
        op.channels_locked = True
    if not any(c is not None for op in bound for c in (*op.extra_input_channels, *op.extra_output_channels)):
        return None
    live: dict = {}  # channel -> [writer op, writer slot, read?, returned?]
    sources, reads, public_in, public_out, links, problems, unwritten = [], [], [], [], [], [], []
    for i, op in enumerate(ops):
        ins = getattr(op, "extra_input_channels", (None,) * op.num_extra_inputs)
        outs = getattr(op, "extra_output_channels", (None,) * op.num_extra_outputs)
        to_caller = getattr(op, "extra_output_to_caller", (True,) * op.num_extra_outputs)
        srcs, mine = [], []
        for k, channel in enumerate(ins):
            if channel is None:
                srcs.append(None)
                public_in.append((i, k))
                continue
            entry = live.get(channel)
            if entry is None:
                problems.append(f"channel {channel!r}: {op.describe()} (op {i}) reads it, and no earlier op of its "
                                "group writes it")
                unwritten.append((i, channel))
                srcs.append(None)
                continue
            entry[2] = True
            srcs.append((entry[0], entry[1]))
            mine.append((k, entry[0], entry[1]))
            links.append((entry[0], i, channel))
        for o, channel in enumerate(outs):
            if to_caller[o]:
                public_out.append((i, o))
            if channel is None:
                continue
            old = live.get(channel)
            if old is not None and not (old[2] or old[3]):
                problems.append(f"channel {channel!r}: {ops[old[0]].describe()} (op {old[0]}) writes it and "
                                f"{op.describe()} (op {i}) writes it again before any op reads it")
            live[channel] = [i, o, False, to_caller[o]]
        sources.append(tuple(srcs))
        reads.append(tuple(mine))
    unread = tuple((w, ch) for ch, (w, _, read, returned) in live.items() if not (read or returned))
    problems += [f"channel {ch!r}: {ops[w].describe()} (op {w}) writes it, and no later op of its group reads it "
                 "(nor is it returned: output_to_caller=False)" for w, ch in unread]
    return ChannelRoutes(tuple(sources), tuple(reads), tuple(public_in), tuple(public_out), tuple(links),
                         problems[0] if problems else None, unread, tuple(unwritten))
