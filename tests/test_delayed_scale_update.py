"""The delayed-scaling state update kernel (``delayed_scale_update``): the Triton
kernel, the CUDA kernel (on a Hopper GPU) and the reference against a float64
oracle of the contract, bit for bit.

The oracle (:func:`oracle`) works on Python floats: a float64 division rounded
once to fp32 is the IEEE fp32 division; each margin step of at most 2**64 is an
exact float64 division rounded once to fp32 (so a subnormal scale may round twice,
as the steps do). On CPU the Triton kernel runs under ``TRITON_INTERPRET=1``; on a
GPU the last tests run it compiled on CUDA tensors at the default history length.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from te_fuser.kernels import reference as ref
from te_fuser.kernels import cuda
from te_fuser.kernels.triton import scaling as tk
from tolerances import assert_bitwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
INF, NAN = math.inf, math.nan
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _many_as_one(amax_history, amax, scale, nonfinite_count, fp8_dtype, margin=0, algo="max", many=None):
    """``delayed_scale_update_many`` on this case between two others (the same
    configuration; another history, amax, scale and count each), row 1 returned;
    the neighbours' rows are checked against the one-quantizer reference, so a
    mix-up of rows shows."""
    others = [(amax_history.flip(0), amax * 2, scale * 3, nonfinite_count + 1),
              (amax_history * 0.5, torch.full_like(amax, INF), scale * 0.5, nonfinite_count + 2)]
    rows = [others[0], (amax_history, amax, scale, nonfinite_count), others[1]]
    out = (many or ref.delayed_scale_update_many_reference)(*map(list, zip(*rows)), fp8_dtype, margin, algo)
    for i in (0, 2):
        want = ref.delayed_scale_update_reference(*rows[i], fp8_dtype, margin, algo)
        for field, got, w in zip(("history", "scale", "scale_inv", "count"), (o[i] for o in out), want):
            assert_bitwise(got, w, f"delayed_scale_update_many: neighbour row {i} {field}")
    return tuple(o[1] for o in out)


IMPLEMENTATIONS = {"reference": ref.delayed_scale_update_reference, "triton": tk.delayed_scale_update,
                   "many": _many_as_one,
                   "triton many": functools.partial(_many_as_one, many=tk.delayed_scale_update_many)}
if cuda.unavailable_reason() is None:  # a Hopper GPU with the CUDA build: the CUDA kernels too
    IMPLEMENTATIONS["cuda"] = cuda.delayed_scale_update
    IMPLEMENTATIONS["cuda many"] = functools.partial(_many_as_one, many=cuda.delayed_scale_update_many)

# This call's amax: zero, non-finite, tiny (the quotient overflows: a subnormal and a
# normal one), ordinary, huge, and two whose scale under margin 200 is subnormal and
# rounds differently in steps than at once.
AMAXES = [0.0, INF, NAN, 1e-40, 5e-39, 3.0, 0.1, 1e30, 1.3266624398437094e-13, 3.976288428294422e-13]
MARGINS = [0, 1, 200]


def f32(value: float) -> float:
    """``value`` rounded once to fp32 (nearest even; subnormals and overflow to inf)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def div(a: float, b: float) -> float:
    """IEEE float64 division (inf for x/0, NaN for 0/0), where Python raises."""
    return (torch.tensor(a, dtype=torch.float64) / b).item()


def oracle(history: list[float], amax: float, prev_scale: float, count: int, fmax: float, margin: int, algo: str):
    """``(history, scale, scale_inv, count)`` after recording ``amax``, in float64.
    An inf or NaN ``amax`` is skipped: history and scale unchanged, counted."""
    if not amax < INF:  # inf or NaN
        return list(history), prev_scale, f32(div(1.0, prev_scale)), count + 1
    history = [amax] + history[:-1]
    if algo == "max":
        a = NAN if any(math.isnan(h) for h in history) else max(history)
    else:
        a = history[0]
    scale = prev_scale  # also for an inf or NaN already in the history: kept, not counted
    if a < INF and a > 0:
        scale = f32(div(fmax, a))
        exponent = margin
        while exponent > 0:
            step = min(exponent, 64)
            scale = f32(scale / 2.0**step)
            exponent -= step
        scale = FLT_MAX if scale == INF else scale
    return history, scale, f32(div(1.0, scale)), count


def _history(length: int, variant: int, gen: torch.Generator) -> list[float]:
    """Previous history: spread positive values, with zeros, an inf or a NaN inside
    (not in the last slot, which the shift drops)."""
    values = (torch.rand(length, generator=gen) * torch.exp2(torch.randint(-30, 30, (length,), generator=gen))).tolist()
    values = [f32(v) for v in values]
    if length > 1 and variant == 1:
        values[length // 2 - 1 if length > 2 else 0] = NAN
    elif length > 1 and variant == 2:
        values[0] = INF
    elif variant == 3:
        values = [0.0] * length
    return values


def _run(fn, history, amax, prev_scale, count, fp8_dtype, margin, algo, device=DEVICE):
    args = (
        torch.tensor(history, dtype=torch.float32, device=device),
        torch.tensor([amax], dtype=torch.float32, device=device),
        torch.tensor(prev_scale, dtype=torch.float32, device=device),
        torch.tensor(count, dtype=torch.int64, device=device),
    )
    before = [a.clone() for a in args]
    out = fn(*args, fp8_dtype, margin, algo)
    for old, kept, new in zip(args, before, out):
        assert new is not old and new.data_ptr() != old.data_ptr(), "the update returns new tensors"
        assert_bitwise(old, kept, "an input was written")
    return out


def _expected(history, amax, prev_scale, count, fp8_dtype, margin, algo):
    h, scale, scale_inv, n = oracle(history, amax, prev_scale, count, FMAX[fp8_dtype], margin, algo)
    return (torch.tensor(h, dtype=torch.float32), torch.tensor(scale, dtype=torch.float32),
            torch.tensor(scale_inv, dtype=torch.float32), torch.tensor(n, dtype=torch.int64))  # fmt: skip


def _check(name, fn, history, amax, fp8_dtype, margin, algo, prev_scale=0.37, count=5, device=DEVICE):
    amax, prev_scale = f32(amax), f32(prev_scale)  # what the fp32 tensors hold
    got = _run(fn, history, amax, prev_scale, count, fp8_dtype, margin, algo, device)
    want = _expected(history, amax, prev_scale, count, fp8_dtype, margin, algo)
    context = f"{name} L={len(history)} {algo} {fp8_dtype} margin={margin} amax={amax!r}"
    for field, g, w in zip(("history", "scale", "scale_inv", "nonfinite_count"), got, want):
        assert g.shape == w.shape, f"{context}: {field} shape {tuple(g.shape)}"
        assert_bitwise(g, w, f"{context}: {field}")


def test_oracle_anchors():
    """A few values worked by hand, so the oracle itself is pinned."""
    assert oracle([2.0, 1.0], 4.0, 0.5, 0, 448.0, 0, "max")[1:] == (112.0, f32(1 / 112), 0)
    assert oracle([8.0, 1.0], 4.0, 0.5, 0, 448.0, 1, "most_recent")[1] == 56.0  # 448 / 4 / 2
    assert oracle([0.0], 1e-40, 0.5, 0, 448.0, 1, "max")[1] == FLT_MAX  # inf / 2 stays inf: capped after
    assert oracle([NAN, 0.0], 3.0, 0.5, 2, 448.0, 0, "max")[1:] == (0.5, 2.0, 2)  # an old NaN: kept, uncounted
    assert oracle([2.0, NAN], 3.0, 0.5, 2, 448.0, 0, "max")[1:] == (f32(448 / 3), f32(3 / 448), 2)  # it left
    assert oracle([2.0, 1.0], INF, 0.5, 4, 448.0, 0, "max") == ([2.0, 1.0], 0.5, 2.0, 5)  # skipped, counted
    assert oracle([2.0, 1.0], NAN, 0.5, 4, 448.0, 0, "most_recent") == ([2.0, 1.0], 0.5, 2.0, 5)
    assert oracle([2.0], 0.0, 0.5, 0, 448.0, 0, "most_recent")[1] == 0.5  # amax 0 keeps the scale
    assert oracle([2.0], 4.0, 0.5, 0, 448.0, 200, "max")[1:] == (0.0, INF, 0)  # underflows to 0
    steps = oracle([0.0], 1.3266624398437094e-13, 1.0, 0, 448.0, 200, "max")[1]
    assert steps == 2 * 2.0**-149 and f32(div(448.0, 1.3266624398437094e-13) / 2.0**200) == 2.0**-149


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 5, 1024])
def test_update_matches_the_oracle(impl, fp8_dtype, algo, length):
    gen = torch.Generator().manual_seed(length)
    for i, (amax, margin) in enumerate(itertools.product(AMAXES, MARGINS)):
        history = _history(length, i % 4, gen)
        _check(impl, IMPLEMENTATIONS[impl], history, amax, fp8_dtype, margin, algo)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_update_edge_cases(impl):
    fn = IMPLEMENTATIONS[impl]
    for margin in (63, 64, 65, 129, 140, 256, 385, 100_000):  # steps of 64, subnormal results, many steps
        for amax in (1.0, 1e-30, 7e-20, 3e38):
            _check(impl, fn, [2.0, 1.0, 0.5], amax, E4M3, margin, "max")
    # a NaN anywhere in the window under "max"; its drop out of the window; negative entries
    _check(impl, fn, [1.0, NAN, 2.0, 3.0], 5.0, E4M3, 0, "max")
    _check(impl, fn, [1.0, 2.0, 3.0, NAN], 5.0, E4M3, 0, "max")
    _check(impl, fn, [1.0, NAN, 2.0, 3.0], 5.0, E4M3, 0, "most_recent")
    _check(impl, fn, [-7.0, -1.0], -2.0, E4M3, 0, "max")
    _check(impl, fn, [-7.0, 4.0, -1.0], 2.0, E5M2, 0, "max")
    _check(impl, fn, [-INF, -INF], -INF, E4M3, 0, "max")
    # previous scale 0 (margin underflow) and its reciprocal inf carried on; count large
    _check(impl, fn, [2.0], 0.0, E4M3, 0, "max", prev_scale=0.0, count=2**40)
    # a history of several blocks: the maximum, then a NaN, in the last one
    long = [1.0] * 2500
    long[2200] = 9.0
    _check(impl, fn, long, 3.0, E5M2, 0, "max")
    long[2300] = NAN
    _check(impl, fn, long, 3.0, E5M2, 0, "max")


def _chain(fn, amaxes, length, fp8_dtype, margin, algo, device=DEVICE) -> list:
    """The state after each of ``amaxes``, every update fed the previous one's
    outputs, from a fresh state (zeros, scale 1, count 0)."""
    state = (torch.zeros(length, device=device), torch.ones((), device=device), None,
             torch.zeros((), dtype=torch.int64, device=device))  # fmt: skip
    states = []
    for amax in amaxes:
        history, scale, _, count = state
        state = fn(history, torch.tensor([amax], device=device), scale, count, fp8_dtype, margin, algo)
        states.append(state)
    return states


def _oracle_chain(amaxes, length, fp8_dtype, margin, algo) -> list:
    state, states = ([0.0] * length, 1.0, 1.0, 0), []
    for amax in amaxes:
        state = oracle(state[0], f32(amax), state[1], state[3], FMAX[fp8_dtype], margin, algo)
        states.append(state)
    return states


# finite amaxes (a zero, a tiny one, a 5 and a 6 that must leave a window of 4) with
# inf and NaN amaxes between them: first, alone, in a run, and last
FINITE = [2.0, 6.0, 0.5, 0.0, 3.0, 1e-40, 1.0, 0.25, 5.0, 0.125, 0.75, 1.5]
MIXED = [INF, 2.0, 6.0, INF, 0.5, 0.0, NAN, INF, NAN, 3.0, 1e-40, 1.0, NAN, 0.25, 5.0, 0.125, 0.75, INF, 1.5, NAN]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_nonfinite_amax_is_skipped_as_if_never_seen(impl, algo, margin):
    """An inf or NaN amax leaves history, scale and scale_inv exactly as before it and
    only counts; the next finite amax continues as if the call had not happened. So
    the mixed run's states are the finite run's (which are the oracle's), repeated
    over each skipped call, with the count of skipped calls so far."""
    assert [a for a in MIXED if a < INF] == FINITE
    length, fn = 4, IMPLEMENTATIONS[impl]
    mixed = _chain(fn, MIXED, length, E4M3, margin, algo)
    finite = _chain(fn, FINITE, length, E4M3, margin, algo)
    for step, (got, want) in enumerate(zip(finite, _oracle_chain(FINITE, length, E4M3, margin, algo))):
        for field, g, w in zip(("history", "scale", "scale_inv", "count"), got, want):
            w = torch.tensor(w, dtype=g.dtype, device=g.device)
            assert_bitwise(g, w, f"{impl} {algo} margin={margin} finite step {step}: {field}")
    fresh = (torch.zeros(length), torch.tensor(1.0), torch.tensor(1.0))
    recorded, skipped = 0, 0
    for step, (amax, state) in enumerate(zip(MIXED, mixed)):
        if amax < INF:
            recorded += 1
        else:
            skipped += 1
        want = finite[recorded - 1][:3] if recorded else fresh
        context = f"{impl} {algo} margin={margin} step {step} (amax {amax}, {skipped} skipped so far)"
        for field, g, w in zip(("history", "scale", "scale_inv"), state[:3], want):
            assert_bitwise(g, w.to(g.device), f"{context}: {field}")
        assert state[3].item() == skipped, f"{context}: count {state[3].item()}"


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_nonfinite_in_the_history_keeps_the_scale_uncounted(impl):
    """State from before the skip rule may hold an inf or NaN: under "max" it keeps the
    scale until it leaves the window, and a finite amax is still not counted."""
    fn = IMPLEMENTATIONS[impl]
    for old in (INF, NAN):
        history, scale, count = [old, 2.0, 1.0], 0.5, 3
        for amax in (4.0, 8.0, 1.0):  # inf/NaN in slots 1, 2, then dropped
            _check(impl, fn, history, amax, E4M3, 0, "max", prev_scale=scale, count=count)
            history, scale, _, count = oracle(history, amax, scale, count, 448.0, 0, "max")
        assert scale == 56.0 and count == 3  # 448 / 8 once the old value left; nothing counted


def test_old_state_is_not_written():
    """FP8 tensors keep the quantizer's scale_inv of their cast: the update must not
    write it (nor any input) in place."""
    from te_fuser.quantization import DelayedScalingQuantizer

    for name in [n for n in IMPLEMENTATIONS if n in ("reference", "triton", "cuda")]:  # the backends
        with _backend(name):
            q = DelayedScalingQuantizer(E4M3, amax_history_len=3)
            first = q(torch.full((4, 16), 2.0, device=DEVICE))
            kept = first.rowwise.scale_inv.clone()
            state = {k: v.clone() for k, v in vars(q).items() if isinstance(v, torch.Tensor)}
            olds = {k: v for k, v in vars(q).items() if isinstance(v, torch.Tensor)}
            q(torch.full((4, 16), 64.0, device=DEVICE))
            assert_bitwise(first.rowwise.scale_inv, kept, f"{name}: the first tensor's scale_inv")
            for k, old in olds.items():
                assert getattr(q, k) is not old, f"{name}: {k} was not rebound"
                assert_bitwise(old, state[k], f"{name}: old {k} written in place")


def test_launcher_errors_name_the_argument():
    h, a, s, n = torch.zeros(4), torch.zeros(1), torch.ones(()), torch.zeros((), dtype=torch.int64)
    cases = [
        ((h.double(), a, s, n), {}, "amax_history must be torch.float32"),
        ((h, a, s, n.float()), {}, "nonfinite_count must be torch.int64"),
        ((h, torch.zeros(2), s, n), {}, "amax must have one element"),
        ((torch.zeros(0), a, s, n), {}, "amax_history must be 1-D and not empty"),
        ((h, a, s, n), {"margin": -1}, "margin must be an integer >= 0"),
        ((h, a, s, n), {"algo": "mean"}, "algo must be one of"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            tk.delayed_scale_update(*args, E4M3, **kwargs)
    with pytest.raises(ValueError, match="fp8_dtype"):
        tk.delayed_scale_update(h, a, s, n, torch.bfloat16)
    with pytest.raises(ValueError, match="algo must be one of"):
        ref.delayed_scale_update_reference(h, a, s, n, E4M3, algo="mean")


class _backend:
    """``te.set_backend(name)`` for a block, then the previous choice again."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        import te_fuser as te

        self.previous = te.get_backend()
        te.set_backend(self.name)

    def __exit__(self, *exc):
        import te_fuser as te

        te.set_backend(self.previous)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not CUDA, reason="the compiled kernel needs a CUDA GPU")
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_compiled_update_at_history_1024_matches_reference_and_oracle(fp8_dtype, algo):
    gen = torch.Generator().manual_seed(1024)
    for i, (amax, margin) in enumerate(itertools.product(AMAXES, MARGINS)):
        history = _history(1024, i % 4, gen)
        for name, fn in IMPLEMENTATIONS.items():
            _check(f"cuda {name}", fn, history, amax, fp8_dtype, margin, algo, device="cuda")


@pytest.mark.skipif(not CUDA, reason="the compiled kernel needs a CUDA GPU")
def test_compiled_update_in_a_quantizer_matches_reference():
    """A default-length (1024) quantizer on CUDA tensors, triton backend against
    reference: every cast's FP8 bytes and the state after it, bit for bit."""
    from te_fuser.quantization import DelayedScalingQuantizer

    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(64, 256, device="cuda", generator=gen).bfloat16() * s for s in (1, 30, 0.01, 0, 4, 1e4)]
    inputs[4][3, 7] = INF
    runs = {}
    for name in [n for n in IMPLEMENTATIONS if n in ("reference", "triton", "cuda")]:  # the backends
        with _backend(name):
            q = DelayedScalingQuantizer(E4M3, margin=1)
            runs[name] = []
            for x in inputs:
                t = q(x, rowwise=True, columnwise=True)
                state = [q.amax_history, q.scale, q.scale_inv, q.nonfinite_amax_count]
                runs[name].append([t.rowwise.data, t.columnwise.data, t.rowwise.scale_inv, *state])
    for step, (got, want) in enumerate(zip(runs["triton"], runs["reference"])):
        for field, g, w in zip(("data", "data_t", "scale_inv used", "history", "scale", "scale_inv", "count"),
                               got, want):
            assert_bitwise(g, w, f"step {step}: {field}")


@pytest.mark.skipif(cuda.unavailable_reason() is not None, reason="the CUDA kernels need a Hopper GPU and the CUDA build")
@pytest.mark.parametrize("n", [1, 31, 32, 33, 70])
def test_cuda_many_reads_each_quantizer_where_it_is(n):
    """The CUDA batched update of ``n`` quantizers (one launch per 32): every row
    bit for bit the single reference update of that quantizer's own tensors, which
    it leaves unwritten; the scales 16 bytes apart; one-element amaxes, scales and
    counts of other shapes (odd n) and a history that is a strided view are taken."""
    gen = torch.Generator().manual_seed(n)
    length = 7
    rows = []
    for i in range(n):
        history = torch.tensor(_history(length, i % 4, gen), dtype=torch.float32)
        amax = torch.tensor([f32(AMAXES[i % len(AMAXES)])], dtype=torch.float32)
        rows.append((history, amax, torch.tensor(f32(0.37 * (i + 1))), torch.tensor(i, dtype=torch.int64)))
    margin, algo = (200, "max") if n % 2 else (3, "most_recent")
    on_gpu = [tuple(t.cuda() for t in row) for row in rows]
    if n % 2:
        on_gpu = [(h, a.reshape(1, 1), s.reshape(1), c.reshape(1)) for h, a, s, c in on_gpu]
    wide = torch.zeros(length, 2, device="cuda")
    wide[:, 0] = on_gpu[0][0]
    on_gpu[0] = (wide[:, 0], *on_gpu[0][1:])
    kept = [tuple(t.clone() for t in row) for row in on_gpu]
    out = cuda.delayed_scale_update_many(*map(list, zip(*on_gpu)), E5M2, margin, algo)
    assert out[0].shape == (n, length) and out[1].stride() == (4,) and out[2].stride() == (4,)
    for i, row in enumerate(rows):
        want = ref.delayed_scale_update_reference(*row, E5M2, margin, algo)
        for field, got, w in zip(("history", "scale", "scale_inv", "count"), (o[i] for o in out), want):
            assert_bitwise(got.cpu(), w, f"n={n} row {i} {field}")
        assert out[1][i].data_ptr() % 16 == 0 and out[2][i].data_ptr() % 16 == 0, f"n={n} row {i}"
        for old, before in zip(on_gpu[i], kept[i]):
            assert_bitwise(old, before, f"n={n} row {i}: an input was written")


@pytest.mark.skipif(cuda.unavailable_reason() is not None, reason="the CUDA kernels need a Hopper GPU and the CUDA build")
def test_cuda_many_errors_name_the_argument():
    h, a, s, c = (torch.zeros(4, device="cuda"), torch.zeros(1, device="cuda"), torch.ones((), device="cuda"),
                  torch.zeros((), dtype=torch.int64, device="cuda"))
    many = cuda.delayed_scale_update_many
    cases = [
        (([h, torch.zeros(5, device="cuda")], [a, a], [s, s], [c, c]), "do not stack"),
        (([h], [a, a], [s], [c]), "equally long"),
        (([h], [a.double()], [s], [c]), "one-element fp32 amaxes"),
        (([h], [a], [s], [c.float()]), "int64 counts"),
        (([], [], [], []), "equally long and not empty"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            many(*args, E4M3)
    with pytest.raises(ValueError, match="margin must be an integer >= 0"):
        many([h], [a], [s], [c], E4M3, margin=-1)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        many([h.cpu()], [a.cpu()], [s.cpu()], [c.cpu()], E4M3)
