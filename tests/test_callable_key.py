"""Callables inside recipes: explicit keys, module-level names, lifetime tokens."""

from __future__ import annotations

import gc
import warnings

import pytest

from te_fuser import recipe as R
from te_fuser.callable_key import FallbackChurnDetector, callable_key, keyed, strip_fallback_tokens


def module_algo(history):
    return history.max()


@keyed("amax-p99")
def keyed_algo(history):
    return history.max()


class Algo:
    def __call__(self, history):
        return history.max()

    def method(self, history):
        return history.max()


def test_explicit_key_by_decorator_and_argument():
    assert "amax_compute_algo=key:amax-p99" in str(R.DelayedScaling(amax_compute_algo=keyed_algo))
    lam = lambda h: h.max()  # noqa: E731
    r1 = R.DelayedScaling(amax_compute_algo=lam, amax_compute_algo_key="mine")
    r2 = R.DelayedScaling(amax_compute_algo=lambda h: h.max(), amax_compute_algo_key="mine")
    assert str(r1) == str(r2) and "amax_compute_algo=key:mine" in str(r1)
    assert str(R.DelayedScaling(amax_compute_algo=keyed("other")(lam))) != str(r1)
    with pytest.raises(ValueError, match="keyed"):
        keyed("")
    with pytest.raises(TypeError, match="callable"):
        keyed("x")(3)


def test_module_level_function_is_named_by_module_and_qualname():
    key = callable_key(module_algo)
    assert key == f"{__name__}:module_algo"
    assert str(R.DelayedScaling(amax_compute_algo=module_algo)) == str(R.DelayedScaling(amax_compute_algo=module_algo))


def test_closures_lambdas_methods_and_instances_get_lifetime_tokens():
    def make(k):
        def algo(history):
            return history.max() * k

        return algo

    c1, c2 = make(1), make(2)
    k1, k2 = callable_key(c1), callable_key(c2)
    assert k1.startswith("fallback:") and "make.<locals>.algo#" in k1 and k1 != k2
    assert callable_key(c1) == k1  # stable for the object's lifetime
    obj = Algo()
    assert callable_key(obj) == callable_key(obj) and callable_key(obj).startswith("fallback:")
    # a bound method is re-created at each attribute access but keys by its instance
    assert callable_key(obj.method) == callable_key(obj.method)
    assert callable_key(obj.method) != callable_key(Algo().method)
    for fn in (c1, obj, obj.method, lambda h: h):
        r = R.DelayedScaling(amax_compute_algo=fn)
        assert "amax_compute_algo=fallback:" in str(r)


def test_live_callables_never_share_a_key_even_after_one_is_freed():
    seen, addresses = set(), set()
    reused = 0
    survivors = []
    for i in range(200):
        fn = lambda h, i=i: h  # noqa: E731
        reused += id(fn) in addresses
        addresses.add(id(fn))
        key = callable_key(fn)
        assert key not in seen, "a fallback token was reused"
        seen.add(key)
        if i % 2:
            survivors.append(fn)  # keep some alive, free the others
        del fn  # no cycle holds a lambda: freed here (its weak reference's callback runs), its address free again
    # the case guarded: a freed callable's address handed to a new one (a full collection
    # each round would make the same point at about 0.2 s a round in a loaded process)
    assert reused, "no freed callable's address was taken again: the case this test guards did not occur"
    gc.collect()
    assert len({callable_key(f) for f in survivors}) == len(survivors)


def test_unkeyed_callables_keep_working():
    calls = []
    r = R.DelayedScaling(amax_compute_algo=lambda h: calls.append(1) or h.max())
    assert callable(r.amax_compute_algo) and r == r


def test_fresh_lambda_per_activation_warns_exactly_once():
    detector = FallbackChurnDetector("Sequential")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            r = R.DelayedScaling(amax_compute_algo=lambda h: h.max())
            detector.observe(str(r))
    churn = [w for w in caught if "re-fuses" in str(w.message)]
    assert len(churn) == 1
    assert "<lambda>" in str(churn[0].message) and "keyed" in str(churn[0].message)


def test_real_changes_and_keyed_callables_do_not_warn():
    detector = FallbackChurnDetector()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10):
            detector.observe(str(R.DelayedScaling(margin=i % 3)))
        for _ in range(10):
            detector.observe(str(R.DelayedScaling(amax_compute_algo=keyed("k")(lambda h: h.max()))))
        algo = lambda h: h.max()  # noqa: E731
        for _ in range(10):
            detector.observe(str(R.DelayedScaling(amax_compute_algo=algo)))


def test_strip_fallback_tokens():
    a = callable_key(lambda h: h)
    b = callable_key(lambda h: h)
    assert a != b and strip_fallback_tokens(a) == strip_fallback_tokens(b)
