"""DelayedScalingQuantizer: amax history and scale, checked exactly step by step.

Expectations are computed in float64 by :func:`simulate` and rounded to fp32 at
the points where the contract rounds: ``fmax / amax`` is one IEEE fp32 division
(float64 division followed by one rounding to fp32 gives the same value), the
margin divides by an exact power of two.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerances import assert_bitwise

from te_fuser.kernels.reference import quantize_tensorwise_reference
from te_fuser.quantization import DelayedScalingQuantizer, Float8CurrentScalingQuantizer, QuantizedTensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
INF, NAN = math.inf, math.nan
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CPU tensors only interpreted


def f32(value: float) -> float:
    """Round a float64 value to fp32 (overflow gives inf)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def with_amax(amax: float, shape=(4, 32)) -> torch.Tensor:
    """An fp32 tensor whose amax is ``amax`` (inf / NaN: one such element among ones)."""
    if math.isfinite(amax):
        x = torch.full(shape, amax / 2)
        x[1, 5] = -amax
    else:
        x = torch.ones(shape)
        x[1, 5] = amax
    return x


def expected_update(amax: float, prev_scale: float, fmax: float, margin: int) -> tuple[float, bool]:
    """Next scale from the history amax ``amax`` and whether it was non-finite, in
    float64 arithmetic (inf, NaN and 0 keep the previous scale)."""
    if math.isnan(amax) or math.isinf(amax):
        return prev_scale, True
    if amax == 0:
        return prev_scale, False
    scale = f32(f32(fmax / amax) / 2**margin)
    return (FLT_MAX if math.isinf(scale) else scale), False


def history_max(history: list[float]) -> float:
    return NAN if any(math.isnan(a) for a in history) else max(history)


def simulate(amaxes, fmax, margin, history_len, algo=history_max):
    """Per call: (scale used by the cast, history after it, next scale, non-finite count).

    An inf or NaN amax is skipped (history and scale kept) and counted; it cannot
    seed either: a first such tensor leaves the scale 1, yet the quantizer counts
    as seeded, so the next tensor is cast with 1 too."""
    history, scale, seeded, count, steps = [0.0] * history_len, 1.0, False, 0, []
    for amax in amaxes:
        if not seeded:
            scale, _ = expected_update(amax, scale, fmax, margin)
            seeded = True
        used = scale
        if amax < INF:
            history = [amax] + history[:-1]
            scale, _ = expected_update(algo(history), scale, fmax, margin)
        else:
            count += 1
        steps.append((used, list(history), scale, count))
    return steps


def check_steps(quantizer: DelayedScalingQuantizer, amaxes, expected) -> None:
    for step, (amax, (used, history, scale, count)) in enumerate(zip(amaxes, expected)):
        x = with_amax(amax)
        t = quantizer(x)
        where = f"step {step} (amax {amax})"
        assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1.0 / used)), f"{where}: scale_inv of the cast")
        ref, _, _ = quantize_tensorwise_reference(x, torch.tensor(used), quantizer.fp8_dtype)
        assert_bitwise(t.rowwise.data, ref, f"{where}: FP8 data")
        assert_bitwise(quantizer.amax_history, torch.tensor(history), f"{where}: history")
        assert_bitwise(quantizer.scale, torch.tensor(scale), f"{where}: next scale")
        assert_bitwise(quantizer.scale_inv, torch.tensor(f32(1.0 / scale)), f"{where}: next scale_inv")
        assert quantizer.nonfinite_amax_events == count, where


def test_seed_from_first_tensor():
    """A fresh quantizer casts its first tensor with a scale from that tensor's amax, not 1."""
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    assert not quantizer.seeded
    t = quantizer(with_amax(1024.0))  # with scale 1 this would saturate at 448
    assert quantizer.seeded
    assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1 / 0.4375)), "seeded scale_inv (448/1024 = 0.4375)")
    assert t.rowwise.data.float().abs().max() == 448.0
    assert_bitwise(quantizer.amax_history, torch.tensor([1024.0, 0.0, 0.0, 0.0]), "history")
    assert_bitwise(quantizer.scale, torch.tensor(0.4375), "scale")


@pytest.mark.parametrize("peak", [1.005859375, 3.0e38, -2.5, float("inf")])
def test_a_seed_through_bf16_is_the_seed_of_the_rounded_tensor(peak):
    """A fresh quantizer's first column-sums cast that reads fp32 as bf16
    (``round_bf16``) seeds from the amax of the rounded tensor without rounding a copy
    (the fp32 amax rounded to bf16): the scale, history and FP8 bytes of seeding on
    ``x.to(bfloat16)`` itself, for a peak that bf16 rounds up (1.005859375 to
    1.0078125), one it rounds to inf, a negative one and an inf."""
    x = -2.3 + 0.5 * torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    x[5, 7] = peak
    through, rounded = (DelayedScalingQuantizer(E4M3, amax_history_len=4) for _ in range(2))
    *got, _ = through._quantize_with_column_sums(x, True, True, True)  # (row-wise, column-wise, sums)
    *want, _ = rounded._quantize_with_column_sums(x.to(torch.bfloat16), True, True, False)
    for name in ("scale", "scale_inv", "amax_history", "nonfinite_amax_count"):
        assert_bitwise(getattr(through, name), getattr(rounded, name), f"peak {peak}: {name}")
    for a, b in zip(got, want):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), f"peak {peak}"


def test_max_algo_over_a_window():
    amaxes = [2.0, 5.0, 0.0, 3.0, 1.0, 0.5, 0.25]
    quantizer = DelayedScalingQuantizer(E4M3, margin=0, amax_history_len=3)
    expected = simulate(amaxes, 448.0, 0, 3)
    assert expected[0][0] == 224.0 and expected[1][2] == f32(448 / 5)  # anchors computed by hand
    assert expected[5][2] == f32(448 / 3)  # 5 left the window, 3 is the largest left
    check_steps(quantizer, amaxes, expected)


def test_most_recent_with_margin_zero_tiny_inf_nan():
    amaxes = [3.0, 0.0, f32(1e-40), INF, 7.0, NAN, 0.1]
    quantizer = DelayedScalingQuantizer(E5M2, margin=2, amax_history_len=4, amax_compute_algo="most_recent")
    expected = simulate(amaxes, 57344.0, 2, 4, algo=lambda h: h[0])
    assert expected[0][2] == f32(57344 / 3) / 4  # the margin: an exact division by 4
    assert expected[1][2] == expected[0][2]  # amax 0 keeps the scale
    assert expected[2][2] == FLT_MAX  # a tiny amax overflows the division
    assert expected[3][2] == FLT_MAX and expected[3][3] == 1  # inf keeps the scale, counted
    assert expected[5][2] == expected[4][2] and expected[5][3] == 2  # NaN too
    check_steps(quantizer, amaxes, expected)


def test_max_algo_skips_an_inf_amax():
    amaxes = [1.0, INF, 2.0, 3.0, 4.0]
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=2)
    expected = simulate(amaxes, 448.0, 0, 2)
    assert [step[3] for step in expected] == [0, 1, 1, 1, 1]  # the inf counted once
    assert expected[1][1:3] == ([1.0, 0.0], 448.0)  # not recorded: history and scale as before it
    assert expected[2][1:3] == ([2.0, 1.0], 224.0)  # the next finite amax sets the scale at once
    check_steps(quantizer, amaxes, expected)


def test_nonfinite_first_tensor_keeps_scale_one():
    """A NaN first tensor cannot seed: scale 1, counted once, not recorded; the
    quantizer still counts as seeded (no host sync decides), so the next tensor is
    cast with 1 and its amax sets the scale."""
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=2)
    expected = simulate([NAN, 8.0, 4.0], 448.0, 0, 2)
    assert expected[0] == (1.0, [0.0, 0.0], 1.0, 1)  # counted by the update, once
    assert expected[1] == (1.0, [8.0, 0.0], 56.0, 1)
    check_steps(quantizer, [NAN, 8.0, 4.0], expected)
    assert quantizer.seeded


def second_newest(history: torch.Tensor) -> torch.Tensor:
    return history[1]


def newest_max(history: torch.Tensor) -> torch.Tensor:
    """``"max"`` as a callable: the torch-ops path of the update."""
    return history.amax()


def fmax_over_amax(amax, scale, fmax, recipe):
    """The default scale as a ``scaling_factor_compute_algo``: the torch-ops path."""
    return fmax / amax


# the update's paths: the delayed_scale_update kernel ("max", "most_recent") and torch ops (a callable)
UPDATE_PATHS = {
    "max": ("max", None),
    "most_recent": ("most_recent", None),
    "callable_amax": (newest_max, None),
    "callable_scale": ("max", fmax_over_amax),
}


def _state(quantizer: DelayedScalingQuantizer) -> dict:
    return {name: getattr(quantizer, name) for name in ("amax_history", "scale", "scale_inv")}


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("path", list(UPDATE_PATHS))
def test_scale_recovers_on_the_next_finite_tensor(path, backend_name):
    """Tensors holding an inf or a NaN are counted and otherwise not seen: the state
    after each equals that of a twin quantizer fed only the finite tensors, so the
    scale follows the very next finite tensor (not amax_history_len calls later)."""
    import te_fuser as te

    algo, scale_algo = UPDATE_PATHS[path]
    mixed = [4.0, 2.0, INF, NAN, 8.0, INF, 1.0, 0.5]

    def make() -> DelayedScalingQuantizer:  # a window longer than the run: a recorded inf would hold "max"
        return DelayedScalingQuantizer(
            E4M3, amax_history_len=16, amax_compute_algo=algo, scaling_factor_compute_algo=scale_algo
        )

    quantizer, twin = make(), make()
    with te.backend.use_backend(backend_name):
        skipped = 0
        for step, amax in enumerate(mixed):
            where = f"{path} on {backend_name}, step {step} (amax {amax})"
            before = _state(quantizer)
            t = quantizer(with_amax(amax).to(DEVICE))
            if amax < INF:
                t_twin = twin(with_amax(amax).to(DEVICE))
                assert_bitwise(t.rowwise.scale_inv, t_twin.rowwise.scale_inv, f"{where}: scale_inv of the cast")
                assert_bitwise(t.rowwise.data, t_twin.rowwise.data, f"{where}: FP8 data")
                want = _state(twin)
            else:
                skipped += 1
                want = before
            for name, value in _state(quantizer).items():
                assert_bitwise(value, want[name], f"{where}: {name}")
            assert quantizer.nonfinite_amax_events == skipped, where
            if step == 4:  # the first finite tensor after the inf and the NaN: 448 / 8
                assert quantizer.scale.item() == 56.0, where
    assert skipped == 3 and twin.nonfinite_amax_events == 0
    assert not quantizer.amax_history.isnan().any() and quantizer.amax_history.max().item() == 8.0


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("path", list(UPDATE_PATHS))
def test_nonfinite_history_from_older_state_is_not_counted(path, backend_name):
    """A history holding an inf (state from before the skip rule) keeps the scale
    while the inf is in the window under "max"; finite tensors are not counted."""
    import te_fuser as te

    algo, scale_algo = UPDATE_PATHS[path]
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3, amax_compute_algo=algo,
                                        scaling_factor_compute_algo=scale_algo)  # fmt: skip
    # amax -> next scale; "most_recent" reads only the newest entry, the others the window's max
    steps = {4.0: 112.0, 8.0: 56.0, 1.0: 448.0} if path == "most_recent" else {4.0: 224.0, 8.0: 224.0, 1.0: 56.0}
    with te.backend.use_backend(backend_name):
        quantizer(with_amax(2.0).to(DEVICE))  # seeded: scale 224
        quantizer.amax_history = torch.tensor([INF, 2.0, 0.0], device=DEVICE)
        for amax, scale in steps.items():  # the inf in slots 1, 2, then out of the window
            quantizer(with_amax(amax).to(DEVICE))
            assert quantizer.scale.item() == scale, f"{path} on {backend_name}, after amax {amax}"
    assert quantizer.nonfinite_amax_events == 0


def test_callable_amax_algo():
    amaxes = [4.0, 2.0, 8.0, 1.0]
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3, amax_compute_algo=second_newest)
    expected = simulate(amaxes, 448.0, 0, 3, algo=lambda h: h[1])
    assert expected[0][2] == expected[0][0] == 112.0  # second newest is 0 at first: keeps the seed
    check_steps(quantizer, amaxes, expected)


def test_scaling_factor_compute_algo():
    seen = []

    def doubling(amax, scale, fmax, recipe):
        seen.append((float(amax), fmax, recipe))
        return scale * 2.0

    recipe = object()
    quantizer = DelayedScalingQuantizer(
        E5M2, amax_history_len=2, scaling_factor_compute_algo=doubling, recipe=recipe
    )
    scales_used = []
    for amax in [3.0, 5.0, 0.0, INF, 6.0]:
        scales_used.append(1.0 / quantizer(with_amax(amax)).rowwise.scale_inv.item())
    # seed 2 (doubles 1); then 4, 8; amax 0 is not zero in a 'max' window: 16; inf is skipped,
    # keeping 16 (the callable runs, its result unused); 6 doubles again: 32
    assert scales_used == [2.0, 4.0, 8.0, 16.0, 16.0]
    assert quantizer.scale.item() == 32.0 and quantizer.nonfinite_amax_events == 1
    assert_bitwise(quantizer.amax_history, torch.tensor([6.0, 0.0]), "the inf was not recorded")
    assert seen[0] == (3.0, 57344.0, recipe)


def test_scaling_factor_algo_overflow_is_capped():
    quantizer = DelayedScalingQuantizer(E4M3, scaling_factor_compute_algo=lambda a, s, f, r: s * 1e30)
    quantizer(with_amax(1.0))
    quantizer(with_amax(1.0))
    assert quantizer.scale.item() == FLT_MAX


def test_observe_records_without_casting():
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3)
    assert quantizer.observe(with_amax(16.0)) is None
    assert quantizer.seeded
    assert_bitwise(quantizer.amax_history, torch.tensor([16.0, 0.0, 0.0]), "history")
    assert_bitwise(quantizer.scale, torch.tensor(28.0), "scale 448/16")
    t = quantizer(with_amax(2.0))  # seeded: cast with the calibrated scale
    assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1 / 28)), "scale_inv used")


def run_steps(quantizer, amaxes):
    for amax in amaxes:
        quantizer(with_amax(amax))
    return quantizer


@pytest.mark.parametrize(
    "new_len, history",
    [(2, [3.0, 2.0]), (4, [3.0, 2.0, 1.0, 7.0]), (6, [3.0, 2.0, 1.0, 7.0, 0.0, 0.0])],
    ids=["shrink", "same", "grow"],
)
def test_carry_state_resizes_history(new_len, history):
    previous = run_steps(DelayedScalingQuantizer(E4M3, amax_history_len=4), [7.0, 1.0, 2.0, 3.0])
    quantizer = DelayedScalingQuantizer(E5M2, margin=1, amax_history_len=new_len)
    quantizer.carry_state_from(previous)
    assert quantizer.seeded
    assert_bitwise(quantizer.amax_history, torch.tensor(history), "carried history")
    expected_scale, _ = expected_update(max(history), 1.0, 57344.0, 1)  # 7 drops out on shrink
    assert_bitwise(quantizer.scale, torch.tensor(expected_scale), "scale under the new format and margin")
    assert_bitwise(quantizer.scale_inv, torch.tensor(f32(1 / expected_scale)), "scale_inv")
    t = quantizer(with_amax(1.0))  # no re-seeding: the carried scale casts
    assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1 / expected_scale)), "scale_inv used")
    assert previous.amax_history_len == 4 and previous.amax_history[0].item() == 3.0  # untouched


def test_carry_state_recomputes_with_the_new_algo():
    previous = run_steps(DelayedScalingQuantizer(E4M3, amax_history_len=3), [9.0, 2.0])
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3, amax_compute_algo="most_recent")
    quantizer.carry_state_from(previous)
    assert_bitwise(quantizer.scale, torch.tensor(224.0), "448 / most recent amax 2")


def test_carry_state_keeps_nonfinite_count_and_previous_scale():
    previous = run_steps(DelayedScalingQuantizer(E4M3, amax_history_len=2), [2.0, INF])
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3)
    quantizer.carry_state_from(previous)
    assert_bitwise(quantizer.amax_history, torch.tensor([2.0, 0.0, 0.0]), "the inf was never recorded")
    assert quantizer.scale.item() == previous.scale.item() == 224.0
    assert quantizer.nonfinite_amax_events == 1
    previous.amax_history = torch.tensor([INF, 2.0])  # a history holding inf: older state
    quantizer.carry_state_from(previous)
    assert quantizer.scale.item() == 224.0  # inf in the window: the previous scale kept


@pytest.mark.parametrize("previous", [None, "current", "unseeded"])
def test_carry_state_from_other_starts_fresh(previous):
    if previous == "current":
        previous = Float8CurrentScalingQuantizer(E4M3)
    elif previous == "unseeded":
        previous = DelayedScalingQuantizer(E4M3, amax_history_len=2)
    quantizer = run_steps(DelayedScalingQuantizer(E4M3, amax_history_len=2), [4.0, 8.0])
    quantizer.carry_state_from(previous)
    assert not quantizer.seeded and quantizer.scale.item() == 1.0
    assert not quantizer.amax_history.any()
    t = quantizer(with_amax(32.0))  # seeds again from this tensor
    assert_bitwise(t.rowwise.scale_inv, torch.tensor(f32(1 / 14)), "seeded 448/32 = 14")


def test_state_dict_roundtrip_continues_identically():
    amaxes = [2.0, INF, 5.0]
    source = run_steps(DelayedScalingQuantizer(E4M3, amax_history_len=4), amaxes)
    state = source.state_dict()
    assert sorted(state) == ["amax_history", "nonfinite_amax_count", "scale", "scale_inv", "seeded"]
    state["amax_history"].fill_(-1.0)  # the state dict holds copies
    assert source.amax_history[0].item() == 5.0
    state = source.state_dict()
    target = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    target.load_state_dict(state)
    assert target.seeded and target.nonfinite_amax_events == 1  # the inf, once
    a, b = source(with_amax(3.0)), target(with_amax(3.0))
    assert_bitwise(a.rowwise.data, b.rowwise.data, "same cast")
    for name in ("scale", "scale_inv", "amax_history", "nonfinite_amax_count"):
        assert_bitwise(getattr(target, name), getattr(source, name), name)


def test_load_state_dict_rejects_bad_state():
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    state = DelayedScalingQuantizer(E4M3, amax_history_len=8).state_dict()
    with pytest.raises(ValueError, match=r"amax_history.*\(8,\).*\(4,\).*continue_from_state"):
        quantizer.load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['seeded'\]"):
        quantizer.load_state_dict({k: v for k, v in quantizer.state_dict().items() if k != "seeded"})


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(margin=-1), ValueError, "margin"),
        (dict(margin=True), ValueError, "margin"),
        (dict(amax_history_len=0), ValueError, "amax_history_len"),
        (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
        (dict(scaling_factor_compute_algo=3), TypeError, "scaling_factor_compute_algo"),
    ],
)
def test_invalid_arguments(kwargs, error, field):
    with pytest.raises(error, match=field):
        DelayedScalingQuantizer(E4M3, **kwargs)
    with pytest.raises(ValueError, match="fp8_dtype"):
        DelayedScalingQuantizer(torch.bfloat16)


def test_describe_and_columnwise_copy():
    quantizer = DelayedScalingQuantizer(E4M3)
    assert quantizer.describe() == "delayed(e4m3, hist=1024, margin=0)"
    custom = DelayedScalingQuantizer(E5M2, margin=2, amax_history_len=8, amax_compute_algo=second_newest)
    assert custom.describe() == "delayed(e5m2, hist=8, margin=2, amax=second_newest)"
    x = torch.arange(-48.0, 48.0).reshape(2, 3, 16)  # (6, 16) flattened
    t = quantizer.cast(x, rowwise=True, columnwise=True)
    assert isinstance(t, QuantizedTensor) and t.shape == x.shape
    assert_bitwise(t.columnwise.data, t.rowwise.data.t().contiguous(), "columnwise = transposed rowwise")
    assert t.columnwise.scale_inv is t.rowwise.scale_inv
    assert quantizer.scale_inv is not t.rowwise.scale_inv  # the next update does not alter t


def _reduction_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3)
        quantizer.amax_reduction_group = dist.group.WORLD
        for amax in ([1.0, 16.0], [4.0, 2.0])[rank]:
            quantizer(with_amax(amax))
        torch.save(quantizer.state_dict(), f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while another still talks through it
    finally:
        dist.destroy_process_group()


def test_amax_reduction_group_takes_the_max_over_ranks(tmp_path):
    """Two CPU ranks (gloo) see different amaxes; both seed, record and scale from the maximum."""
    mp.spawn(_reduction_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pt")
        assert_bitwise(state["amax_history"], torch.tensor([16.0, 4.0, 0.0]), f"rank {rank} history")
        assert_bitwise(state["scale"], torch.tensor(28.0), f"rank {rank} scale 448/16")


def _resolved_kernels(monkeypatch) -> list:
    from te_fuser import backend

    names, resolve = [], backend.resolve
    monkeypatch.setattr(backend, "resolve", lambda kernel, *a, **k: names.append(kernel) or resolve(kernel, *a, **k))
    return names


@pytest.mark.parametrize("algo", ["max", "most_recent", second_newest])
def test_a_call_updates_the_state_in_one_kernel(monkeypatch, algo):
    """On the deferred path (the backends without a cast that updates, or any backend
    with ``update_in_cast`` off) a cast leaves its update waiting until the state is
    read; then ``"max"`` and ``"most_recent"`` update with one delayed_scale_update
    call (one launch on a GPU), a callable algorithm with torch ops."""
    monkeypatch.setattr(DelayedScalingQuantizer, "update_in_cast", False)
    quantizer = DelayedScalingQuantizer(E4M3, amax_history_len=3, amax_compute_algo=algo)
    quantizer(with_amax(2.0))
    quantizer.scale  # noqa: B018 -- applies the first update
    names = _resolved_kernels(monkeypatch)
    quantizer(with_amax(4.0))
    cast = names[:]  # the cast alone: looked up, or its kept prepared cast taken without a look-up
    assert cast in ([], ["quantize_tensorwise"]), names
    assert_bitwise(quantizer.amax_history[:2], torch.tensor([4.0, 2.0]), "the read applied the update")
    fused = isinstance(algo, str)
    assert names == cast + (["delayed_scale_update"] if fused else []), names


def _quantizer_set():
    """Quantizers of three configurations: two of ``BATCH_FROM`` or more alike (one
    batch each), one of fewer (one update each); one with a callable algorithm."""
    from te_fuser.quantization.delayed import BATCH_FROM

    same = [DelayedScalingQuantizer(E4M3, amax_history_len=4) for _ in range(BATCH_FROM + 1)]
    other = [DelayedScalingQuantizer(E5M2, amax_history_len=4, margin=2) for _ in range(BATCH_FROM)]
    few = [DelayedScalingQuantizer(E4M3, amax_history_len=2, amax_compute_algo="most_recent")
           for _ in range(BATCH_FROM - 1)]
    callable_algo = [DelayedScalingQuantizer(E4M3, amax_history_len=3, amax_compute_algo=second_newest)]
    return same + other + few + callable_algo


@pytest.mark.parametrize("backend_name", ["auto", "triton"])
def test_waiting_updates_run_as_one_batch_per_configuration_bit_for_bit(monkeypatch, backend_name):
    """Casts of many quantizers between two reads of the state: the alike ones
    update with one ``delayed_scale_update_many`` per configuration, and every
    cast, scale and history is bit for bit what an update after each cast gives
    (inf, NaN, 0 and tiny amaxes included; the first cast seeds)."""
    import te_fuser as te

    monkeypatch.setattr(DelayedScalingQuantizer, "update_in_cast", False)  # the deferred path: batches
    special = [3.0, 0.5, INF, 7.0, 1e-40, 2.0, 0.0, NAN, 9.0, 1e30, 0.125, 6.0, 1.5]
    n = len(_quantizer_set())
    amaxes = [[special[(i * 5 + step * 3) % len(special)] for i in range(n)] for step in range(4)]
    previous = te.get_backend()
    te.set_backend(backend_name)
    try:
        _batch_against_one_by_one(monkeypatch, amaxes)
    finally:
        te.set_backend(previous)


def _many_calls(monkeypatch) -> list:
    """The calls of the batched update, one entry (its number of quantizers) per call."""
    import functools

    from te_fuser import backend

    calls, resolve = [], backend.resolve

    def counting(kernel, *args, **kwargs):
        choice = resolve(kernel, *args, **kwargs)
        if kernel != "delayed_scale_update_many":
            return choice
        fn = choice.fn

        @functools.wraps(fn)
        def counted(*a, **k):
            calls.append(len(a[0]))
            return fn(*a, **k)

        return dataclasses.replace(choice, fn=counted)

    monkeypatch.setattr(backend, "resolve", counting)
    return calls


def _batch_against_one_by_one(monkeypatch, amaxes):
    from te_fuser.quantization.delayed import BATCH_FROM

    batched, one_by_one = _quantizer_set(), _quantizer_set()
    calls = _many_calls(monkeypatch)
    for step, row in enumerate(amaxes):
        inputs = [with_amax(a).to(DEVICE) for a in row]
        got = [q(x) for q, x in zip(batched, inputs)]  # their updates wait
        for i, (q, x) in enumerate(zip(one_by_one, inputs)):
            want = q(x)
            q.scale  # noqa: B018 -- each updates after its cast (the first read also applies the batch's)
            assert_bitwise(got[i].rowwise.data, want.rowwise.data, f"step {step} quantizer {i} FP8 data")
            assert_bitwise(got[i].rowwise.scale_inv, want.rowwise.scale_inv, f"step {step} quantizer {i} scale_inv")
        # per step two batches: the first read of a one-by-one quantizer's state applies the
        # batched ones' waiting amaxes with its own (BATCH_FROM + 1 alike, and it), then the
        # BATCH_FROM of the second configuration; the BATCH_FROM - 1 of the third update one by one
        assert calls == [BATCH_FROM + 2, BATCH_FROM] * (step + 1), calls
    for i, (a, b) in enumerate(zip(batched, one_by_one)):
        for name in DelayedScalingQuantizer.STATE_TENSORS:
            assert_bitwise(a.state_tensors()[name], b.state_tensors()[name], f"quantizer {i} {name}")
        # where a GEMM reads a scale (cuBLASLt: 16-byte aligned; else it copies the scale per call)
        assert a.scale.data_ptr() % 16 == 0 and a.scale_inv.data_ptr() % 16 == 0, f"quantizer {i}"


def _drive(backend_name: str, algo, margin: int, fp8_dtype) -> list:
    """A quantizer through seeding, casts (zero, tiny, inf, NaN amaxes), an epilogue
    cast and calibration on one backend: per step the FP8 bytes and the state.
    CUDA tensors where there is a GPU (Triton runs on CPU tensors only interpreted)."""
    import te_fuser as te

    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = te.get_backend()
    te.set_backend(backend_name)
    try:
        q = DelayedScalingQuantizer(fp8_dtype, margin=margin, amax_history_len=4, amax_compute_algo=algo)
        steps = []
        for amax in [3.0, 0.0, f32(1e-40), INF, 7.0, NAN, 0.1, 448.0, 2.5, 1e4]:
            t = q(with_amax(amax).to(device), rowwise=True, columnwise=True)
            steps.append([t.rowwise.data, t.columnwise.data, t.rowwise.scale_inv])
            steps[-1] += [q.amax_history, q.scale, q.scale_inv, q.nonfinite_amax_count]
        x = with_amax(96.0).to(device)
        cast = q.epilogue_cast(x.device)
        quantize = te.backend.resolve("quantize_tensorwise", x.device).fn
        data, _, _ = quantize(x, cast.scale, cast.fp8_dtype, amax_out=cast.amax)
        t = q.adopt_epilogue_cast(cast, data, x.shape, x.dtype)
        steps.append([t.rowwise.data, t.rowwise.scale_inv, q.amax_history, q.scale, q.scale_inv])
        q.observe(with_amax(5.0).to(device))
        steps.append([q.amax_history, q.scale, q.scale_inv, q.nonfinite_amax_count])
        return steps
    finally:
        te.set_backend(previous)


@pytest.mark.parametrize("algo, margin, fp8_dtype", [("max", 0, E4M3), ("most_recent", 1, E5M2), ("max", 200, E4M3)])
def test_triton_backend_equals_reference_bit_for_bit(algo, margin, fp8_dtype):
    """The Triton update (and cast) against the reference through seeding, casts,
    an epilogue cast and calibration: FP8 bytes, history, scale, scale_inv, count."""
    got, want = _drive("triton", algo, margin, fp8_dtype), _drive("reference", algo, margin, fp8_dtype)
    for step, (g_step, w_step) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_step, w_step)):
            assert_bitwise(_one_nan(g), _one_nan(w), f"{algo} margin={margin} {fp8_dtype}: step {step}, item {i}")


def _one_nan(t: torch.Tensor) -> torch.Tensor:
    """fp32 NaNs as one pattern. The amax of a tensor holding a NaN is a NaN whose
    payload depends on how the reduction is computed: on the H200, torch's reduction
    in the reference cast and the Triton cast's integer maximum give different NaN
    bits (on CPU they agree). Only that payload may differ; every other bit must match."""
    if t.dtype != torch.float32:
        return t
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t)


# -- the cast that updates the state in the same call ----------------------------------


def _cast_with_update_from_the_reference(monkeypatch) -> list:
    """On a machine without the CUDA kernels: the delayed-scaling casts' prepared entry
    given a ``with_update`` composed of the backend's own cast and the reference
    update (what the CUDA entry computes in one call), so the quantizer's side of it
    runs here. Returns the list its calls are counted in."""
    import functools

    from te_fuser import backend
    from te_fuser.kernels.reference import delayed_scale_update_reference
    from te_fuser.quantization.delayed import _generic_tensorwise

    calls, resolve, wrapped = [], backend.resolve, {}

    def prepared(fn):
        def prepare(fp8_dtype):
            cast = _generic_tensorwise(fn, fp8_dtype)

            def with_update(x, scale, history, count, margin, algo_max, rowwise, columnwise, round_bf16=False,
                            sums_dtype=torch.float32):
                calls.append(x.shape)
                x = x.reshape(-1, x.shape[-1])  # as the CUDA entry: x of two or more dims as its 2-D flattening
                data, data_t, sums, amax = cast(x, scale, rowwise, columnwise, round_bf16, sums_dtype)
                state = delayed_scale_update_reference(history, amax, scale, count, fp8_dtype, margin,
                                                       "max" if algo_max else "most_recent")
                return (data, data_t, sums, amax, *state)

            cast.with_update = with_update
            return cast

        call = functools.wraps(fn)(lambda *a, **k: fn(*a, **k))
        call.prepare = prepare
        return call

    def resolving(kernel, *args, **kwargs):
        choice = resolve(kernel, *args, **kwargs)
        if kernel not in ("quantize_tensorwise", "quantize_tensorwise_column_sums"):
            return choice
        if id(choice) not in wrapped:
            wrapped[id(choice)] = (choice, dataclasses.replace(choice, fn=prepared(choice.fn)))
        return wrapped[id(choice)][1]

    monkeypatch.setattr(backend, "resolve", resolving)
    return calls


def _updating_entry(monkeypatch) -> list:
    """The cast entry that updates the state: the CUDA one on a GPU with the CUDA
    kernels (the auto backend), else the reference composition above."""
    from te_fuser.kernels import cuda

    if torch.cuda.is_available() and cuda.unavailable_reason() is None:
        return []
    return _cast_with_update_from_the_reference(monkeypatch)


def _updating_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("algo, margin, history_len, fp8_dtype",
                         [("max", 0, 4, E4M3), ("most_recent", 1, 1, E5M2), ("max", 130, 1024, E4M3)])
@pytest.mark.parametrize("layout", ["both copies", "both copies, separate launches", "row-wise",
                                    "column sums through bf16"])
def test_a_cast_that_updates_the_state_gives_the_deferred_bits(monkeypatch, algo, margin, history_len, fp8_dtype,
                                                               layout):
    """The cast and the update in one call against the cast, then the update at the
    next read (the deferred path): the FP8 bytes, the column sums and every state
    tensor bit for bit, through zero, tiny, inf and NaN amaxes and the seeding cast;
    nothing waits after a cast on the one-call path. On a GPU: the one-launch cast
    whose block 0 updates, and the separate launches (and the row-wise cast) with the
    update launched after them in the same call."""
    from te_fuser.kernels import cuda

    calls = _updating_entry(monkeypatch)
    device = _updating_device()
    if layout.endswith("separate launches") and not calls:
        previous = cuda.set_one_launch_casts(False)
        try:
            _one_call_against_deferred(algo, margin, history_len, fp8_dtype, layout, device)
        finally:
            cuda.set_one_launch_casts(previous)
        return
    _one_call_against_deferred(algo, margin, history_len, fp8_dtype, layout, device)
    if device == "cpu":
        # every cast in one call (the first one seeds: apart, or without a margin in a current-scaling cast)
        assert len(calls) == 10 - (margin == 0), calls


def _one_call_against_deferred(algo, margin: int, history_len: int, fp8_dtype, layout: str, device: str) -> None:
    one_call = DelayedScalingQuantizer(fp8_dtype, margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    deferred = DelayedScalingQuantizer(fp8_dtype, margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    deferred.update_in_cast = False
    deferred.seed_in_cast = False  # and seeds with an amax pass first
    sums = layout == "column sums through bf16"
    rowwise, columnwise = True, layout != "row-wise"
    for step, amax in enumerate([3.0, 0.0, f32(1e-40), INF, 7.0, NAN, 0.1, 448.0, 2.5, 1e4]):
        x = with_amax(amax, (64, 48)).to(device)
        x[7, 3] = amax / 3 if math.isfinite(amax) else 1.0
        outs = []
        for q in (one_call, deferred):
            if sums:  # an fp32 gradient cast as bf16 holds it, its sums as it came (the ops' call)
                t, col = q._lean_column_sums(x, rowwise, columnwise, True)
            else:
                t, col = q.cast(x, rowwise=rowwise, columnwise=columnwise), None
            outs.append((t, col))
        # a fresh quantizer without a margin seeds in a current-scaling cast, whose amax then waits
        seeding_cast = step == 0 and margin == 0
        assert one_call._pending == int(seeding_cast), f"step {step}: an amax waits on the one-call path"
        (got, got_sums), (want, want_sums) = outs
        where = f"step {step} (amax {amax})"
        assert_bitwise(got.rowwise.data, want.rowwise.data, f"{where}: FP8 data")
        assert_bitwise(got.rowwise.scale_inv, want.rowwise.scale_inv, f"{where}: scale_inv of the cast")
        if columnwise:
            assert_bitwise(got.columnwise.data, want.columnwise.data, f"{where}: transposed FP8 data")
        if sums:
            assert_bitwise(got_sums, want_sums, f"{where}: column sums")
        for name in DelayedScalingQuantizer.STATE_TENSORS:
            assert_bitwise(one_call.state_tensors()[name], deferred.state_tensors()[name], f"{where}: {name}")
        assert one_call.scale.data_ptr() % 16 == 0 and one_call.scale_inv.data_ptr() % 16 == 0, where


def test_the_one_call_path_leaves_a_reduced_amax_to_the_deferred_path(monkeypatch):
    """Under an amax reduction group the update must wait for every rank's amax: the
    one-call path declines (and casts nothing), the deferred path runs."""
    _updating_entry(monkeypatch)
    q = DelayedScalingQuantizer(E4M3)
    x = with_amax(2.0).to(_updating_device())
    q._move_state(x.device)  # (what a cast does first)
    cast = q._caster("quantize_tensorwise", x.device, None)
    monkeypatch.setattr(q, "amax_reduction_group", object())  # a process group of its own
    assert q._cast_and_update(cast, x, True, False, False) is None
    monkeypatch.setattr(q, "amax_reduction_group", None)
    assert q._cast_and_update(cast, x, True, False, False) is not None


@pytest.mark.parametrize("shape", [(64, 48), (4, 16, 48)], ids=["2-D", "3-D"])
def test_the_ops_lean_updating_cast_is_the_general_path_in_fewer_calls(monkeypatch, shape):
    """The ops' common cast (``cast`` and ``_lean_column_sums`` of a seeded quantizer,
    x as it comes) takes the backend's updating entry directly: the same bytes,
    sums and state tensors as the general path (``_cast``), step after step; and it
    declines with nothing changed (state, pending amaxes) where the general path
    must run: unseeded, under a reduction group, in evaluation."""
    from te_fuser.quantization import delayed

    calls = _updating_entry(monkeypatch)
    device = _updating_device()
    lean, general = DelayedScalingQuantizer(E4M3, amax_history_len=4), DelayedScalingQuantizer(E4M3, amax_history_len=4)
    monkeypatch.setattr(general, "_updating_cast", lambda *args: None)
    for step, amax in enumerate([3.0, 7.0, 0.5, 448.0]):
        x = with_amax(amax, shape).to(device)
        before = len(calls)
        got = [lean.cast(x, rowwise=True, columnwise=True),
               lean._lean_column_sums(x.float(), True, True, True)]
        want = [general.cast(x, rowwise=True, columnwise=True),
                general._lean_column_sums(x.float(), True, True, True)]
        (q, (qs, sums)), (w, (ws, wsums)) = got, want
        for a, b in ((q, w), (qs, ws)):
            assert a.shape == b.shape and a.dtype == b.dtype
            for mine, theirs in ((a.rowwise, b.rowwise), (a.columnwise, b.columnwise)):
                assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8)), step
                assert torch.equal(mine.scale_inv, theirs.scale_inv), step
        assert torch.equal(sums, wsums)
        for name in DelayedScalingQuantizer.STATE_TENSORS:
            assert torch.equal(getattr(lean, name), getattr(general, name)), (step, name)
        if device == "cpu" and step > 0:  # the first cast seeds (a current-scaling cast)
            assert len(calls) - before == 4, "both lean casts and the general path's took the updating entry"
    x = with_amax(2.0, shape).to(device)
    state = [getattr(lean, f"_{name}") for name in DelayedScalingQuantizer.STATE_TENSORS]
    monkeypatch.setattr(lean, "amax_reduction_group", object())  # a process group of its own
    assert lean._updating_cast(x, True, True, "quantize_tensorwise", False, torch.float32) is None
    monkeypatch.setattr(lean, "amax_reduction_group", None)
    monkeypatch.setattr(delayed, "EVALUATING", [True])
    assert lean._updating_cast(x, True, True, "quantize_tensorwise", False, torch.float32) is None
    assert DelayedScalingQuantizer(E4M3)._updating_cast(x, True, True, "quantize_tensorwise", False,
                                                        torch.float32) is None, "unseeded: the seeding path"
    assert all(getattr(lean, f"_{name}") is t for name, t in zip(DelayedScalingQuantizer.STATE_TENSORS, state)), \
        "a declined cast changes nothing"
    assert lean._pending == 0


def test_training_through_the_updating_casts_ends_within_the_band_of_bf16(monkeypatch):
    """Loss parity on the path a GPU takes: a model trained under delayed scaling with
    every seeded cast through the updating entry (the ops' lean path) ends within
    the FP8 band of the bf16 run, evaluated in bf16 and under the recipe (that
    model trains on the CPU: the reference composition of the entry, on any machine)."""
    import test_training

    calls = _cast_with_update_from_the_reference(monkeypatch)
    test_training.test_fp8_training_ends_within_the_band_of_bf16_evaluated_in_bf16_and_in_fp8("delayed")
    assert len(calls) > 100, f"the casts did not take the updating entry: {len(calls)} calls"


def test_a_training_loop_keeps_every_loss_bit_with_the_update_in_the_cast(monkeypatch):
    """The smoke GPT trained as users train it (fused AdamW, evaluations without FP8, a
    checkpoint resumed, recipe switches bf16 -> delayed -> current -> bf16): every
    loss the same bits with each delayed cast updating its state in the same call as
    with the updates deferred to the next read, and the one-call path taken."""
    from training_loops import gpt_losses

    calls = _updating_entry(monkeypatch)
    device = _updating_device()
    one_call = gpt_losses(device=device)
    if device == "cpu":
        assert calls, "the delayed casts did not take the one-call path"
    monkeypatch.setattr(DelayedScalingQuantizer, "update_in_cast", False)
    assert gpt_losses(device=device) == one_call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states move to a CUDA device")
@pytest.mark.parametrize("with_loaded", [False, True], ids=["fresh", "with_loaded"])
def test_placed_states_cast_as_states_moved_one_by_one(with_loaded):
    """``place_states``: fresh CPU states of several history lengths (made on the
    device) and with a loaded one among them (copied) move at once, each tensor on
    a 16-byte boundary (a GEMM reads a scale where it lies), and casting with them
    trains the state as moving each at its first cast."""
    from te_fuser.quantization.delayed import place_states

    def quantizers():
        out = [DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in (1, 5, 16)]
        loaded = DelayedScalingQuantizer(E5M2, amax_history_len=3)
        loaded.load_state_dict({"scale": torch.tensor(2.0), "scale_inv": torch.tensor(0.5),
                                "amax_history": torch.tensor([3.0, 1.0, 0.0]), "seeded": True,
                                "nonfinite_amax_count": torch.tensor(2)})
        return out + [loaded] if with_loaded else out

    placed, alone = quantizers(), quantizers()
    place_states(placed, torch.device("cuda"))
    for q, r in zip(placed, alone):
        for name in q.STATE_TENSORS:
            t = getattr(q, f"_{name}")  # as placed (a public read would hand out a copy of a shared tensor)
            assert t.is_cuda and t.data_ptr() % 16 == 0, name
            assert_bitwise(t.cpu(), getattr(r, name))
    torch.manual_seed(0)
    xs = [torch.randn(16, 32, device="cuda") * (i + 1) for i in range(3)]
    for x in xs:
        for q, r in zip(placed, alone):
            a, b = q.cast(x, rowwise=True, columnwise=True), r.cast(x, rowwise=True, columnwise=True)
            assert_bitwise(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8))
    for q, r in zip(placed, alone):
        for name, t in q.state_dict().items():
            assert (t == r.state_dict()[name]) if name == "seeded" else torch.equal(t, r.state_dict()[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states move to a CUDA device")
def test_placing_fresh_states_does_not_wait_for_the_gpu():
    """``place_states`` gives fresh quantizers the device's shared fresh state made
    before: no launch and no copy, so a plan's build in a switch step does not
    wait behind the GPU's queued work (the control, a read of a device value,
    does wait)."""
    from te_fuser.quantization.delayed import place_states

    def host_seconds(work) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead
        t0 = time.perf_counter()
        work()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return elapsed

    place_states([DelayedScalingQuantizer(E4M3, amax_history_len=16) for _ in range(2)],
                 torch.device("cuda"))  # the shared state, made once
    waiting = host_seconds(lambda: torch.zeros(1, device="cuda").item())
    quantizers = [DelayedScalingQuantizer(E4M3, amax_history_len=16) for _ in range(8)]
    placed = host_seconds(lambda: place_states(quantizers, torch.device("cuda")))
    assert all(q._scale.is_cuda for q in quantizers)
    assert waiting > 0.05 and placed < waiting / 4, (waiting, placed)


@pytest.mark.parametrize("lengths", [[1, 5, 16], [1024, 3, 4, 7, 5]])
def test_fresh_quantizers_share_one_fresh_state_that_nothing_writes(lengths):
    """``_bind_shared``: fresh quantizers of one history length hold the same four
    tensors (scale and inverse scale 1, history and count 0, made once per device
    and length). Casting rebinds a quantizer's state and leaves them fresh; a
    public read (the properties, ``state_tensors``, a CUDA graph's slot) hands out
    the quantizer's own copies first, so a holder that writes in place reaches
    neither the shared tensors nor another quantizer; each casts as a quantizer
    with a state of its own, bit for bit."""
    from te_fuser.quantization import delayed

    device = torch.device("cpu")
    group = [DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in lengths]
    alone = [DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in lengths]
    assert delayed._bind_shared(group, device)
    for q in group:
        shared = delayed._shared_fresh_state(device, q.amax_history_len)
        assert (q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count) == shared
        assert all(a is b for a, b in zip((q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count), shared))
        assert q._holds_fresh_state() and not q._borrows_state()
    held = group[1].state_tensors()  # a holder: copies of the quantizer's own
    assert held["amax_history"] is not delayed._shared_fresh_state(device, lengths[1])[2]
    held["amax_history"].fill_(5.0)
    held["scale"].fill_(3.0)
    group[2].scale.fill_(9.0)
    x = torch.randn(16, 32)
    for q, r in zip(group, alone):
        if q is group[1] or q is group[2]:
            continue
        a, b = q.cast(x, rowwise=True, columnwise=True), r.cast(x, rowwise=True, columnwise=True)
        assert_bitwise(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8))
        q._flush()
        r._flush()
        for name in q.STATE_TENSORS:
            assert_bitwise(getattr(q, name), getattr(r, name), name)
    for (_, n), (scale, scale_inv, history, count) in [(k, v) for k, v in delayed._SHARED_FRESH.items()
                                                        if k[0] == device]:
        assert scale.item() == scale_inv.item() == 1.0 and count.item() == 0 and not history.any(), n
    later = [DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in lengths]
    assert delayed._bind_shared(later, device)
    assert all(q._scale is delayed._shared_fresh_state(device, q.amax_history_len)[0] for q in later)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states move to a CUDA device")
def test_groups_placed_apart_share_the_fresh_state_and_cast_as_their_own():
    """Groups of fresh quantizers placed by separate builds hold the device's one
    fresh state per history length and cast as states moved one by one."""
    from te_fuser.quantization import delayed

    groups = [[DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in (1, 8, 16)] for _ in range(3)]
    alone = [[DelayedScalingQuantizer(E4M3, amax_history_len=n) for n in (1, 8, 16)] for _ in range(3)]
    x = torch.randn(16, 32, device="cuda")
    for group, others in zip(groups, alone):
        delayed.place_states(group, torch.device("cuda"))
        for q, r in zip(group, others):
            assert q._amax_history is groups[0][[1, 8, 16].index(q.amax_history_len)]._fresh[2]
            a, b = q.cast(x, rowwise=True, columnwise=True), r.cast(x, rowwise=True, columnwise=True)
            assert_bitwise(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8))
    for key, (scale, _, history, count) in delayed._SHARED_FRESH.items():
        assert scale.item() == 1.0 and not history.any() and count.item() == 0, key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states move to a CUDA device")
def test_no_shared_fresh_state_is_made_while_a_graph_is_captured(monkeypatch):
    """A state made inside a CUDA graph's capture would hold its fresh values only
    once the graph replays: place_states binds a shared state made before, or
    leaves the states where they are."""
    from te_fuser.quantization import delayed

    monkeypatch.setattr(delayed, "_SHARED_FRESH", {})
    device = torch.device("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    left = [DelayedScalingQuantizer(E4M3, amax_history_len=8) for _ in range(3)]
    with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        delayed.place_states(left, device)
    assert delayed._SHARED_FRESH == {} and all(q._scale.device.type == "cpu" for q in left)
    delayed.place_states([DelayedScalingQuantizer(E4M3, amax_history_len=8) for _ in range(2)], device)  # made outside
    served = [DelayedScalingQuantizer(E4M3, amax_history_len=8) for _ in range(3)]
    with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        delayed.place_states(served, device)
    torch.cuda.synchronize()
    for q in served:
        assert q._scale.is_cuda and q._scale.item() == q._scale_inv.item() == 1.0 and not q._amax_history.any()


def test_a_state_continued_or_loaded_is_not_fresh():
    """What place_states makes without a copy: a quantizer's own fresh state only;
    one continued from another quantizer, loaded, or seeded is copied."""
    fresh = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    assert fresh._holds_fresh_state()
    previous = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    previous.load_state_dict({"scale": torch.tensor(1.0), "scale_inv": torch.tensor(1.0),
                              "amax_history": torch.tensor([3.0, 0.0, 0.0, 0.0]), "seeded": False,
                              "nonfinite_amax_count": torch.tensor(0)})
    assert not previous._holds_fresh_state()
    continued = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    continued.carry_state_from(previous)
    assert not continued._holds_fresh_state()
    used = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    used.cast(torch.randn(8, 16))
    assert not used._holds_fresh_state()


def _borrowing_quantizers(recipe):
    """A fresh quantizer for each of three roles, borrowing its prototype's state,
    and the prototypes."""
    from te_fuser.quantization import QuantizerRole, quantizer_for
    from te_fuser.quantization import factory

    roles = [QuantizerRole(module_type="linear", tensor_type=t, name="fc") for t in ("input", "weight", "grad_output")]
    quantizers = [quantizer_for(recipe, role, borrow_state=True) for role in roles]
    prototypes = [factory._PROTOTYPES[(type(recipe), recipe.key, role.module_type, role.tensor_type)] for role in roles]
    return quantizers, prototypes


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_borrowed_fresh_states_are_each_quantizers_own_once_placed(device):
    """A plan's fresh copies borrow their prototype's fresh state until
    ``place_states``, which leaves none borrowing: on a GPU each takes the device's
    shared fresh state, elsewhere (and for one left alone) a new CPU state of its own.
    A copy continued from an earlier quantizer or given a loaded state keeps that
    state; the prototypes' tensors keep a fresh state's values; each then casts as a
    new quantizer does, bit for bit."""
    import te_fuser as te
    from te_fuser.quantization.delayed import place_states

    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    quantizers, prototypes = _borrowing_quantizers(recipe)
    for q, proto in zip(quantizers, prototypes):
        for name in q.STATE_TENSORS:
            assert getattr(q, name) is getattr(proto, name), name  # borrowed: no tensor made
    previous = DelayedScalingQuantizer(E4M3, amax_history_len=8)
    previous.cast(torch.full((4, 16), 3.0))
    quantizers[1].carry_state_from(previous)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in quantizers[1].state_dict().items()}
    place_states(quantizers, torch.device(device))
    assert not any(q._borrows_state() for q in quantizers)
    for q, proto in zip(quantizers, prototypes):
        for name in q.STATE_TENSORS:
            assert getattr(q, name) is not getattr(proto, name), name
        assert proto._holds_fresh_state() and proto._scale.item() == 1.0 and not proto._amax_history.any()
    for name, value in quantizers[1].state_dict().items():
        assert (value == state[name]) if name == "seeded" else torch.equal(value.cpu(), state[name]), name
    alone = DelayedScalingQuantizer(E4M3, amax_history_len=8)
    torch.manual_seed(0)
    for step in range(3):
        x = torch.randn(16, 32, device=device) * (step + 1)
        a, b = quantizers[0].cast(x, rowwise=True, columnwise=True), alone.cast(x, rowwise=True, columnwise=True)
        assert_bitwise(a.rowwise.data.view(torch.uint8), b.rowwise.data.view(torch.uint8), f"step {step}")
    for name, value in quantizers[0].state_dict().items():
        want = alone.state_dict()[name]
        assert (value == want) if name == "seeded" else torch.equal(value, want), name
    single, _ = _borrowing_quantizers(recipe)
    place_states(single[:1], torch.device(device))  # one quantizer: nothing placed, its own state all the same
    assert not single[0]._borrows_state() and single[0]._scale is not prototypes[0]._scale


def test_a_quantizer_made_without_borrowing_owns_its_state():
    """``quantizer_for`` without ``borrow_state`` (every caller but a plan's build)
    gives a quantizer its own fresh state at once."""
    import te_fuser as te
    from te_fuser.quantization import QuantizerRole, quantizer_for

    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    role = QuantizerRole(module_type="linear", tensor_type="input", name="fc")
    a, b = quantizer_for(recipe, role), quantizer_for(recipe, role)
    assert not a._borrows_state() and a._scale is not b._scale and a._amax_history is not b._amax_history


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states move to a CUDA device")
def test_a_switch_to_delayed_scaling_copies_no_fresh_state(monkeypatch):
    """The first training step under delayed scaling makes the fresh quantizers'
    states on the GPU without a copy (four a quantizer when each moves at its first
    cast), and trains the same bits as moving each quantizer at its first cast."""
    import te_fuser as te
    from te_fuser.quantization import delayed as delayed_module

    def train(place: bool):
        if not place:
            monkeypatch.setattr(delayed_module, "_place", lambda quantizers, device: None)
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.Linear(64, 64), te.ops.GELU(), te.ops.Linear(64, 64)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        x = torch.randn(32, 64, device="cuda")
        recipe = te.recipe.DelayedScaling(amax_history_len=16)
        losses, copies = [], None
        for step in range(3):
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                with te.autocast(recipe=recipe):
                    loss = model(x).float().square().mean()
                loss.backward()
            if step == 0:
                copies = sum(e.count for e in prof.key_averages() if e.key == "cudaMemcpyAsync")
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        monkeypatch.undo()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()], copies

    losses, params, copies = train(True)
    losses_alone, params_alone, copies_alone = train(False)
    assert_bitwise(losses, losses_alone)
    for p, q in zip(params, params_alone):
        assert_bitwise(p, q)
    # at least 5 fresh quantizers (2 inputs, 2 weights, a gradient): 20 copies become none
    assert copies + 4 * 5 <= copies_alone, (copies, copies_alone)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("first", [3.0, 0.0, f32(1e-40), 1e-30, INF, -INF, NAN, 448.0, 6e4, 3e38])
@pytest.mark.parametrize("layout", ["both copies", "row-wise", "column-wise", "column sums through bf16", "bf16 input"])
def test_a_first_cast_as_current_scaling_seeds_as_the_amax_pass(first, fp8_dtype, layout):
    """A fresh quantizer without a margin casts its first tensor as one current-scaling
    cast (``seed_in_cast``): the copies, their scale, the column sums and, after two
    more casts, every state tensor are those of seeding with an amax pass first, bit
    for bit, from first tensors whose amax is 0, subnormal, tiny (the scale overflows
    to the largest fp32), inf, NaN, or past the format's largest value."""
    quantizers = [DelayedScalingQuantizer(fp8_dtype, amax_history_len=4) for _ in range(2)]
    quantizers[1].seed_in_cast = False
    sums = layout == "column sums through bf16"
    rowwise, columnwise = layout != "column-wise", layout != "row-wise"
    for step, amax in enumerate([first, 5.0, 0.25]):
        x = with_amax(amax, (32, 48)).to(DEVICE)
        if layout == "bf16 input":
            x = x.bfloat16()
        outs = []
        for q in quantizers:
            if sums:
                t, col = q._lean_column_sums(x, rowwise, columnwise, True)
            else:
                t, col = q.cast(x, rowwise=rowwise, columnwise=columnwise), None
            outs.append((t, col))
        (got, got_sums), (want, want_sums) = outs
        for name in ("rowwise", "columnwise"):
            if getattr(want, name) is not None:
                assert_bitwise(getattr(got, name).data.view(torch.uint8), getattr(want, name).data.view(torch.uint8),
                               f"step {step}: {name}")
                assert_bitwise(getattr(got, name).scale_inv, getattr(want, name).scale_inv, f"step {step}: {name}")
        if sums:
            assert_bitwise(got_sums, want_sums, f"step {step}: sums")
    a, b = (q.state_dict() for q in quantizers)
    for name in a:
        assert (a[name] == b[name]) if name == "seeded" else torch.equal(a[name], b[name]), name


def test_a_training_loop_keeps_every_loss_bit_with_the_seeding_cast_and_placed_states(monkeypatch):
    """The smoke GPT trained as users train it (fused AdamW, evaluations without FP8, a
    checkpoint resumed into fresh quantizers, recipe switches bf16 -> delayed ->
    current -> bf16): every loss the same bits with fresh quantizers seeding in a
    current-scaling cast and (on a GPU) their states placed at once, as with
    an amax pass first and each state moved at its first cast."""
    from training_loops import gpt_losses

    from te_fuser.quantization import delayed as delayed_module

    device = _updating_device()
    fast = gpt_losses(device=device)
    monkeypatch.setattr(DelayedScalingQuantizer, "seed_in_cast", False)
    monkeypatch.setattr(delayed_module, "_place", lambda quantizers, device: None)
    assert gpt_losses(device=device) == fast


def _seeded(fp8, length, amaxes, margin=0, algo="max", device="cpu"):
    """A delayed-scaling quantizer on ``device`` that recorded ``amaxes`` (newest last)."""
    q = DelayedScalingQuantizer(fp8, margin=margin, amax_history_len=length, amax_compute_algo=algo, device=device)
    for amax in amaxes:
        x = torch.full((4, 16), amax, device=device)
        q.cast(x, rowwise=True, columnwise=False)
    q._flush()
    return q


def test_carry_states_together_gives_each_ones_own_carry_bit_for_bit():
    """A build's quantizers continue their predecessors together (carry_states): the
    same scale, inverse scale, history, count and seeded flag as each quantizer's own
    carry_state_from, for groups that grow and shrink the history, change the format,
    the margin or the algorithm, carry an inf amax's count and a 0 amax; a predecessor
    not seeded, not delayed, or with a callable algorithm, and a group of one, carry
    alone. The group's states are 16-byte aligned views (what the GEMM and the casts
    take as they are)."""
    from te_fuser.quantization.delayed import carry_states

    specs = [  # (previous: fp8, length, amaxes, margin, algo), (new: fp8, length, margin, algo)
        ((E4M3, 4, [1.5, 3.0, 0.25], 0, "max"), (E4M3, 8, 0, "max")),
        ((E4M3, 4, [2.0, 7.0, 0.5, 1.0, 9.0], 0, "max"), (E4M3, 8, 0, "max")),
        ((E4M3, 4, [0.0], 0, "max"), (E4M3, 8, 0, "max")),  # amax 0: the previous scale kept
        ((E4M3, 4, [3.0, float("inf"), 5.0], 0, "max"), (E4M3, 8, 0, "max")),  # a skipped inf, counted
        ((E4M3, 8, [1.0, 2.0, 3.0], 0, "max"), (E5M2, 2, 1, "most_recent")),
        ((E4M3, 8, [6.0, 0.125], 0, "max"), (E5M2, 2, 1, "most_recent")),
        ((E5M2, 3, [1.0], 2, "max"), (E4M3, 3, 3, "max")),  # a group of one
    ]
    together, alone, pairs = [], [], []
    for (pf, plen, amaxes, pmargin, palgo), (nf, nlen, nmargin, nalgo) in specs:
        previous = _seeded(pf, plen, amaxes, pmargin, palgo)
        for out in (together, alone):
            out.append(DelayedScalingQuantizer(nf, margin=nmargin, amax_history_len=nlen, amax_compute_algo=nalgo))
        pairs.append((together[-1], previous))
    unseeded = DelayedScalingQuantizer(E4M3, amax_history_len=4)
    custom = DelayedScalingQuantizer(E4M3, amax_history_len=4, amax_compute_algo=lambda h: h.max())
    current = Float8CurrentScalingQuantizer(E4M3)
    for previous in (unseeded, current, None):
        for out in (together, alone):
            out.append(DelayedScalingQuantizer(E4M3, amax_history_len=4))
        pairs.append((together[-1], previous))
    for out in (together, alone):
        out.append(custom if out is together else DelayedScalingQuantizer(E4M3, amax_history_len=4,
                                                                          amax_compute_algo=custom.amax_compute_algo))
    pairs.append((custom, pairs[0][1]))
    carry_states(pairs)
    for q, (_, previous) in zip(alone, pairs):
        q.carry_state_from(previous)
    for k, (a, b) in enumerate(zip(together, alone)):
        assert a.seeded == b.seeded, k
        for name in ("scale", "scale_inv", "amax_history", "nonfinite_amax_count"):
            assert_bitwise(getattr(a, f"_{name}"), getattr(b, f"_{name}"), f"quantizer {k} {name}")
    for q in together[:6]:  # the two groups of more than one: views of their blocks
        assert q._fresh is None and q._shared is None
        for t in (q._scale, q._scale_inv, q._amax_history, q._nonfinite_amax_count):
            assert t.data_ptr() % 16 == 0
    assert together[0]._scale.untyped_storage().data_ptr() == together[3]._scale.untyped_storage().data_ptr()
    assert int(together[3]._nonfinite_amax_count) == 1


@pytest.mark.parametrize("schedule", [("delayed", "delayed_margin", "delayed"), ("delayed", "delayed_e4m3_hist2")])
def test_a_switch_between_delayed_recipes_trains_as_each_quantizer_carried_alone(monkeypatch, schedule):
    """A model switched between delayed-scaling recipes (its quantizers carried
    together) trains to the same bits as with each quantizer carried alone."""
    import te_fuser as te
    from te_fuser.ops import fuser as fuser_module
    from te_fuser.quantization import delayed

    recipes = {"delayed": te.recipe.DelayedScaling(amax_history_len=4),
               "delayed_margin": te.recipe.DelayedScaling(amax_history_len=8, margin=1),
               "delayed_e4m3_hist2": te.recipe.DelayedScaling(amax_history_len=2, fp8_format=te.recipe.Format.E4M3)}
    groups = []

    def train(one_by_one: bool):
        if one_by_one:
            monkeypatch.setattr(fuser_module, "carry_states",
                                lambda pairs: [q.carry_state_from(p) for q, p in pairs])
        else:
            monkeypatch.setattr(fuser_module, "carry_states", delayed.carry_states)
            carry_group = delayed._carry_group
            monkeypatch.setattr(delayed, "_carry_group", lambda group, *a: (groups.append(len(group)),
                                                                               carry_group(group, *a)))
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for name in schedule:
            for _ in range(3):
                x = torch.randn(16, 32, generator=gen)
                with te.autocast(recipe=recipes[name]):
                    loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    losses_alone, params_alone = train(True)
    losses_together, params_together = train(False)
    assert groups and min(groups) >= 2, groups  # the switches carried their quantizers together
    assert_bitwise(losses_together, losses_alone, f"losses through {schedule}")
    for a, b in zip(params_together, params_alone):
        assert_bitwise(a, b, "parameters")
