"""TransformerEngine's activations beyond GELU/ReLU/SiLU/SwiGLU (QGELU, SReLU and the
gated GLU, GEGLU, QGEGLU, ReGLU, SReGLU): the float64 reference against autograd and
the closed forms, the Triton kernels against the reference, and the fusion rules'
handling of activations the GEMM epilogue does not apply. (Every op under every
recipe against float64: tests/test_ops.py; fused against unfused:
tests/test_fusion_rules.py.)"""

from __future__ import annotations

import pytest
import torch

import te_fuser as te
from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk
from te_fuser.kernels.formats import GLU_GATES
from tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_KINDS = ["qgelu", "srelu", "glu", "geglu", "qgeglu", "reglu", "sreglu"]


def _x(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = -0.3 + 2.5 * torch.randn(shape, generator=gen)
    x.view(-1)[:4] = torch.tensor([0.0, -30.0, 30.0, 1e-3])  # flat and saturated regions
    return x.to(dtype)


def _closed_form(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Each kind written out with torch's own functions (TE's formulas)."""
    f = torch.nn.functional
    unary = {"qgelu": lambda t: t * torch.sigmoid(1.702 * t), "srelu": lambda t: f.relu(t) ** 2,
             "sigmoid": torch.sigmoid, "gelu": lambda t: f.gelu(t, approximate="tanh"), "relu": f.relu}
    if kind in GLU_GATES:
        a, b = x.chunk(2, dim=-1)
        return unary[GLU_GATES[kind]](a) * b
    return unary[kind](x)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_reference_matches_the_closed_form_and_autograd(kind):
    x = _x((5, 12), torch.float64).requires_grad_()
    y = ref.activation_reference(x, kind)
    assert y.shape == ((5, 6) if kind in GLU_GATES else (5, 12))
    torch.testing.assert_close(y, _closed_form(x, kind), rtol=1e-12, atol=1e-12)
    dy = _x(y.shape, torch.float64, seed=1)
    (dx_autograd,) = torch.autograd.grad(_closed_form(x, kind), x, dy)
    torch.testing.assert_close(ref.activation_grad_reference(dy, x.detach(), kind), dx_autograd,
                               rtol=1e-12, atol=1e-12)


def test_glu_gates_the_first_half_unlike_torch():
    x = _x((3, 8), torch.float64)
    a, b = x.chunk(2, dim=-1)
    torch.testing.assert_close(ref.activation_reference(x, "glu"), torch.nn.functional.glu(torch.cat([b, a], -1)))


@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("shape,dtype", [((13, 96), torch.float32), ((2, 5, 64), torch.bfloat16)])
def test_triton_activation_and_grad_match_reference(kind, shape, dtype):
    x = _x(shape, dtype).to(DEVICE)
    y = tk.activation(x, kind)
    assert_close(y, ref.activation_reference(x, kind), torch.float32, f"activation {kind} {dtype}")
    y_bf16 = tk.activation(x, kind, out_dtype=torch.bfloat16)
    assert_close(y_bf16, ref.activation_reference(x, kind, out_dtype=torch.bfloat16), torch.bfloat16,
                 f"activation {kind} -> bf16")
    dy = _x(y.shape, dtype, seed=1).to(DEVICE)
    # scaled: the kernels' tanh, 1 - 2 / (exp(2u) + 1), is exact to an absolute ~1e-7,
    # which GELU's gradient (1 + tanh) carries where the gate is negative
    assert_close(tk.activation_grad(dy, x, kind), ref.activation_grad_reference(dy, x, kind), torch.float32,
                 f"activation_grad {kind} {dtype}", scaled=kind in ("geglu",))


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_triton_dact_dbias_matches_reference(kind):
    x = _x((70, 40), seed=2).to(DEVICE)
    dy = _x((70, 20 if kind in GLU_GATES else 40), seed=3).to(DEVICE)
    dx, dbias = tk.dact_dbias(dy, x, kind)
    dx_ref = ref.activation_grad_reference(dy.double(), x.double(), kind)
    assert_close(dx, dx_ref, torch.float32, f"dact_dbias dx {kind}", scaled=kind in ("geglu",))
    assert_close(dbias, dx_ref.sum(dim=0), torch.float32, f"dact_dbias dbias {kind}", scaled=True)
    dx16, dbias16 = tk.dact_dbias(dy, x, kind, out_dtype=torch.bfloat16)
    dx16_ref, dbias16_ref = ref.dact_dbias_reference(dy, x, kind, out_dtype=torch.bfloat16)
    assert_close(dx16, dx16_ref, torch.bfloat16, f"dact_dbias dx->bf16 {kind}", scaled=kind in ("geglu",))
    assert_close(dbias16, dbias16_ref, "column_sums_fp32", f"dact_dbias dbias bf16 {kind}", scaled=True)


@pytest.mark.parametrize("op", [te.ops.QGELU, te.ops.GEGLU])
def test_an_activation_the_epilogue_lacks_runs_after_the_gemm_with_the_reason_shown(op):
    model = te.ops.Sequential(te.ops.Linear(32, 64), op())
    x = _x((4, 32))
    with torch.no_grad():
        y = model(x)
    plan = model.fusion_plan()
    assert "forward_linear_bias_activation" in plan and "not " + op.kind in plan, plan
    lin = model[0]
    pre = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert_close(y, ref.activation_reference(pre, op.kind), torch.float32, f"{op.__name__} after Linear")


def test_gated_activation_names_an_odd_last_dim():
    with pytest.raises(ValueError, match="even"):
        te.ops.ReGLU()(torch.randn(3, 5))
