"""The cuda backend's rotary kernel (``rotary_kernels.cu``) on the GPU: bit for bit
the reference (zeros compared as zeros) forward and inverse, out of place and in
place, on the 16-byte path (half head dims of multiples of 8, aligned operands) and
the element path (any other even head dim, a misaligned x); its lean entry's
hand-backs (None for operands the checked path must see, nothing launched); the
checked path's errors, as the reference's; the dispatcher's fallback for float64;
the rotary op taking the lean entry in a model."""

from __future__ import annotations

import re
import pytest
import torch

from te_fuser import backend
from te_fuser.kernels.reference import rotary_reference
from gpt_testing import CONFIG, step_per_auto_entry
from test_rotary_kernel import ARGUMENT_ERRORS, assert_bitwise, inputs, tables, valid_arguments

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda rotary kernel runs on a CUDA GPU")


def _cuda():
    from te_fuser.kernels import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return cuda


SHAPES = [(1, 67, 5, 3, 64), (2, 9, 6, 4, 16), (1, 33, 48, 32, 128), (2, 5, 4, 0, 32), (1, 7, 3, 2, 12),
          (1, 5, 2, 2, 2)]


@pytest.mark.parametrize("B,T,heads,rotated,D", SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_cuda_equals_the_reference_bit_for_bit(B, T, heads, rotated, D, dtype, out_dtype, inverse):
    cuda = _cuda()
    x = inputs(B, T, heads, D, dtype, seed=T)
    cos, sin = tables(T, D, offset=3)
    want = rotary_reference(x, cos, sin, rotated, inverse, out_dtype)
    context = f"rotary {B, T, heads, rotated, D} {dtype}->{out_dtype} inverse={inverse}"
    assert_bitwise(cuda.rotary(x, cos, sin, rotated, inverse, out_dtype), want, context)
    lean = cuda.rotary.lean(x, cos, sin, rotated, inverse, out_dtype)
    assert lean is not None and lean.dtype == out_dtype, context
    assert_bitwise(lean, want, "lean " + context)


@pytest.mark.parametrize("B,T,heads,rotated,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("inverse", [False, True])
def test_in_place_writes_the_rotated_heads_alone(B, T, heads, rotated, D, dtype, inverse):
    """x itself comes back holding the out-of-place result's bits in its rotated heads;
    the other heads are never written (a NaN sentinel in them survives)."""
    cuda = _cuda()
    x = inputs(B, T, heads, D, dtype, seed=T + 1)
    cos, sin = tables(T, D)
    want = rotary_reference(x, cos, sin, rotated, inverse, dtype)
    for name, fn in (("checked", cuda.rotary), ("lean", cuda.rotary.lean)):
        y = x.clone()
        y[:, :, rotated:] = float("nan")
        got = fn(y, cos, sin, rotated, inverse, dtype, True)
        context = f"{name} in place {B, T, heads, rotated, D} {dtype} inverse={inverse}"
        assert got is y, context
        assert_bitwise(got[:, :, :rotated], want[:, :, :rotated], context)
        assert torch.isnan(got[:, :, rotated:]).all(), context


def test_a_misaligned_x_takes_the_element_path_with_the_same_bits():
    cuda = _cuda()
    base = inputs(1, 17 * 48 * 64 + 1, 1, 1, torch.bfloat16).flatten()
    x = base[1:].view(1, 17, 48, 64)  # 2 bytes past a 16-byte boundary
    cos, sin = tables(17, 64)
    want = rotary_reference(x, cos, sin, 32, False, torch.bfloat16)
    assert_bitwise(cuda.rotary.lean(x, cos, sin, 32, False, torch.bfloat16), want, "misaligned x")


def test_gpt_size():
    cuda = _cuda()
    x = inputs(16, 1024, 48, 64, torch.bfloat16)
    cos, sin = tables(1024, 64)
    for inverse in (False, True):
        want = rotary_reference(x, cos, sin, 32, inverse, torch.bfloat16)
        assert_bitwise(cuda.rotary.lean(x, cos, sin, 32, inverse, torch.bfloat16), want, f"GPT inverse={inverse}")
        y = x.clone()
        assert cuda.rotary.lean(y, cos, sin, 32, inverse, torch.bfloat16, True) is y
        assert_bitwise(y, want, f"GPT in place inverse={inverse}")


def test_the_lean_entry_hands_back_what_the_checked_path_must_see():
    """None, and x untouched, for each operand the extension does not take as it is."""
    cuda = _cuda()
    x = inputs(1, 6, 4, 16, torch.bfloat16)
    cos, sin = tables(6, 16)
    lean = cuda.rotary.lean
    cases = {
        "x not contiguous": (x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin, 2, torch.bfloat16, False),
        "x float64": (x.double(), cos, sin, 2, torch.float64, False),
        "x on the CPU": (x.cpu(), cos.cpu(), sin.cpu(), 2, torch.bfloat16, False),
        "x 3-D": (x.reshape(1, 6, 64), cos, sin, 2, torch.bfloat16, False),
        "odd head dim": (inputs(1, 6, 4, 15, torch.bfloat16), tables(6, 16)[0][:, :15].contiguous(),
                         tables(6, 16)[1][:, :15].contiguous(), 2, torch.bfloat16, False),
        "cos on the CPU": (x, cos.cpu(), sin, 2, torch.bfloat16, False),
        "sin of another length": (x, cos, tables(7, 16)[1], 2, torch.bfloat16, False),
        "cos bf16": (x, cos.bfloat16(), sin, 2, torch.bfloat16, False),
        "sin not contiguous": (x, cos, tables(6, 32)[1][:, :16], 2, torch.bfloat16, False),
        "rotated past the heads": (x, cos, sin, 5, torch.bfloat16, False),
        "rotated negative": (x, cos, sin, -1, torch.bfloat16, False),
        "out dtype int8": (x, cos, sin, 2, torch.int8, False),
        "in place into another dtype": (x, cos, sin, 2, torch.float32, True),
    }
    for name, (xx, c, s, rotated, out_dtype, in_place) in cases.items():
        before = xx.clone()
        assert lean(xx, c, s, rotated, False, out_dtype, in_place) is None, name
        assert torch.equal(xx, before), name


@pytest.mark.parametrize("change, message", ARGUMENT_ERRORS)
def test_the_checked_path_raises_the_references_errors(change, message):
    cuda = _cuda()
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in valid_arguments(**change).items()}
    for fn in (rotary_reference, cuda.rotary):
        with pytest.raises(ValueError, match=re.escape(message)):
            fn(**args)


def test_the_dispatcher_sends_float64_elsewhere():
    _cuda()
    x = inputs(1, 5, 3, 16, torch.float64)
    cos, sin = tables(5, 16)
    fn = backend.resolve("rotary", x.device, backend="cuda").fn
    assert torch.equal(fn(x, cos, sin, 2, False, torch.float64), rotary_reference(x, cos, sin, 2, False, torch.float64))


def test_the_rotary_op_takes_the_lean_entry(monkeypatch):
    """A GPT's rotary ops under the auto table call the extension's entry (forward and
    inverse, in place) and train as the Triton kernel's: the same loss bits and
    gradients."""
    cuda = _cuda()
    runs, calls = step_per_auto_entry("rotary", ["triton", "cuda"], cuda.rotary, monkeypatch)
    assert calls and all(calls), calls
    assert len(calls) >= 2 * CONFIG.n_layer, calls  # a forward and an inverse rotation a layer
    assert torch.equal(runs["triton"][0], runs["cuda"][0])
    for name, grad in runs["cuda"][1].items():
        assert torch.equal(grad, runs["triton"][1][name]), name
