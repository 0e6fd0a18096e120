"""CUDA-graph replay of training steps: one capture core (``core.py``), two front ends.

- :func:`make_graphed` (``sequential.py``): a ``Sequential``'s forward and backward
  replayed from a pair of graphs per shape and recipe, called like the model;
- :func:`make_graphed_step` (``step.py``): a whole training step (forward,
  backward, optimizer) replayed from one graph.

Both hold the scaling state at fixed addresses (``core.StateSlot``), check at
every replay that what a capture read still holds (``core.CaptureGuard``) and
capture again when it does not; see each module's documentation.
"""

from .core import GraphStats
from .sequential import GraphedSequential, make_graphed
from .step import GraphedStep, make_graphed_step

__all__ = ["make_graphed", "GraphedSequential", "make_graphed_step", "GraphedStep", "GraphStats"]
