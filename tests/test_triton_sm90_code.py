"""The tile kernels' memory instructions on Hopper, read from their sm_90 code on
any machine (``scripts/triton_sm90.py``: each launch's specialization compiled
ahead of time through Triton's own ptxas, in a process without the interpreter).

A tile kernel whose index arithmetic hides contiguity from the compiler still
computes the right bits, so no numeric test sees it; it loads and stores element by
element and runs several times slower on the GPU. Here every global access of the
GPT's launches must move at least 4 bytes a thread, and only the per-tensor and
per-row scales may be read by scalar loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "triton_sm90.py"
NARROW = re.compile(r"\.(b8|b16|u8|u16|s8|s16)$")
SCALAR_LOAD = re.compile(r"^ld\.global(\.\w+)*\.b32$")
SCALAR_LOADS_ALLOWED = {"dequantize per tensor": 1, "dequantize per row": 2}
CHECK = "dequantize per tensor, looked up"  # what the per-tensor path replaced: a load per element


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, env=env,
                         timeout=600)
    if run.returncode != 0 and "triton_sm90: " in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])  # no sm_90 compile with this Triton
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-2])  # {case: {instruction: count}}


def _scalar_loads(ops: dict) -> int:
    return sum(n for op, n in ops.items() if SCALAR_LOAD.match(op) and ".v" not in op)


def test_every_access_is_a_vector_but_the_scales(compiled):
    for case, ops in compiled.items():
        if case == CHECK:
            continue
        assert ops, f"{case}: no global memory instructions found in the PTX"
        narrow = {op: n for op, n in ops.items() if NARROW.search(op)}
        assert not narrow, f"{case}: element-by-element accesses {narrow}"
        assert _scalar_loads(ops) <= SCALAR_LOADS_ALLOWED.get(case, 0), f"{case}: scalar loads in {ops}"


def test_the_check_sees_a_scale_looked_up_element_by_element(compiled):
    """The lookup through zero strides costs a scalar load per element of a thread's
    tile: what the test above refuses."""
    assert _scalar_loads(compiled[CHECK]) > 8 * SCALAR_LOADS_ALLOWED["dequantize per tensor"], compiled[CHECK]
