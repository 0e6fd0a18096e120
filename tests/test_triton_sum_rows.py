"""The Triton kernels' reduction of their partial sums (``_common.sum_rows``):
each column's rows added in order, against float64, for the shapes the launchers
hand it (one matrix, or a batch of two as LayerNorm's backward), and the same
bits on a second run."""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels.triton._common import sum_rows
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 7), (5, 40), (33, 1030), (2, 9, 65), (2, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sum_rows_matches_float64_and_repeats_its_bits(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    partial = (torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, shape, generator=gen)).to(dtype)
    partial = partial.to(DEVICE)
    got = sum_rows(partial)
    assert got.shape == (*shape[:-2], shape[-1]) and got.dtype == dtype
    key = "column_sums_fp32" if dtype == torch.float32 else "column_sums_fp64"
    assert_close(got, partial.double().sum(dim=-2), key, f"sum_rows {shape} {dtype}", scaled=True)
    assert torch.equal(got, sum_rows(partial))


def test_sum_rows_of_no_rows_is_zero_and_of_no_columns_is_empty():
    assert torch.equal(sum_rows(torch.empty(0, 5, device=DEVICE)), torch.zeros(5, device=DEVICE))
    assert sum_rows(torch.empty(3, 0, device=DEVICE)).shape == (0,)
