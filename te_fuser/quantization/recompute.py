"""What a checkpointed region's forward cast with, so that its recomputation casts alike.

``te.checkpoint`` runs a region's forward once without keeping its activations
and again in the backward to rebuild them. The second run must give the first
run's bits and must leave every scaling state as the first run left it:

- stateless scalings (current, block, MXFP8, row-wise) derive their scales
  from the tensor itself, so the same input gives the same bits again;
- delayed scaling casts with the scale its history gave *before* the cast and
  then updates the history from the cast's amax. A second run would find the
  updated scale and record the amax twice. So while a region's forward runs,
  each delayed-scaling cast notes the scale (and its reciprocal) it used in the
  region's :class:`Frame` (and in the frames of the regions around it), in
  order; while the region is recomputed, each such cast takes the next noted
  scale of its quantizer and records nothing. A region nested in the one being
  recomputed runs its forward again there: its new frame notes the replayed
  scales, for its own recomputation later.

:data:`ACTIVE` holds the frame being recorded (``ACTIVE[0]``) and the one being
replayed (``ACTIVE[1]``), or None: one list read per delayed-scaling cast when
no checkpointed region runs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ACTIVE", "Frame", "RecomputeMismatch"]

ACTIVE: list = [None, None]  # [the frame a forward records into, the frame a recomputation replays]


class RecomputeMismatch(RuntimeError):
    """A recomputation cast with a delayed-scaling quantizer more often than the forward it replays."""


class Frame:
    """One checkpointed region's call: the te.autocast state and backend its forward
    ran under, and each delayed-scaling quantizer's scales in the order it cast."""

    __slots__ = ("state", "backend", "outer", "scales", "cursor", "__weakref__")

    def __init__(self, state: Any, backend: "str | None") -> None:
        self.state = state
        self.backend = backend
        self.outer: "Frame | None" = None  # the region this one runs inside (its casts are the outer's too)
        # id(quantizer) -> (quantizer, [(scale, scale_inv, seeded before the call), ...])
        self.scales: dict[int, tuple[Any, list]] = {}
        self.cursor: dict[int, int] = {}

    def note(self, quantizer: Any, scale: torch.Tensor, scale_inv: torch.Tensor, seeded: bool = True) -> None:
        """The forward cast with ``scale`` (the tensors are rebound by updates, never
        written); ``seeded``: whether the quantizer had a scale before this cast (a
        fresh one seeds it from the tensor, and casts as a call, never in an epilogue)."""
        frame = self
        while frame is not None:  # a nested region's casts are its enclosing regions' casts too
            entry = frame.scales.get(id(quantizer))
            if entry is None:
                entry = frame.scales[id(quantizer)] = (quantizer, [])
            entry[1].append((scale, scale_inv, seeded))
            frame = frame.outer

    def next_was_seeded(self, quantizer: Any) -> bool:
        """Whether the quantizer's next cast in the forward found a scale (see :meth:`note`)."""
        entry = self.scales.get(id(quantizer))
        i = self.cursor.get(id(quantizer), 0)
        return entry is None or i >= len(entry[1]) or entry[1][i][2]

    def rewind(self) -> None:
        """A recomputation starts: each quantizer's first noted scale comes first."""
        self.cursor.clear()

    def next_scale(self, quantizer: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The scale of ``quantizer``'s next cast in the forward being replayed, its
        reciprocal, and whether the quantizer had a scale then (see :meth:`note`)."""
        entry = self.scales.get(id(quantizer))
        i = self.cursor.get(id(quantizer), 0)
        if entry is None or i >= len(entry[1]):
            raise RecomputeMismatch(
                f"te.checkpoint: recomputing the region, {quantizer!r} casts with delayed scaling more often than "
                f"in the region's forward ({0 if entry is None else len(entry[1])} cast(s) there): the region must "
                f"run the same ops on the same tensors both times (a quantized-weight cache that the forward used "
                f"and the recomputation does not, or a recipe changed between the forward and the backward, "
                f"would do this)")
        self.cursor[id(quantizer)] = i + 1
        return entry[1][i]
