"""Current scaling's lean cast path (the ops' calls: both copies named, a plain
tensor) against the checked path, on the CPU's reference kernels: the same bits,
the same shapes, the caster kept while the backend's choice and the quantizer's
arguments stay, and every other call on the checked path with its errors."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser import backend, epoch
from te_fuser.kernels.reference import cast as ref_cast
from te_fuser.quantization import Float8CurrentScalingQuantizer
from te_fuser.quantization.float8_tensor import Float8Tensor
from te_fuser.quantization.base import Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (0.3 + 2 * torch.randn(shape, generator=g)).to(dtype)


def _checked(q, x, rowwise, columnwise):
    return Quantizer.cast(q, x, rowwise=rowwise, columnwise=columnwise)  # the base class's checked path


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    for name in ("rowwise", "columnwise"):
        pa, pb = getattr(a, name), getattr(b, name)
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert pa.scaling == pb.scaling
            assert_bitwise(pa.data, pb.data)
            assert_bitwise(pa.scale_inv, pb.scale_inv)


@pytest.mark.parametrize("shape", [(33, 48), (2, 5, 32), (16,)])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("fp8,power_2,eps", [(E4M3, False, 0.0), (E5M2, True, 1e-2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lean_cast_equals_the_checked_cast(shape, rowwise, columnwise, fp8, power_2, eps, dtype):
    q = Float8CurrentScalingQuantizer(fp8, power_2_scales=power_2, amax_epsilon=eps)
    x = _x(shape, dtype)
    _same(q.cast(x, rowwise=rowwise, columnwise=columnwise), _checked(q, x, rowwise, columnwise))
    assert "quantize_current" in q._kept_casters  # it went the lean way


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (True, True), (False, True)])
def test_lean_column_sums_equal_the_checked_ones(rowwise, columnwise):
    q = Float8CurrentScalingQuantizer(E5M2)
    x = _x((3, 11, 32), seed=1)
    got, sums = q.quantize_with_column_sums(x, rowwise=rowwise, columnwise=columnwise)
    want, want_sums = Quantizer.quantize_with_column_sums(q, x, rowwise=rowwise, columnwise=columnwise)
    _same(got, want)
    assert_bitwise(sums, want_sums)
    assert "quantize_current_column_sums" in q._kept_casters


def test_the_caster_follows_the_backend_choice_and_the_arguments():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = _x((32, 64))
    q.cast(x, rowwise=True, columnwise=False)
    first = q._kept_casters["quantize_current"]
    q.cast(x, rowwise=True, columnwise=False)
    assert q._kept_casters["quantize_current"] is first  # kept
    q.amax_epsilon = 1e3  # larger than amax: the scale changes
    _same(q.cast(x, rowwise=True, columnwise=False), _checked(q, x, True, False))
    assert q._kept_casters["quantize_current"] is not first
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return ref_cast.quantize_current_reference(*args, **kwargs)

    choice = backend.resolve("quantize_current", x.device)
    before = backend._global_choices.get(("quantize_current", x.device))
    backend._global_choices[("quantize_current", x.device)] = backend.KernelChoice(
        choice.kernel, choice.backend, counting, "counting")
    epoch.bump()  # as the backend's own changes announce themselves (set_backend, an override, set_auto_entry)
    try:
        _same(q.cast(x, rowwise=True, columnwise=True), _checked(q, x, True, True))
        assert calls  # the new choice ran
    finally:
        if before is None:
            backend._global_choices.pop(("quantize_current", x.device), None)
        else:
            backend._global_choices[("quantize_current", x.device)] = before
        epoch.bump()


def test_quantizers_of_one_configuration_share_a_prepared_cast():
    """A prepared cast binds only constants: a plan's fresh quantizers of one
    configuration take the one prepared before; another configuration prepares its own."""
    x = _x((16, 32))
    a, b = Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E4M3)
    other = Float8CurrentScalingQuantizer(E4M3, amax_epsilon=1e3)
    for q in (a, b, other):
        _same(q.cast(x, rowwise=True, columnwise=True), _checked(q, x, True, True))
    assert a._kept_casters["quantize_current"][2] is b._kept_casters["quantize_current"][2]
    assert other._kept_casters["quantize_current"][2] is not a._kept_casters["quantize_current"][2]


def test_other_calls_take_the_checked_path_and_its_errors():
    q = Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=True)
    x = _x((8, 32))
    _same(q.cast(x), _checked(q, x, True, True))  # usage flags: the checked path
    assert q._kept_casters is None
    with pytest.raises(ValueError, match="both False"):
        q.cast(x, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="0-d"):
        q.cast(torch.tensor(1.0), rowwise=True, columnwise=False)
    with pytest.raises(TypeError, match="input dtype"):
        q.cast(x.double(), rowwise=True, columnwise=False)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        q.cast([1.0], rowwise=True, columnwise=False)
    fp8 = q(x)  # a Float8Tensor is not a plain tensor: the checked path decides
    assert isinstance(fp8, Float8Tensor)
    assert q._kept_casters is None


def test_a_copy_or_pickle_prepares_its_own_caster():
    import copy
    import pickle

    q = Float8CurrentScalingQuantizer(E4M3)
    x = _x((16, 32))
    want = q.cast(x, rowwise=True, columnwise=True)
    for other in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert other._kept_casters is None
        _same(other.cast(x, rowwise=True, columnwise=True), want)


@pytest.mark.parametrize("sums", [False, True])
def test_delayed_lean_cast_equals_the_checked_cast_and_updates_alike(sums):
    from te_fuser.quantization.amax_reduction import flush_amax_reductions
    from te_fuser.quantization.delayed import DelayedScalingQuantizer

    lean, checked = (DelayedScalingQuantizer(E4M3, amax_history_len=4) for _ in range(2))
    for step in range(3):
        x = _x((2, 9, 32), seed=step) * (step + 1)
        if sums:
            got, got_sums = lean.quantize_with_column_sums(x, rowwise=True, columnwise=True)
            want, want_sums = Quantizer.quantize_with_column_sums(checked, x, rowwise=True, columnwise=True)
            assert_bitwise(got_sums, want_sums)
        else:
            got = lean.cast(x, rowwise=True, columnwise=True)
            want = _checked(checked, x, True, True)
        _same(got, want)
    flush_amax_reductions()
    for name in ("scale", "scale_inv", "amax_history", "nonfinite_amax_count"):
        assert_bitwise(getattr(lean, name), getattr(checked, name))
    assert lean._kept_casters and checked._kept_casters  # both casts go through the prepared call


def test_a_training_loop_keeps_every_loss_bit_on_the_lean_path(monkeypatch):
    """The smoke GPT trained as users train it (fused AdamW, evaluations without FP8,
    a checkpoint resumed, recipe switches bf16 -> delayed -> current -> bf16): every
    loss the same bits with the casts' lean path as with the checked path, and the
    lean path taken by both FP8 recipes."""
    from training_loops import gpt_losses

    lean_calls = []
    real = Quantizer._caster

    def counting(self, kernel, device, generic):
        lean_calls.append(kernel)
        return real(self, kernel, device, generic)

    monkeypatch.setattr(Quantizer, "_caster", counting)
    lean = gpt_losses()
    assert {"quantize_current", "quantize_current_column_sums", "quantize_tensorwise"} <= set(lean_calls)
    monkeypatch.setattr(Quantizer, "_lean", lambda self, x, rowwise, columnwise: False)
    assert gpt_losses() == lean
