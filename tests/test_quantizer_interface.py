"""The Quantizer interface: device checks, input checks, identity, text, state."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise

from te_fuser.backend import get_backend
from te_fuser.quantization import (
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
    QuantizerRole,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROLE = QuantizerRole("linear", "weight", "fc2")
FP8_QUANTIZERS = {
    "delayed": lambda: DelayedScalingQuantizer(E4M3, amax_history_len=4, role=ROLE),
    "current": lambda: Float8CurrentScalingQuantizer(E4M3, role=ROLE),
    "mxfp8": lambda: MXFP8Quantizer(E4M3, role=ROLE),
    "block_1x128": lambda: Float8BlockQuantizer(E4M3, 1, role=ROLE),
    "block_128x128": lambda: Float8BlockQuantizer(E5M2, 2, role=ROLE),
}


@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_fp8_quantizers_pass_on_cpu(name):
    quantizer = FP8_QUANTIZERS[name]()
    assert isinstance(quantizer, Quantizer) and quantizer.min_compute_capability == (8, 9)
    quantizer.check_device("cpu")
    quantizer.check_device(torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_capability_below_fp8_is_rejected_with_role_and_need(name):
    quantizer = FP8_QUANTIZERS[name]()
    for capability in [(8, 9), (9, 0), (10, 0), (12, 1)]:
        quantizer.check_capability(capability, "cuda:0")
    for capability in [(8, 6), (8, 0), (7, 5)]:
        pattern = rf"linear:fc2\.weight.*compute capability >= 8\.9.*cuda:0 has compute capability {capability[0]}\.{capability[1]}"
        with pytest.raises(RuntimeError, match=pattern) as err:
            quantizer.check_capability(capability, "cuda:0")
        assert quantizer.describe() in str(err.value)


def test_check_device_on_cuda_reads_the_real_device():
    quantizer = Float8CurrentScalingQuantizer(E4M3, role=ROLE)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"linear:fc2\.weight.*no CUDA device is available"):
            quantizer.check_device("cuda:0")
        return
    capability = torch.cuda.get_device_capability(0)
    if capability >= (8, 9):
        quantizer.check_device("cuda:0")
    else:
        with pytest.raises(RuntimeError, match="compute capability"):
            quantizer.check_device("cuda:0")


def test_identity_needs_nothing():
    quantizer = IdentityQuantizer(role=ROLE)
    for device in ("cpu", "cuda:0", "cuda", "meta"):
        quantizer.check_device(device)  # no FP8 check, whatever the machine
    quantizer.check_capability((6, 0), "cuda:0")
    quantizer.check_shape((67, 13), rowwise=True, columnwise=True)
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    assert quantizer(x) is x and quantizer(x, rowwise=False, columnwise=True) is x
    assert quantizer.describe() == "identity" and quantizer.scaling == "identity" and quantizer.fp8_dtype is None
    assert quantizer.state_dict() == {}
    quantizer.load_state_dict({})
    quantizer.observe(x)
    quantizer.carry_state_from(DelayedScalingQuantizer(E4M3))
    with pytest.raises(ValueError, match="holds no scaling state"):
        quantizer.load_state_dict({"scale": torch.ones(())})


@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_bad_input_names_the_role(name):
    quantizer = FP8_QUANTIZERS[name]()
    with pytest.raises(TypeError, match=r"linear:fc2\.weight.*torch\.Tensor"):
        quantizer([[1.0, 2.0]])
    with pytest.raises(TypeError, match=r"linear:fc2\.weight.*dtype"):
        quantizer(torch.ones(32, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"linear:fc2\.weight.*dtype"):
        quantizer(torch.ones(32, 32).to(E4M3))
    with pytest.raises(ValueError, match=r"linear:fc2\.weight.*0-d"):
        quantizer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"linear:fc2\.weight.*at least one copy"):
        quantizer(torch.ones(32, 32), rowwise=False, columnwise=False)


@pytest.mark.parametrize("name", ["current", "mxfp8", "block_1x128", "block_128x128"])
def test_stateless_quantizers(name):
    quantizer = FP8_QUANTIZERS[name]()
    assert quantizer.state_dict() == {}
    quantizer.observe(torch.ones(32, 32))  # calibration is a no-op
    quantizer.carry_state_from(DelayedScalingQuantizer(E4M3))
    with pytest.raises(ValueError, match="holds no scaling state"):
        quantizer.load_state_dict(DelayedScalingQuantizer(E4M3).state_dict())


def test_repr_names_the_role():
    assert repr(Float8CurrentScalingQuantizer(E4M3, role=ROLE)) == (
        "Float8CurrentScalingQuantizer(current(e4m3), role=linear:fc2.weight)"
    )
    assert repr(IdentityQuantizer()) == "IdentityQuantizer(identity)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to observe host syncs")
@pytest.mark.skipif(get_backend() == "reference", reason="the reference backend is an oracle, not a hot path")
@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_hot_path_does_not_sync_the_host(name):
    quantizer = FP8_QUANTIZERS[name]()
    x = torch.randn(128, 256, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the first call of a delayed quantizer seeds; the next ones update
            quantizer(x, rowwise=True, columnwise=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_cuda_matches_cpu_bit_for_bit(name):
    """The same quantizer on a CUDA tensor (whatever backend runs there) gives the CPU bytes."""
    on_cpu, on_cuda = FP8_QUANTIZERS[name](), FP8_QUANTIZERS[name]()
    g = torch.Generator().manual_seed(0)
    x = (-2.3 + 0.5 * torch.randn(128, 256, generator=g)).to(torch.bfloat16)
    for step in range(3):  # delayed scaling: the state evolves the same way on both
        x_step = x * (step + 1)
        a = on_cpu(x_step, rowwise=True, columnwise=True)
        b = on_cuda(x_step.cuda(), rowwise=True, columnwise=True)
        for copy in ("rowwise", "columnwise"):
            op_cpu, op_cuda = getattr(a, copy), getattr(b, copy)
            assert_bitwise(op_cuda.data, op_cpu.data, f"{name} step {step} {copy} data")
            assert_bitwise(op_cuda.scale_inv, op_cpu.scale_inv, f"{name} step {step} {copy} scales")
        assert_bitwise(b.dequantize(), a.dequantize(), f"{name} step {step} dequantized")


@pytest.mark.parametrize("name", sorted(FP8_QUANTIZERS))
def test_check_shape_rejects_0d_with_the_role(name):
    with pytest.raises(ValueError, match=r"linear:fc2\.weight.*0-d"):
        FP8_QUANTIZERS[name]().check_shape(())


def test_state_tensors_are_public_and_bind_only_their_own_kind():
    """The scaling state by name (empty when stateless); a holder binds a tensor of
    the same shape, dtype and device, and nothing else."""
    from te_fuser.quantization import DelayedScalingQuantizer, Float8CurrentScalingQuantizer

    assert Float8CurrentScalingQuantizer(torch.float8_e4m3fn).state_tensors() == {}
    q = DelayedScalingQuantizer(torch.float8_e4m3fn, amax_history_len=4)
    tensors = q.state_tensors()
    assert set(tensors) == {"scale", "scale_inv", "amax_history", "nonfinite_amax_count"}
    assert tensors["amax_history"] is q.amax_history
    home = torch.zeros(4)
    q.bind_state_tensor("amax_history", home)
    assert q.state_tensors()["amax_history"] is home
    with pytest.raises(ValueError, match="no state tensor 'amax'"):
        q.bind_state_tensor("amax", home)
    with pytest.raises(ValueError, match="state tensor 'amax_history' is \\(4,\\)"):
        q.bind_state_tensor("amax_history", torch.zeros(5))
    assert q.seeded is False and Float8CurrentScalingQuantizer(torch.float8_e4m3fn).seeded is True


def test_an_op_restores_its_quantizers_and_their_state():
    """``snapshot_quantizers`` / ``restore_quantizers``: the installed quantizers
    and their scaling state as they were, after steps under another recipe."""
    import te_fuser as te

    model = te.ops.Sequential(te.ops.Linear(16, 8))
    linear = model[0].basic_ops[0]
    x = torch.randn(4, 16)
    with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=3)):
        model(x).sum().backward()
    snap = linear.snapshot_quantizers()
    before = {t: q.state_dict() for t, q in linear.installed_quantizers.items()}
    with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=3)):
        model(3 * x).sum().backward()  # moves the histories on
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        model(x).sum().backward()  # installs other quantizers
    assert linear.installed_quantizers is not snap.quantizers
    linear.restore_quantizers(snap)
    assert linear.installed_quantizers is snap.quantizers
    for t, q in linear.installed_quantizers.items():
        for name, value in q.state_dict().items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before[t][name])), (t, name)
