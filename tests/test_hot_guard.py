"""The compiled hot path (``te_fuser/ops/hot_guard.c``): it loads, it takes the
hits without entering Python, and under every condition that selects a plan it
decides exactly as the Python path does."""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import io
import os
import subprocess
import sys
import tempfile
import weakref

import pytest
import torch

import te_fuser as te
from te_fuser.ops import hot_guard
from te_fuser.ops.fuser import OperationFuser
from te_fuser.ops import fusers_of

H = 32
CURRENT = te.recipe.Float8CurrentScaling()
DELAYED = te.recipe.DelayedScaling(amax_history_len=4)


def model(seed: int = 0) -> te.ops.Sequential:
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.RMSNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))


def python_path_only(m: te.ops.Sequential) -> te.ops.Sequential:
    """``m`` with every fuser on the Python path (the reference the guard must agree with)."""
    m.groups()
    for f in fusers_of(m):
        f._guard, f.entry = None, f.run
    return m


def test_the_compiled_guard_loads_here():
    assert hot_guard.unavailable_reason() is None, hot_guard.unavailable_reason()
    m = model()
    with te.autocast(recipe=CURRENT):
        m(torch.randn(4, H))
    (f,) = fusers_of(m)
    assert f.entry is f._guard and f._guard.armed


def test_hits_do_not_enter_the_python_path(monkeypatch):
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        y0 = m(x)
    calls = []
    python_run = OperationFuser.run

    def counted(self, *args):
        calls.append(args)
        return python_run(self, *args)

    monkeypatch.setattr(OperationFuser, "run", counted)
    hits = m.fusion_stats().hits
    for _ in range(5):
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):  # new but equal: the same state
            y = m(x)
        assert torch.equal(y, y0)
    assert calls == [] and m.fusion_stats().hits == hits + 5
    with torch.no_grad(), te.autocast(recipe=CURRENT):  # a miss: once through Python, then armed again
        m(x)
        m(x)
    assert len(calls) == 1


@contextlib.contextmanager
def frozen(m):
    for p in m.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in m.parameters():
            p.requires_grad_(True)


@contextlib.contextmanager
def evaluating(m):
    m.eval()
    try:
        yield
    finally:
        m.train()


@contextlib.contextmanager
def replaced_weight(m):
    """The second linear's weight replaced by an equal new Parameter (it stays)."""
    m[3].linear.weight = torch.nn.Parameter(m[3].linear.weight.detach().clone())
    yield


@contextlib.contextmanager
def hooked(m):
    handle = m[2].register_forward_hook(lambda module, args, out: out * 1.0)
    try:
        yield
    finally:
        handle.remove()


def conditions(m, device="cpu"):
    """(name, context factory, input maker): each selects a plan, or repeats one."""
    return [
        ("current", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("current again", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("an equal recipe", lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling()), lambda x: x),
        ("no grad", lambda: _both(torch.no_grad(), te.autocast(recipe=CURRENT)), lambda x: x),
        ("grad again", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("input requires grad", lambda: te.autocast(recipe=CURRENT), lambda x: x.clone().requires_grad_(True)),
        ("frozen parameters", lambda: _both(frozen(m), te.autocast(recipe=CURRENT)), lambda x: x),
        ("frozen, input requires grad", lambda: _both(frozen(m), te.autocast(recipe=CURRENT)),
         lambda x: x.clone().requires_grad_(True)),
        ("eval", lambda: _both(evaluating(m), te.autocast(recipe=CURRENT)), lambda x: x),
        ("train again", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("torch.autocast bf16",
         lambda: _both(torch.autocast(device, dtype=torch.bfloat16), te.autocast(recipe=CURRENT)), lambda x: x),
        ("torch.autocast off", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("a bf16 input", lambda: te.autocast(recipe=CURRENT), lambda x: x.bfloat16()),
        ("fewer rows", lambda: te.autocast(recipe=CURRENT), lambda x: x[:3]),
        ("the rows again", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("a replaced parameter", lambda: _both(replaced_weight(m), te.autocast(recipe=CURRENT)), lambda x: x),
        ("a forward hook", lambda: _both(hooked(m), te.autocast(recipe=CURRENT)), lambda x: x),
        ("the hook removed", lambda: te.autocast(recipe=CURRENT), lambda x: x),
        ("delayed", lambda: te.autocast(recipe=DELAYED), lambda x: x),
        ("delayed again", lambda: te.autocast(recipe=DELAYED), lambda x: x),
        ("calibrating", lambda: te.autocast(enabled=False, calibrating=True, recipe=DELAYED), lambda x: x),
        ("high precision", lambda: te.autocast(enabled=False), lambda x: x),
        ("no te.autocast", contextlib.nullcontext, lambda x: x),
    ]


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_guard_decides_as_the_python_path_under_every_condition(device):
    guarded, reference = model().to(device), python_path_only(model()).to(device)
    torch.manual_seed(1)
    x = torch.randn(6, H, device=device)
    for (name, ctx_g, make_x), (_, ctx_r, _) in zip(conditions(guarded, device), conditions(reference, device)):
        outs = []
        for m, ctx in ((guarded, ctx_g), (reference, ctx_r)):
            xx = make_x(x)
            with ctx():
                y = m(xx)
                y2 = m(xx)  # the repeat: a hit on both paths
            outs.append((y.detach(), y2.detach()))
        sg, sr = guarded.fusion_stats(), reference.fusion_stats()
        assert (sg.builds, sg.hits, sg.key) == (sr.builds, sr.hits, sr.key), f"{name}: {sg} vs {sr}"
        for a, b in zip(outs[0], outs[1]):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: outputs differ"
    assert guarded.fusion_stats().builds >= 10


def test_an_op_run_by_another_model_in_between_is_noticed():
    """The model's autocast state is the same object before and after: only the
    quantizer-install epoch tells that its plan's quantizers are gone."""
    torch.manual_seed(1)
    x = torch.randn(6, H)
    results = []
    for m in (model(), python_path_only(model())):
        other = python_path_only(te.ops.Sequential(m[1]))  # shares the model's first Linear
        with te.autocast(recipe=DELAYED):
            m(x)
            m(x)
            with te.autocast(recipe=CURRENT):
                other(x)  # installs its own quantizers on the shared op
            y = m(x)
        stats = m.fusion_stats()
        results.append((stats.builds, stats.hits, y.detach()))
    assert results[0][:2] == results[1][:2] == (2, 1)
    assert torch.equal(results[0][2], results[1][2])


def test_a_replaced_parameter_and_a_new_hook_are_seen_on_the_compiled_path():
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        m(x)
        m(x)
        new = torch.nn.Parameter(torch.zeros(H, H))
        m[3].linear.weight = new
        y = m(x)
        torch.testing.assert_close(y, m[3].bias.expand(4, H))
        calls = []
        handle = m[0].register_forward_pre_hook(lambda module, args: calls.append(1))
        m(x)
        m(x)
        handle.remove()
        m(x)
    assert calls == [1, 1]
    (f,) = fusers_of(m)
    assert f._guard.armed and f._flat_params[-2] is new


def test_replacing_the_parameters_disarms():
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        m(x)
        (f,) = fusers_of(m)
        assert f._guard.armed
        f._flat_params = list(f._flat_params)
        assert not f._guard.armed
        m(x)
        assert f._guard.armed


def test_copies_and_pickles_get_a_guard_of_their_own():
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        y = m(x)
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        for twin in (copy.deepcopy(m), torch.load(buffer, weights_only=False)):
            (f,) = fusers_of(twin)
            assert f._guard is not None and f._guard is not fusers_of(m)[0]._guard
            assert torch.equal(twin(x), y) and torch.equal(twin(x), y)
            assert f._guard.armed and twin.fusion_stats().hits >= 1


def test_a_non_tensor_input_gets_the_python_paths_error():
    errors = []
    for m in (model(), python_path_only(model())):
        with te.autocast(recipe=CURRENT):
            m(torch.randn(4, H))
            with pytest.raises(Exception) as info:
                m([1.0] * H)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_a_fuser_and_its_guard_are_collected():
    m = model()
    with te.autocast(recipe=CURRENT):
        m(torch.randn(4, H))
    ref = weakref.ref(fusers_of(m)[0])
    del m
    gc.collect()
    assert ref() is None


def test_null_plan_returns_its_first_argument():
    null_plan = hot_guard.guard_module().null_plan
    x = torch.randn(2)
    assert null_plan(x, 1, 2, 3) is x
    with pytest.raises(TypeError, match="at least one"):
        null_plan()


def test_te_fuser_hot_guard_0_runs_the_python_path():
    code = (
        "import torch, te_fuser as te\n"
        "from te_fuser.ops import hot_guard\n"
        "m = te.ops.Sequential(te.ops.Linear(8, 8))\n"
        "with te.autocast(recipe=te.recipe.Float8CurrentScaling()):\n"
        "    m(torch.randn(2, 8)); m(torch.randn(2, 8))\n"
        "f = m.groups()[0]\n"
        "print(hot_guard.unavailable_reason(), f._guard is None, f.entry == f.run, m.fusion_stats().hits)\n"
    )
    env = dict(os.environ, TE_FUSER_HOT_GUARD="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["disabled", "by", "TE_FUSER_HOT_GUARD=0", "True", "True", "1"]


def test_a_bad_te_fuser_hot_guard_value_names_the_variable():
    code = "import te_fuser as te\nte.ops.Sequential(te.ops.Linear(8, 8)).groups()\n"
    env = dict(os.environ, TE_FUSER_HOT_GUARD="maybe")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TE_FUSER_HOT_GUARD" in out.stderr


def test_a_one_group_model_keeps_its_python_forward_and_its_signature():
    """(torch.compile's Dynamo traces it: a C callable in its place would not trace.)"""
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        y = m(x)
        assert "forward" not in m.__dict__
        assert torch.equal(m(x=x), y)
        assert list(inspect.signature(m.forward).parameters) == ["x", "extra_inputs"]
        seen = []
        handle = m.register_forward_hook(lambda module, args, out: seen.append(out))
        m(x)
        handle.remove()
        assert len(seen) == 1 and torch.equal(seen[0], y)


def test_an_extra_input_to_a_one_group_model_gets_the_python_paths_error():
    errors = []
    for m in (model(), python_path_only(model())):
        with te.autocast(recipe=CURRENT):
            m(torch.randn(4, H))
            with pytest.raises(ValueError) as info:
                m(torch.randn(4, H), torch.randn(4, H))
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "extra input" in errors[0]


def test_changing_the_model_makes_its_groups_again_at_once():
    """(torch.compile's tracing must find them made.)"""
    m, x = model(), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        m(x)
        old = m._fast_fuser
        m.append(te.ops.GELU())
        assert m._fast_fuser is not None and m._fast_fuser is not old
        expected = python_path_only(model().append(te.ops.GELU()))(x)
        y = m(x)
    assert torch.equal(y, expected)


def test_a_model_with_a_plain_module_between_groups_arms_every_guard():
    m = te.ops.Sequential(te.ops.Linear(H, H), torch.nn.Tanh(), te.ops.Linear(H, H))
    with te.autocast(recipe=CURRENT):
        m(torch.randn(4, H))
        m(torch.randn(4, H))
    assert all(f._guard.armed for f in fusers_of(m))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moving_the_model_to_the_gpu_is_noticed():
    results = []
    x = torch.randn(4, H)
    for m in (model(), python_path_only(model())):
        with te.autocast(recipe=CURRENT):
            m(x)
            m(x)
            m.cuda()
            y = m(x.cuda())
            m(x.cuda())
        stats = m.fusion_stats()
        results.append((stats.builds, stats.hits, y.cpu()))
    assert results[0][:2] == results[1][:2] == (2, 2)
    assert torch.equal(results[0][2], results[1][2])


def test_a_subclass_with_its_own_forward_keeps_it():
    class Doubled(te.ops.Sequential):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    m = Doubled(te.ops.RMSNorm(H), te.ops.Linear(H, H), te.ops.GELU(), te.ops.Linear(H, H))
    reference, x = python_path_only(model()), torch.randn(4, H)
    with te.autocast(recipe=CURRENT):
        for _ in range(3):
            assert torch.equal(m(x), 2 * reference(x))
    assert "forward" not in m.__dict__ and fusers_of(m)[0]._guard.armed


def test_an_unwritable_cache_builds_in_a_temporary_folder(tmp_path):
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the cache folder would go")
    code = ("from te_fuser.ops import hot_guard\n"
            "print(hot_guard.unavailable_reason(), hot_guard.guard_module().__file__)\n")
    env = dict(os.environ, TE_FUSER_CACHE_DIR=str(blocked))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason, path = out.stdout.split()
    assert reason == "None" and path.startswith(tempfile.gettempdir()) and "te_fuser_hot_guard" in path
