"""Triton activations, activation gradients and the fused ``dact_dbias``."""

from __future__ import annotations

import pytest
import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["gelu", "relu", "silu", "swiglu"]


def _x(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = -0.3 + 2.5 * torch.randn(shape, generator=gen)
    x.view(-1)[:4] = torch.tensor([0.0, -30.0, 30.0, 1e-3])  # flat and saturated regions
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,dtype", [((13, 96), torch.float32), ((2, 5, 64), torch.bfloat16),
                                         ((7, 34), torch.float64)])
def test_activation_and_grad_match_reference(kind, shape, dtype):
    x = _x(shape, dtype)
    y = tk.activation(x, kind)
    y_ref = ref.activation_reference(x, kind)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert_close(y, y_ref, torch.float32, f"activation {kind}")
    dy = _x(y.shape, dtype, seed=1)
    dx = tk.activation_grad(dy, x, kind)
    dx_ref = ref.activation_grad_reference(dy, x, kind)
    assert dx.dtype == dx_ref.dtype and dx.shape == x.shape
    assert_close(dx, dx_ref, torch.float32, f"activation_grad {kind}")


@pytest.mark.parametrize("kind", KINDS)
def test_dact_dbias_matches_unfused(kind):
    """dx equals activation_grad; dbias equals its column sums (fp64 reference);
    300 rows span several row splits and a partial last one."""
    x = _x((300, 40), seed=2)
    dy = _x((300, 20 if kind == "swiglu" else 40), seed=3)
    dx, dbias = tk.dact_dbias(dy, x, kind)
    dx_ref = ref.activation_grad_reference(dy.double(), x.double(), kind)
    assert_close(dx, dx_ref, torch.float32, f"dact_dbias dx {kind}")
    assert dbias.shape == (40,)
    assert_close(dbias, dx_ref.sum(dim=0), torch.float32, f"dact_dbias dbias {kind}", scaled=True)


def test_dact_dbias_leading_dims():
    x = _x((3, 9, 64), seed=4)
    dy = _x((3, 9, 64), seed=5)
    dx, dbias = tk.dact_dbias(dy, x, "gelu")
    dx_ref = ref.activation_grad_reference(dy.double(), x.double(), "gelu")
    assert_close(dx, dx_ref, torch.float32, "dx 3-D")
    assert_close(dbias, dx_ref.sum(dim=(0, 1)), torch.float32, "dbias 3-D", scaled=True)


def test_activation_errors():
    x = _x((4, 6))
    with pytest.raises(ValueError, match="activation: must be one of"):
        tk.activation(x, "tanh")
    with pytest.raises(ValueError, match="even last dimension"):
        tk.activation(x[:, :5], "swiglu")
    with pytest.raises(ValueError, match="dy must have shape"):
        tk.activation_grad(x, x, "swiglu")
    with pytest.raises(TypeError, match="x must be one of"):
        tk.dact_dbias(x, x.to(torch.int32), "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dact_dbias_swiglu_odd_shapes_and_views(dtype):
    """SwiGLU on odd shapes (an odd number of gate columns, so the up half starts
    at an odd column; rows over several splits), inputs given as transposed views
    and with leading dims: dx in the op's dtype as the reference rounds it, dbias
    its column sums."""
    cases = [(_x((2 * gate_cols, rows), dtype, seed=rows).t(), _x((gate_cols, rows), dtype, seed=rows + 1).t())
             for rows, gate_cols in ((37, 27), (131, 5))]  # (rows, 2 * gate_cols), strided
    cases.append((_x((3, 7, 18), dtype, seed=8), _x((3, 7, 9), dtype, seed=9)))
    for x, dy in cases:
        dx, dbias = tk.dact_dbias(dy, x, "swiglu")
        dx_ref, dbias_ref = ref.dact_dbias_reference(dy, x, "swiglu")
        context = f"dact_dbias swiglu {dtype} {tuple(x.shape)} contiguous={x.is_contiguous()}"
        assert dx.dtype == x.dtype and dx.shape == x.shape, context
        assert_close(dx, dx_ref, dtype, f"{context} dx")
        assert_close(dbias, dbias_ref, torch.float32 if dtype == torch.float32 else dtype, f"{context} dbias",
                     scaled=True)


@pytest.mark.parametrize("kind", ["gelu", "silu", "swiglu"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_activation_rounds_once_to_out_dtype(kind, out_dtype):
    x = (torch.randn(13, 96) * 3 - 0.5).to(out_dtype).to(DEVICE)
    y = tk.activation(x, kind, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    # One rounding of the fp32 result (the fp32 values themselves differ from
    # torch's in the last bits: the kernel's tanh is exp-based).
    assert_close(y, ref.activation_reference(x, kind).to(y.device), out_dtype, f"{kind} -> {out_dtype}")


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_dact_dbias_in_bf16_rounds_dx_once_and_sums_the_rounded_values(kind):
    x = (torch.randn(67, 96) * 2).to(torch.bfloat16).to(DEVICE)
    dy = torch.randn(67, 48 if kind == "swiglu" else 96).to(torch.bfloat16).to(DEVICE)
    dx, dbias = tk.dact_dbias(dy, x, kind)
    assert dx.dtype == torch.bfloat16 and dbias.dtype == torch.float32
    dx_ref, _ = ref.dact_dbias_reference(dy, x, kind)
    assert_close(dx, dx_ref.to(dx.device), torch.bfloat16, f"dact_dbias dx {kind}")
    # dbias is exactly the fp32 sum of the dx the kernel wrote (up to summation order)
    assert_close(dbias, dx.float().sum(dim=0), torch.float32, f"dact_dbias dbias {kind}", scaled=True)


@pytest.mark.parametrize("kind,params", [("clamped_swiglu", (0.75, 1.702, 1.0)), ("situglu", (4.0, 0.75))])
def test_parametrized_gated_kinds_on_odd_shapes_and_views(kind, params):
    """ClampedSwiGLU and SiTU-GLU (their parameters compile-time constants) on an odd
    number of gate columns, a transposed view and leading dims, forward, backward and
    dact_dbias against the reference; other parameter values give other results
    (the kernels read them, not the defaults)."""
    cases = [(_x((2 * 27, 37), seed=11).t(), _x((27, 37), seed=12).t()),
             (_x((3, 7, 18), torch.bfloat16, seed=13), _x((3, 7, 9), torch.bfloat16, seed=14))]
    for x, dy in cases:
        context = f"{kind} {x.dtype} {tuple(x.shape)} contiguous={x.is_contiguous()}"
        assert_close(tk.activation(x, kind, params=params), ref.activation_reference(x, kind, params=params),
                     torch.float32, f"{context} y")
        assert_close(tk.activation_grad(dy, x, kind, params=params),
                     ref.activation_grad_reference(dy, x, kind, params=params), torch.float32, f"{context} dx")
        dx, dbias = tk.dact_dbias(dy, x, kind, params=params)
        dx_ref, dbias_ref = ref.dact_dbias_reference(dy, x, kind, params=params)
        assert dx.dtype == x.dtype and dx.shape == x.shape, context
        assert_close(dx, dx_ref, x.dtype, f"{context} dact_dbias dx")
        assert_close(dbias, dbias_ref, "column_sums_fp32" if x.dtype == torch.float32 else x.dtype,
                     f"{context} dbias", scaled=True)
    x = cases[0][0]
    assert not torch.allclose(tk.activation(x, kind, params=params), tk.activation(x, kind))


@pytest.mark.parametrize("kind", KINDS + ["srelu", "geglu"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, None])
def test_activation_reduces_the_amax_of_its_output(kind, out_dtype):
    """``amax_out``: amax(|y|) of y as returned (after the rounding to out_dtype), the
    value a current-scaling cast of y computes first, in the kernel's one pass; the
    output itself unchanged. The reference's the same for its own y."""
    x = _x((37, 96), torch.float32, seed=3)
    plain = tk.activation(x, kind, out_dtype=out_dtype)
    amax = torch.full((1,), -1.0, device=DEVICE)  # overwritten, not folded into
    y = tk.activation(x, kind, out_dtype=out_dtype, amax_out=amax)
    assert torch.equal(y, plain)
    assert torch.equal(amax, y.float().abs().amax().reshape(1)), (amax, y.float().abs().amax())
    ref_amax = torch.empty(1, device=DEVICE)
    y_ref = ref.activation_reference(x, kind, out_dtype=out_dtype, amax_out=ref_amax)
    assert torch.equal(ref_amax, y_ref.float().abs().amax().reshape(1))


def test_activation_amax_of_a_nan_and_of_nothing():
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]], device=DEVICE)
    amax = torch.empty(1, device=DEVICE)
    tk.activation(x, "gelu", amax_out=amax)
    assert amax.isnan().all(), "a NaN in y is the amax (the casts' bit maximum: NaN above inf)"
    empty = torch.empty(0, 8, device=DEVICE)
    for fn in (tk.activation, ref.activation_reference):
        amax.fill_(5.0)
        fn(empty, "gelu", amax_out=amax)
        assert amax.item() == 0.0


def test_activation_amax_out_must_be_one_fp32_element_beside_x():
    x = _x((4, 8))
    for fn in (tk.activation, ref.activation_reference):
        with pytest.raises(ValueError, match="activation: amax_out must be None or a one-element float32 tensor, "
                                             "got torch.float32 tensor of 2 elements"):
            fn(x, "gelu", amax_out=torch.empty(2, device=DEVICE))
        with pytest.raises(ValueError, match="activation: amax_out must be None or a one-element float32 tensor, "
                                             "got torch.bfloat16 tensor of 1 elements"):
            fn(x, "gelu", amax_out=torch.empty(1, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS + ["srelu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dact_dbias_reduces_the_amax_of_its_gradient(kind, dtype):
    """``amax_out``: amax(|dx|) of dx as returned (rounded to x's dtype), folded over
    every program's slab of rows (more rows than one tile); dx and dbias unchanged.
    The reference's the same for its own dx."""
    x = _x((83, 96), dtype, seed=5)
    dy = _x((83, 48 if kind in ("swiglu", "geglu") else 96), dtype, seed=6)
    dx_plain, db_plain = tk.dact_dbias(dy, x, kind)
    amax = torch.full((1,), -1.0, device=DEVICE)  # overwritten, not folded into
    dx, db = tk.dact_dbias(dy, x, kind, amax_out=amax)
    assert torch.equal(dx, dx_plain) and torch.equal(db, db_plain)
    assert torch.equal(amax, dx.float().abs().amax().reshape(1)), (amax, dx.float().abs().amax())
    ref_amax = torch.empty(1, device=DEVICE)
    dx_ref, _ = ref.dact_dbias_reference(dy, x, kind, amax_out=ref_amax)
    assert torch.equal(ref_amax, dx_ref.float().abs().amax().reshape(1))


def test_dact_dbias_amax_of_a_nan_of_nothing_and_its_checks():
    x = torch.tensor([[1.0, 2.0, -2.0, 0.5]], device=DEVICE)
    dy = torch.tensor([[1.0, float("nan"), 3.0, 0.5]], device=DEVICE)
    amax = torch.empty(1, device=DEVICE)
    tk.dact_dbias(dy, x, "gelu", amax_out=amax)
    assert amax.isnan().all(), "a NaN in dx is the amax (the casts' bit maximum: NaN above inf)"
    empty = torch.empty(0, 8, device=DEVICE)
    for fn in (tk.dact_dbias, ref.dact_dbias_reference):
        amax.fill_(5.0)
        fn(empty, empty, "gelu", amax_out=amax)
        assert amax.item() == 0.0
        with pytest.raises(ValueError, match="dact_dbias: amax_out must be None or a one-element float32 tensor, "
                                             "got torch.float32 tensor of 2 elements"):
            fn(x, x, "gelu", amax_out=torch.empty(2, device=DEVICE))
