"""Quantizers built with TransformerEngine's constructor arguments: ``te.DType``
formats, ``rowwise=`` / ``columnwise=`` usage, ``device=``, ``block_scaling_dim``,
``Float8Quantizer(scale, amax, fp8_dtype)``, and ``QuantizerRole`` with every field
optional."""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser.quantization import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                                   MXFP8Quantizer, QuantizerRole)
from tolerances import assert_bitwise


def _x(seed=0, shape=(64, 128)):
    gen = torch.Generator().manual_seed(seed)
    return -2.3 + 0.5 * torch.randn(*shape, generator=gen)


def test_te_dtype_names_stand_for_torch_dtypes():
    q = Float8CurrentScalingQuantizer(fp8_dtype=te.DType.kFloat8E5M2, device="cpu")
    assert q.fp8_dtype is torch.float8_e5m2
    assert te.DType.kFloat8E4M3.value is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_dtype"):
        Float8CurrentScalingQuantizer(fp8_dtype=te.DType.kBFloat16)


@pytest.mark.parametrize("make", [
    lambda **k: Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, **k),
    lambda **k: MXFP8Quantizer(te.DType.kFloat8E4M3, **k),
    lambda **k: Float8BlockQuantizer(te.DType.kFloat8E4M3, block_scaling_dim=1, **k),
], ids=["current", "mxfp8", "block"])
def test_usage_flags_choose_the_copies_of_a_plain_call(make):
    x = _x(1)
    both = make(rowwise=True, columnwise=True)(x)
    assert both.rowwise is not None and both.columnwise is not None
    only_col = make(rowwise=False, columnwise=True)(x)
    assert only_col.rowwise is None and only_col.columnwise is not None
    q = make()
    assert q(x).columnwise is None  # te_fuser's default: the row-wise copy alone
    q.set_usage(columnwise=True)
    assert q(x).columnwise is not None
    assert q(x, columnwise=False).columnwise is None  # a named copy wins over the flag
    assert_bitwise(both.dequantize(), make()(x).dequantize(), "row-wise copy with and without the column-wise one")


def test_block_scaling_dim_is_block_dim():
    x = _x(2, (256, 256))
    te_names = Float8BlockQuantizer(te.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
    ours = Float8BlockQuantizer(torch.float8_e4m3fn, 2)
    assert te_names.block_dim == 2 and Float8BlockQuantizer(torch.float8_e4m3fn).block_dim == 2
    assert_bitwise(te_names(x).dequantize(), ours(x).dequantize(), "block_scaling_dim=2 vs block_dim=2")
    assert Float8BlockQuantizer(torch.float8_e4m3fn, force_pow_2_scales=False).power_2_scales is False
    with pytest.raises(ValueError, match="disagree"):
        Float8BlockQuantizer(torch.float8_e4m3fn, 1, block_scaling_dim=2)


def test_float8_quantizer_casts_with_the_given_scale_and_raises_amax():
    x = _x(3)
    scale = torch.tensor(4.0)
    amax = torch.zeros(1)
    q = Float8Quantizer(scale=scale, amax=amax, fp8_dtype=te.DType.kFloat8E4M3)
    y = q(x).dequantize()
    expected = (x * 4.0).clamp(-448, 448).to(torch.float8_e4m3fn).float() / 4.0
    assert_bitwise(y, expected, "Float8Quantizer scale 4")
    assert amax.item() == x.abs().max().item()
    q(x * 0.5)  # a smaller amax leaves the running maximum
    assert amax.item() == x.abs().max().item()
    scale.fill_(1.0)  # the caller's scale is read at each cast
    assert_bitwise(q(x).dequantize(), x.to(torch.float8_e4m3fn).float(), "Float8Quantizer scale 1")
    with pytest.raises(ValueError, match="scale"):
        Float8Quantizer(scale=torch.ones(2), amax=amax, fp8_dtype=torch.float8_e4m3fn)


def test_delayed_scaling_state_starts_on_the_given_device():
    q = te.quantization.DelayedScalingQuantizer(torch.float8_e4m3fn, device="meta")
    assert q.scale.device.type == "meta" and q.amax_history.device.type == "meta"


def test_quantizer_role_fields_are_optional():
    role = QuantizerRole(tensor_type="weight")
    assert (role.module_type, role.tensor_type, role.name) == ("", "weight", "")
    assert QuantizerRole() == QuantizerRole("", "", "")
    with pytest.raises(ValueError, match="module_type"):
        QuantizerRole.make("", "weight")
