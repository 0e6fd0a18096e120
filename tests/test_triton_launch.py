"""The direct launch of kept Triton kernels (kernels/triton/_launch.py): the same
results as the JIT's own path, a new specialization wherever Triton's would
differ (alignment, an integer's divisibility, a constexpr, a dtype), and the
JIT's path under the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from te_fuser.kernels.triton import _launch as tl_launch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@triton.jit
def _scaled_copy_kernel(x_ptr, y_ptr, n, stride, factor, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(x_ptr + offs * stride, mask=ok, other=0.0).to(tl.float32) * factor
    if NEGATE:
        v = -v
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=ok)


def _run(x: torch.Tensor, n: int, stride: int, factor: float, negate: bool, block: int = 64) -> torch.Tensor:
    y = torch.zeros(n, dtype=x.dtype, device=x.device)
    tl_launch.launch(_scaled_copy_kernel, (triton.cdiv(n, block),), x, y, n, stride, factor, BLOCK=block,
                     NEGATE=negate, num_warps=2)
    return y


def _want(x: torch.Tensor, n: int, stride: int, factor: float, negate: bool) -> torch.Tensor:
    v = x[: n * stride: stride].float() * factor
    return (-v if negate else v).to(x.dtype)


CASES = [  # (offset of x's data in elements, n, stride, factor, negate, dtype)
    (0, 256, 1, 0.5, False, torch.float32),
    (0, 256, 1, 2.0, False, torch.float32),  # the same specialization again
    (1, 256, 1, 2.0, False, torch.float32),  # x 4 bytes off a 16-byte boundary
    (0, 250, 1, 2.0, False, torch.float32),  # n not a multiple of 16
    (0, 1, 1, 2.0, False, torch.float32),  # n == 1
    (0, 96, 2, 2.0, True, torch.float32),  # another constexpr, stride 2
    (0, 256, 1, 2.0, False, torch.bfloat16),  # another dtype
]


def test_every_specialization_gives_the_jits_results():
    base = torch.arange(1024, dtype=torch.float32, device=DEVICE) - 300.0
    for offset, n, stride, factor, negate, dtype in CASES:
        x = base.to(dtype)[offset:]
        got = _run(x, n, stride, factor, negate)
        assert torch.equal(got, _want(x, n, stride, factor, negate)), (offset, n, stride, factor, negate, dtype)


@pytest.mark.skipif(not GPU, reason="compiled kernels need a CUDA GPU (the interpreter takes the JIT's path)")
def test_a_kept_specialization_launches_directly_and_a_new_one_compiles():
    x = torch.randn(4096, device="cuda")
    _run(x, 4096, 1, 1.5, False)  # seen: kept
    before = tl_launch.direct_launches()
    again = _run(x, 4096, 1, 1.5, False)
    assert tl_launch.direct_launches() == before + 1
    old = tl_launch.set_direct(False)
    try:
        jit = _run(x, 4096, 1, 1.5, False)
    finally:
        tl_launch.set_direct(old)
    assert torch.equal(again, jit)
    before = tl_launch.direct_launches()
    # misaligned and not divisible by 16 (a key no other test launches): a first launch
    shifted = _run(x[1:], 4001, 1, 1.5, False)
    assert tl_launch.direct_launches() == before
    assert torch.equal(shifted, _want(x[1:], 4001, 1, 1.5, False))


@pytest.mark.skipif(GPU, reason="checks the interpreter's path")
def test_the_interpreter_takes_the_jits_path():
    x = torch.randn(128)
    before = tl_launch.direct_launches()
    for _ in range(2):
        assert torch.equal(_run(x, 128, 1, 3.0, False), _want(x, 128, 1, 3.0, False))
    assert tl_launch.direct_launches() == before


def test_the_key_tells_apart_what_triton_specializes_on():
    """Two argument lists get one key only when Triton would compile them alike."""
    key = tl_launch._arg_key
    x = torch.empty(64, dtype=torch.float32)
    same = [(x, 32, 2.5), (x[4:], 48, -1.0)]  # aligned tensors, i32 multiples of 16, floats
    assert key(same[0]) == key(same[1])
    differ = [
        (x[1:], 32, 2.5),  # 4 bytes off a 16-byte boundary
        (x.to(torch.bfloat16), 32, 2.5),  # another dtype
        (x, 1, 2.5),  # the value 1
        (x, 33, 2.5),  # not a multiple of 16
        (x, 2**32, 2.5),  # i64
        (x, 2**63 + 16, 2.5),  # u64
        (x, 32, 2),  # an int where a float was
    ]
    keys = [key(same[0])] + [key(a) for a in differ]
    assert len(set(keys)) == len(keys)
    assert key((x, True)) != key((x, False)) and key((x, None)) != key((x, 0))
    assert key((x, "a string")) is None  # another kind: the JIT decides


def test_an_empty_chain_of_launch_hooks_is_no_hook():
    """Newer Triton keeps its launch hooks as chains that are always there; only a
    chain holding a hook (or a plain hook) sends launches through the JIT."""
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    assert not tl_launch._hooked()
    hook = lambda *args, **kwargs: None  # noqa: E731
    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert tl_launch._hooked()
        finally:
            chain.remove(hook)
    else:  # Triton whose hook is a plain attribute
        runtime.launch_enter_hook = hook
        try:
            assert tl_launch._hooked()
        finally:
            runtime.launch_enter_hook = chain
    assert not tl_launch._hooked()


def test_the_launchers_host_helpers_agree_with_triton():
    """The launchers size their grids and blocks with plain-Python ``cdiv`` and
    ``next_power_of_2`` (Triton's are ``ConstexprFunction``s, microseconds a call):
    the same values as Triton's own on every size a launcher meets."""
    from te_fuser.kernels.triton._common import cdiv, next_power_of_2

    sizes = [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 1000, 1023, 1024, 1025, 4096, 2**31 - 1, 2**31, 2**33 + 5]
    for n in sizes:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
