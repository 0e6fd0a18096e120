"""The cuda backend's ``dact_dbias`` (``activation_kernels.cu``) on the GPU: the
unary kinds against the reference (dx within the dtype's tolerance, dbias the fp32
sums of the returned dx) on the 16-byte and the element paths, 2-D and 3-D, the
same bits from the lean entry and on every run; the gated and parametrized kinds,
a dy of another dtype, another output dtype and an ``amax_out`` through the Triton kernel; the lean
entry's hand-backs; the checked path's errors; a GPT trained through it."""

from __future__ import annotations

import pytest
import torch

from gpt_testing import CONFIG, step_per_auto_entry
from te_fuser.kernels import reference as ref
from test_activations import _x
from tolerances import assert_bitwise, assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda dact_dbias kernel runs on a CUDA GPU")

UNARY = ["gelu", "relu", "silu", "qgelu", "srelu"]


def _cuda():
    from te_fuser.kernels import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return cuda


@pytest.mark.parametrize("kind", UNARY)
@pytest.mark.parametrize("shape", [(70, 40), (33, 36), (2, 65, 128), (300, 8)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_dact_dbias_matches_the_reference(kind, shape, dtype):
    cuda = _cuda()
    x = _x(shape, seed=2).to(dtype).cuda()
    dy = _x(shape, seed=3).to(dtype).cuda()
    dx, dbias = cuda.dact_dbias(dy, x, kind)
    context = f"dact_dbias {kind} {shape} {dtype}"
    assert dx.shape == x.shape and dx.dtype == dtype and dbias.shape == (shape[-1],) and dbias.dtype == torch.float32
    if dtype == torch.float32:
        want = ref.activation_grad_reference(dy.double(), x.double(), kind)
        assert_close(dx, want, torch.float32, context)
    else:
        want, _ = ref.dact_dbias_reference(dy, x, kind)
        assert_close(dx, want, dtype, context)
    ours = dx.double().reshape(-1, shape[-1]).sum(dim=0)
    assert_close(dbias, ours, "column_sums_fp32", "dbias of the returned dx " + context, scaled=True)
    _, dbias_ref = ref.dact_dbias_reference(dy, x, kind)
    assert_close(dbias, dbias_ref, dtype if dtype != torch.float32 else "column_sums_fp32", "dbias " + context,
                 scaled=True)
    lean = cuda.dact_dbias.lean(dy, x, kind)
    again = cuda.dact_dbias(dy, x, kind)
    for got in (lean, again):
        assert_bitwise(got[0], dx, "dx " + context)
        assert_bitwise(got[1], dbias, "dbias " + context)


@pytest.mark.parametrize("kind,params,dy_dtype,out_dtype", [
    ("geglu", None, torch.bfloat16, None),
    ("clamped_swiglu", (7.0, 1.702, 1.0), torch.bfloat16, None),
    ("gelu", None, torch.float32, None),
    ("gelu", None, torch.bfloat16, torch.float32),
])
def test_what_the_kernel_does_not_compute_goes_to_triton(kind, params, dy_dtype, out_dtype):
    cuda = _cuda()
    from te_fuser.kernels import triton as tk

    x = _x((40, 64), seed=4).to(torch.bfloat16).cuda()
    dy = _x((40, 32 if kind in ("geglu", "clamped_swiglu") else 64), seed=5).to(dy_dtype).cuda()
    got = cuda.dact_dbias(dy, x, kind, out_dtype, params)
    want = tk.dact_dbias(dy, x, kind, out_dtype, params)
    for a, b in zip(got, want):
        assert_bitwise(a, b, f"{kind} {dy_dtype} -> {out_dtype}")
    assert cuda.dact_dbias.lean(dy, x, kind, out_dtype, params) is None


def test_an_amax_out_goes_to_triton():
    """The Triton kernel reduces dx's amax as it writes it; the cuda kernel does not."""
    cuda = _cuda()
    from te_fuser.kernels import triton as tk

    x = _x((40, 64), seed=4).to(torch.bfloat16).cuda()
    dy = _x((40, 64), seed=5).to(torch.bfloat16).cuda()
    amax, amax_tk = torch.empty(1, device="cuda"), torch.empty(1, device="cuda")
    got = cuda.dact_dbias(dy, x, "gelu", amax_out=amax)
    want = tk.dact_dbias(dy, x, "gelu", amax_out=amax_tk)
    for a, b in zip((*got, amax), (*want, amax_tk)):
        assert_bitwise(a, b, "gelu with amax_out")
    assert torch.equal(amax, got[0].float().abs().amax().reshape(1))
    assert cuda.dact_dbias.lean(dy, x, "gelu", amax_out=amax) is None


def test_the_lean_entry_hands_back_what_the_checked_path_must_see():
    cuda = _cuda()
    x = _x((16, 32), seed=6).to(torch.bfloat16).cuda()
    dy = _x((16, 32), seed=7).to(torch.bfloat16).cuda()
    lean = cuda.dact_dbias.lean
    cases = {
        "x not contiguous": (dy, x.t().contiguous().t(), "gelu", None, None),
        "dy fp32": (dy.float(), x, "gelu", None, None),
        "on the CPU": (dy.cpu(), x.cpu(), "gelu", None, None),
        "float64": (dy.double(), x.double(), "gelu", None, None),
        "dy of another shape": (dy[:, :16].contiguous(), x, "gelu", None, None),
        "a gated kind": (dy[:, :16].contiguous(), x, "geglu", None, None),
        "parameters": (dy, x, "gelu", None, (1.0,)),
        "another output dtype": (dy, x, "gelu", torch.float32, None),
        "0-d": (dy[0, 0].clone(), x[0, 0].clone(), "gelu", None, None),
    }
    for name, args in cases.items():
        assert lean(*args) is None, name


def test_the_checked_path_names_what_is_wrong():
    cuda = _cuda()
    x = _x((16, 32), seed=8).to(torch.bfloat16).cuda()
    with pytest.raises(ValueError, match=r"dact_dbias: dy must have shape \(16, 32\)"):
        cuda.dact_dbias(x[:, :8], x, "gelu")
    with pytest.raises(RuntimeError, match="the cuda backend needs dy on a CUDA device"):
        cuda.dact_dbias(x.cpu(), x, "gelu")
    with pytest.raises(ValueError, match="activation"):
        cuda.dact_dbias(x, x, "not_a_kind")
    empty = torch.zeros(0, 24, dtype=torch.bfloat16, device="cuda")
    dx, dbias = cuda.dact_dbias(empty, empty, "gelu")
    assert dx.shape == (0, 24) and torch.equal(dbias, torch.zeros(24, device="cuda"))


def test_a_gpt_trains_through_it(monkeypatch):
    """The GPT's MLP backward under the auto entry 'cuda' takes the lean entry and
    trains as under Triton's kernel: the same loss; the gradients within the FP8
    gradients' tolerance (a dx one rounding apart may cast to a neighbouring FP8
    value in the backward GEMMs' operands). Under delayed scaling: current
    scaling's backward asks for dx's amax, which only Triton's kernel reduces."""
    cuda = _cuda()
    from te_fuser import recipe

    runs, calls = step_per_auto_entry("dact_dbias", ["triton", "cuda"], cuda.dact_dbias, monkeypatch,
                                      recipe.DelayedScaling())
    assert len(calls) >= CONFIG.n_layer and all(calls), calls
    assert torch.equal(runs["triton"][0], runs["cuda"][0])
    for name, grad in runs["cuda"][1].items():
        assert_close(grad, runs["triton"][1][name], torch.float8_e5m2, f"gradient {name}", scaled=True)
