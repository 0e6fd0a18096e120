"""The rotary kernel: the reference against a float64 rotation, the Triton kernel
bit for bit against the reference (the same fp32 roundings: no fused multiply-add;
a zero result may carry either sign, so zeros are compared as zeros), forward and
inverse, the value heads copied, odd lengths, the argument checks."""

from __future__ import annotations

import math
import re

import pytest
import torch

from te_fuser.kernels.reference import rotary_reference
from te_fuser.kernels.triton import rotary as triton_rotary
from tolerances import assert_bitwise as _assert_bitwise
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_bitwise(got, want, context):
    """Bit for bit, -0 and +0 counted equal (adding +0 makes every zero +0, nothing else moves)."""
    _assert_bitwise(got + 0.0, want + 0.0, context)


def tables(T: int, D: int, offset: int = 0, base: float = 10000.0):
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(offset, offset + T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def inputs(B, T, heads, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(B, T, heads, D, generator=g)  # off-centre
    x[:, 0, 0] = 0.0
    x[:, -1, -1, : D // 2] = 3e4  # large values in one head's first half
    return x.to(dtype).to(DEVICE)


def rotation_f64(x, cos, sin, rotated_heads, inverse):
    """The rotation by the pair angle, written out on the two halves in float64."""
    x = x.double().cpu()
    c, s = cos.double().cpu()[:, None, : x.shape[-1] // 2], sin.double().cpu()[:, None, : x.shape[-1] // 2]
    s = -s if inverse else s
    half = x.shape[-1] // 2
    x1, x2 = x[:, :, :rotated_heads, :half], x[:, :, :rotated_heads, half:]
    y = x.clone()
    y[:, :, :rotated_heads, :half] = x1 * c - x2 * s
    y[:, :, :rotated_heads, half:] = x2 * c + x1 * s
    return y


@pytest.mark.parametrize("B,T,heads,rotated,D", [(1, 67, 5, 3, 64), (2, 9, 6, 4, 16), (1, 33, 3, 3, 128),
                                                  (2, 5, 4, 0, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_reference_is_the_rotation(B, T, heads, rotated, D, inverse):
    x = inputs(B, T, heads, D, torch.float64)
    cos, sin = tables(T, D, offset=7)
    got = rotary_reference(x, cos, sin, rotated, inverse, torch.float64).cpu()
    assert_close(got, rotation_f64(x, cos, sin, rotated, inverse), torch.float32, f"reference {B, T, heads, D}")


@pytest.mark.parametrize("B,T,heads,rotated,D", [(1, 67, 5, 3, 64), (2, 9, 6, 4, 16), (1, 33, 48, 32, 128)])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_triton_equals_the_reference_bit_for_bit(B, T, heads, rotated, D, dtype, out_dtype, inverse):
    x = inputs(B, T, heads, D, dtype, seed=T)
    cos, sin = tables(T, D)
    want = rotary_reference(x, cos, sin, rotated, inverse, out_dtype)
    got = triton_rotary(x, cos, sin, rotated, inverse, out_dtype)
    assert_bitwise(got, want, f"rotary {B, T, heads, rotated, D} {dtype}->{out_dtype} inverse={inverse}")


@pytest.mark.parametrize("B,T,heads,rotated,D", [(1, 67, 5, 3, 64), (2, 9, 6, 4, 16), (1, 33, 48, 32, 128),
                                                  (2, 5, 4, 0, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("inverse", [False, True])
def test_in_place_writes_the_copys_bits_into_x_and_leaves_the_other_heads(B, T, heads, rotated, D, dtype, inverse):
    """``in_place=True``: x itself comes back holding the out-of-place result's bits,
    on every backend; the value heads are never written (a sentinel NaN pattern in
    them survives)."""
    x = inputs(B, T, heads, D, dtype, seed=T + 1)
    cos, sin = tables(T, D)
    want = rotary_reference(x, cos, sin, rotated, inverse, dtype)
    for name, fn in (("reference", rotary_reference), ("triton", triton_rotary)):
        y = x.clone()
        y[:, :, rotated:] = float("nan")  # read by no one in place: must stay
        got = fn(y, cos, sin, rotated, inverse, dtype, in_place=True)
        context = f"{name} in place {B, T, heads, rotated, D} {dtype} inverse={inverse}"
        assert got is y, context
        assert_bitwise(got[:, :, :rotated], want[:, :, :rotated], context)
        assert torch.isnan(got[:, :, rotated:]).all(), context


def test_in_place_needs_x_contiguous_and_of_the_output_dtype():
    x = torch.zeros(1, 3, 2, 8)
    cos = sin = torch.zeros(3, 8)
    for fn in (rotary_reference, triton_rotary):
        with pytest.raises(ValueError, match=r"rotary\(in_place=True\): x must be contiguous and of out_dtype"):
            fn(x, cos, sin, 1, False, torch.bfloat16, in_place=True)
        with pytest.raises(ValueError, match="not contiguous"):
            fn(torch.zeros(1, 2, 3, 8).transpose(1, 2), cos, sin, 1, False, torch.float32, in_place=True)


def test_inverse_undoes_the_rotation():
    x = inputs(1, 40, 6, 64, torch.float32)
    cos, sin = tables(40, 64)
    back = triton_rotary(triton_rotary(x, cos, sin, 4, False, torch.float32), cos, sin, 4, True, torch.float32)
    assert_close(back, x, torch.float32, "inverse after forward")
    assert torch.equal(back[:, :, 4:], x[:, :, 4:])  # the value heads untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
def test_gpt_size_on_the_gpu():
    x = inputs(16, 1024, 48, 64, torch.bfloat16)
    cos, sin = tables(1024, 64)
    for inverse in (False, True):
        want = rotary_reference(x, cos, sin, 32, inverse, torch.bfloat16)
        assert_bitwise(triton_rotary(x, cos, sin, 32, inverse, torch.bfloat16), want, f"GPT size inverse={inverse}")


# (a change to valid arguments, the error it raises): every backend's rotary raises these
ARGUMENT_ERRORS = [
    (dict(x=torch.zeros(2, 3, 4)), "x must be a (B, T, heads, D) float tensor"),
    (dict(x=torch.zeros(1, 3, 2, 5)), "the head dim must be even"),
    (dict(cos=torch.zeros(3, 6)), "cos must be a (3, 8) float32 table"),
    (dict(sin=torch.zeros(3, 8, dtype=torch.float64)), "sin must be a (3, 8) float32 table"),
    (dict(rotated_heads=3), "rotated_heads must be an integer in [0, 2]"),
    (dict(rotated_heads=True), "rotated_heads must be an integer"),
    (dict(inverse=1), "inverse must be a bool"),
    (dict(out_dtype=torch.int8), "out_dtype must be one of"),
]


def valid_arguments(**change) -> dict:
    """Valid rotary arguments on the CPU, with ``change`` applied."""
    args = dict(x=torch.zeros(1, 3, 2, 8), cos=torch.zeros(3, 8), sin=torch.zeros(3, 8), rotated_heads=1,
                inverse=False, out_dtype=torch.float32)
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", ARGUMENT_ERRORS)
def test_argument_errors(change, message):
    args = valid_arguments(**change)
    for fn in (rotary_reference, triton_rotary):
        with pytest.raises(ValueError, match=re.escape(message)):
            fn(**args)


def test_a_large_angle_table_stays_exact():
    """Positions far from 0 (a decoding offset): the same tables, the same bits."""
    x = inputs(1, 8, 2, 64, torch.bfloat16)
    cos, sin = tables(8, 64, offset=int(1e6))
    assert_bitwise(triton_rotary(x, cos, sin, 1, False, torch.bfloat16),
                   rotary_reference(x, cos, sin, 1, False, torch.bfloat16), "offset 1e6")
    assert math.isfinite(float(cos.abs().max()))
