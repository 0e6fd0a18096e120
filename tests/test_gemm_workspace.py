"""The cuBLASLt GEMM's workspace limit (``kernels.cuda.gemm.set_workspace_limit``):
the most workspace the algorithm of a GEMM planned from then on may ask for; with a
limit of 0 the heuristic picks among algorithms that ask none."""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels import cuda
from te_fuser.kernels.cuda.gemm import WORKSPACE_BYTES, set_workspace_limit
from te_fuser.kernels.operand import ScaledOperand

REASON = cuda.unavailable_reason()
needs_cuda = pytest.mark.skipif(REASON is not None, reason=f"cuda backend unavailable: {REASON}")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# the yardstick GPT's FP8 GEMMs (M, N, K, a's format): fprop of qkv, proj, fc1, fc2, a dgrad and a wgrad
GPT_GEMMS = [(16384, 3072, 1024, E4M3), (16384, 1024, 1024, E4M3), (16384, 4096, 1024, E4M3),
             (16384, 1024, 4096, E4M3), (16384, 1024, 3072, E5M2), (1024, 4096, 16384, E5M2)]


@pytest.mark.parametrize("bad", [-1, WORKSPACE_BYTES + 1, 1.0, True, "0", None])
def test_a_limit_outside_the_workspace_is_refused_before_anything_changes(bad):
    """A limit that is not an int in [0, WORKSPACE_BYTES] is a ValueError naming the
    argument and the range, raised before the extension is asked (on any machine)."""
    with pytest.raises(ValueError, match=r"set_workspace_limit: nbytes must be an int in \[0, 33554432\]"):
        set_workspace_limit(bad)


def _exact(rows: int, k: int, fp8: torch.dtype, seed: int) -> ScaledOperand:
    """Integers in [-2, 2] scaled by a power of two: every product and partial sum of
    K up to 16384 is exact in fp32, whatever order an algorithm sums in."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-2, 3, (rows, k), generator=g).float().to(fp8)
    return ScaledOperand(data.cuda(), torch.tensor(0.5).cuda(), "tensor")


@needs_cuda
@pytest.mark.parametrize("m, n, k, fp8", GPT_GEMMS, ids=lambda v: str(v) if not isinstance(v, torch.dtype) else "")
def test_gemms_planned_without_workspace_ask_none_and_stay_exact(m, n, k, fp8):
    """Under a limit of 0 the GPT's GEMMs take algorithms that ask for no workspace
    and still give the exact product, as they
    do again under the limit before, which the call gives back."""
    from te_fuser.kernels.cuda._build import extension

    a, b = _exact(m, k, fp8, seed=m + k), _exact(n, k, E4M3, seed=n)
    want = (a.data.double() @ b.data.double().t()) * 0.25
    before = set_workspace_limit(0)
    try:
        assert before == WORKSPACE_BYTES
        _, workspace = extension().fp8_gemm_tensorwise_candidate(
            a.data, b.data, a.scale_inv.float().clone(), b.scale_inv.float().clone(), torch.float32, False, 0,
            torch.cuda.current_stream().cuda_stream)
        assert workspace == 0, f"the first algorithm under a limit of 0 asks {workspace} bytes"
        got = cuda.gemm(a, b, torch.float32)
        assert torch.equal(got.double(), want), f"M={m} N={n} K={k}, no workspace: not the exact product"
    finally:
        assert set_workspace_limit(before) == 0
    again = cuda.gemm(a, b, torch.float32)
    assert torch.equal(again.double(), want), f"M={m} N={n} K={k}: not the exact product"
