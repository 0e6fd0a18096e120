"""``quantize_tensorwise_column_sums``: the delayed-scaling cast of a gradient and its
bias gradient from one read.

The Triton kernel against the reference (data and amax bit for bit, and bit for
bit the plain ``quantize_tensorwise``; the sums against float64 within the fp32
tolerance), the delayed-scaling quantizer's fused path against its plain cast
(the same bytes, the same history), and bad inputs. Without a GPU these run
through Triton's interpreter; with one, the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.quantization import DelayedScalingQuantizer
from test_triton_cast import DEVICE, adversarial, with_specials
from tolerances import assert_bitwise, assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _scale(value: float = 0.37) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


def _check(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool, context: str) -> None:
    scale = _scale()
    q, qt, amax, sums = tk.quantize_tensorwise_column_sums(x, scale, fp8_dtype, rowwise, columnwise)
    q_ref, qt_ref, amax_ref, _ = ref.quantize_tensorwise_column_sums_reference(x, scale, fp8_dtype, rowwise, columnwise)
    q_plain, qt_plain, amax_plain = tk.quantize_tensorwise(x, scale, fp8_dtype, rowwise, columnwise)
    for name, got, want, plain in (("data", q, q_ref, q_plain), ("data_t", qt, qt_ref, qt_plain)):
        if want is None:
            assert got is None, f"{context}: {name} not asked for"
            continue
        assert_bitwise(got, want, f"{context} {name} vs reference")
        assert_bitwise(got, plain, f"{context} {name} vs quantize_tensorwise")
    if torch.isnan(amax_ref):
        assert torch.isnan(amax), f"{context}: amax {amax.item()} for a NaN input"
    else:
        assert_bitwise(amax, amax_ref, f"{context} amax")
        assert_bitwise(amax, amax_plain, f"{context} amax vs quantize_tensorwise")
    assert sums.shape == (x.shape[1],) and sums.dtype == torch.float32, context
    exact = x.double().sum(dim=0)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(sums)), f"{context}: sums not finite where float64's are"
    assert_close(sums[finite], exact[finite], "column_sums_fp32", f"{context} sums shape={tuple(x.shape)}", scaled=True)


@pytest.mark.parametrize("shape", [(67, 1408), (13, 200), (256, 96), (1, 33), (130, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_the_reference(shape, dtype):
    _check(adversarial(*shape, dtype=dtype).to(DEVICE), E5M2, True, True, f"{dtype} {shape}")


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("layouts", [(True, False), (False, True), (True, True), (False, False)])
def test_every_layout_and_format(fp8_dtype, layouts):
    _check(adversarial(70, 136, fp8_dtype).to(DEVICE), fp8_dtype, *layouts, f"{fp8_dtype} {layouts}")


def test_zeros_specials_strides_and_empty():
    _check(torch.zeros(40, 70, dtype=torch.bfloat16, device=DEVICE), E4M3, True, True, "all zero")
    x = adversarial(48, 64).to(DEVICE)
    for specials in ([float("nan")], [float("inf")], [float("-inf"), float("inf")]):
        _check(with_specials(x, specials), E5M2, True, True, f"specials {specials}")
    _check(adversarial(64, 48).to(DEVICE).t(), E4M3, True, True, "a transposed view")
    q, qt, amax, sums = tk.quantize_tensorwise_column_sums(torch.zeros(0, 5, device=DEVICE), _scale(), E4M3, True, True)
    assert amax.item() == 0.0 and torch.equal(sums, torch.zeros(5, device=DEVICE))
    assert q.shape == (0, 5) and qt.shape == (5, 0)


def test_amax_out_is_written_as_the_plain_cast_writes_it():
    x = adversarial(33, 80).to(DEVICE)
    slot = torch.full((1,), -1.0, device=DEVICE)
    _, _, amax, _ = tk.quantize_tensorwise_column_sums(x, _scale(), E4M3, True, False, amax_out=slot)
    assert amax is slot
    assert_bitwise(slot.reshape(()), ref.quantize_tensorwise_reference(x, _scale(), E4M3)[2], "amax_out")


def test_bad_inputs_are_named():
    for fn in (tk.quantize_tensorwise_column_sums, ref.quantize_tensorwise_column_sums_reference):
        with pytest.raises(ValueError, match="quantize_tensorwise_column_sums: x must be a 2-D tensor"):
            fn(torch.zeros(2, 3, 4, device=DEVICE), _scale(), E4M3)
    with pytest.raises(ValueError, match="quantize_tensorwise_column_sums: amax_out must be a one-element float32"):
        tk.quantize_tensorwise_column_sums(adversarial(8, 16).to(DEVICE), _scale(), E4M3,
                                           amax_out=torch.zeros(2, device=DEVICE))


@pytest.mark.parametrize("backend_name", ["triton", "reference"])
def test_the_delayed_quantizer_fused_is_its_plain_cast(backend_name):
    """Same bytes, same scale and the same amax history as ``quantizer(x)``, over
    several steps (the first seeds the scale); the sums as the kernel computes them."""
    import te_fuser as te

    fused = DelayedScalingQuantizer(E5M2, amax_history_len=4)
    plain = copy.deepcopy(fused)
    with te.autocast(enabled=False, backend=backend_name):
        for step in range(3):
            x = adversarial(64, 96, E5M2, seed=step).to(DEVICE)
            q_f, sums = fused.quantize_with_column_sums(x, rowwise=True, columnwise=True)
            q_p = plain(x, rowwise=True, columnwise=True)
            for which in ("rowwise", "columnwise"):
                a, b = getattr(q_f, which), getattr(q_p, which)
                assert_bitwise(a.data, b.data, f"step {step} {which} data")
                assert_bitwise(a.scale_inv, b.scale_inv, f"step {step} {which} scale_inv")
            for name in ("scale", "scale_inv", "amax_history"):
                assert_bitwise(getattr(fused, name), getattr(plain, name), f"step {step} {name}")
            exact = x.double().sum(dim=0)
            assert_close(sums, exact, "column_sums_fp32", f"step {step} sums", scaled=True)
