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


# ClampedSwiGLU and SiTU-GLU, with TransformerEngine's defaults and other values
PARAMETRIZED = [("clamped_swiglu", None), ("clamped_swiglu", (0.75, 1.1, 0.0)), ("situglu", None),
                ("situglu", (3.0, 0.75))]


def _closed_form_parametrized(x: torch.Tensor, kind: str, params) -> torch.Tensor:
    """TE's tests' torch forms: x_glu.clamp(max=limit), x_linear.clamp(-limit, limit)."""
    a, b = x.chunk(2, dim=-1)
    if kind == "clamped_swiglu":
        limit, alpha, offset = params or (7.0, 1.702, 1.0)
        a = a.clamp(max=limit)
        return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + offset)
    beta1, beta2 = params or (4.0, 25.0)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


@pytest.mark.parametrize("kind,params", PARAMETRIZED)
def test_parametrized_reference_matches_the_closed_form_and_autograd(kind, params):
    x = _x((5, 34), torch.float64)  # odd gate width (17)
    x[0, :4] = torch.tensor([0.75, -0.75, 7.0, -7.0], dtype=torch.float64)  # the clamps' edges
    x[0, 17:21] = torch.tensor([0.75, -0.75, 7.0, -7.0], dtype=torch.float64)
    x.requires_grad_()
    y = ref.activation_reference(x, kind, params=params)
    assert y.shape == (5, 17)
    torch.testing.assert_close(y, _closed_form_parametrized(x, kind, params), rtol=1e-12, atol=1e-12)
    dy = _x(y.shape, torch.float64, seed=1)
    (dx_autograd,) = torch.autograd.grad(_closed_form_parametrized(x, kind, params), x, dy)
    torch.testing.assert_close(ref.activation_grad_reference(dy, x.detach(), kind, params=params), dx_autograd,
                               rtol=1e-12, atol=1e-12)


def test_the_clamps_stop_the_gradient_beyond_the_limit():
    x = torch.tensor([[8.0, 0.5, 0.5, 9.0]], dtype=torch.float64)  # a > limit in column 0, |b| > limit in 1
    dx = ref.activation_grad_reference(torch.ones(1, 2, dtype=torch.float64), x, "clamped_swiglu")
    assert dx[0, 0] == 0 and dx[0, 3] == 0 and dx[0, 1] != 0 and dx[0, 2] != 0
    # and the output saturates: min(a, 7)·sigmoid(1.702·7)·(0.5 + 1), 0.5·sigmoid(0.851)·(7 + 1)
    y = ref.activation_reference(x, "clamped_swiglu")
    torch.testing.assert_close(y, torch.tensor([[7.0 * torch.sigmoid(torch.tensor(11.914, dtype=torch.float64)) * 1.5,
                                                 0.5 * torch.sigmoid(torch.tensor(0.851, dtype=torch.float64)) * 8.0]]))


def test_parametrized_kinds_name_a_wrong_number_of_parameters():
    x = _x((3, 8))
    with pytest.raises(ValueError, match="takes 3 parameter"):
        ref.activation_reference(x, "clamped_swiglu", params=(1.0, 2.0))
    with pytest.raises(ValueError, match="takes 2 parameter"):
        tk.activation(x.to(DEVICE), "situglu", params=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="takes 0 parameter"):
        tk.activation_grad(x[:, :4].to(DEVICE), x.to(DEVICE), "swiglu", params=(1.0,))


@pytest.mark.parametrize("kind,params", PARAMETRIZED)
@pytest.mark.parametrize("shape,dtype", [((13, 34), torch.float32), ((2, 5, 64), torch.bfloat16),
                                         ((7, 18), torch.float64)])
def test_triton_parametrized_kinds_match_reference(kind, params, shape, dtype):
    x = _x(shape, dtype).to(DEVICE)
    y = tk.activation(x, kind, params=params)
    y_ref = ref.activation_reference(x, kind, params=params)
    assert y.dtype == y_ref.dtype
    assert_close(y, y_ref, torch.float32, f"activation {kind} {params} {dtype}")
    assert_close(tk.activation(x, kind, out_dtype=torch.bfloat16, params=params),
                 ref.activation_reference(x, kind, out_dtype=torch.bfloat16, params=params), torch.bfloat16,
                 f"activation {kind} -> bf16")
    dy = _x(y.shape, dtype, seed=1).to(DEVICE)
    assert_close(tk.activation_grad(dy, x, kind, params=params),
                 ref.activation_grad_reference(dy, x, kind, params=params), torch.float32,
                 f"activation_grad {kind} {params} {dtype}")


@pytest.mark.parametrize("kind,params", PARAMETRIZED[1:3])
def test_triton_dact_dbias_parametrized(kind, params):
    x = _x((70, 40), seed=2).to(DEVICE)
    dy = _x((70, 20), seed=3).to(DEVICE)
    dx, dbias = tk.dact_dbias(dy, x, kind, params=params)
    dx_ref = ref.activation_grad_reference(dy.double(), x.double(), kind, params=params)
    assert_close(dx, dx_ref, torch.float32, f"dact_dbias dx {kind}")
    assert_close(dbias, dx_ref.sum(dim=0), torch.float32, f"dact_dbias dbias {kind}", scaled=True)
    dx16, dbias16 = tk.dact_dbias(dy, x, kind, out_dtype=torch.bfloat16, params=params)
    dx16_ref, dbias16_ref = ref.dact_dbias_reference(dy, x, kind, out_dtype=torch.bfloat16, params=params)
    assert_close(dx16, dx16_ref, torch.bfloat16, f"dact_dbias dx->bf16 {kind}")
    assert_close(dbias16, dbias16_ref, "column_sums_fp32", f"dact_dbias dbias bf16 {kind}", scaled=True)


@pytest.mark.parametrize("op", [lambda: te.ops.ClampedSwiGLU(limit=0.75), lambda: te.ops.SiTUGLU(beta2=0.75)])
def test_parametrized_activation_after_linear_bias_fuses_only_its_backward(op):
    """The epilogue rule declines them with a reason; Bias -> act's fused backward
    (dact_dbias) takes the op's parameters: its gradients are the float64 ones."""
    model = te.ops.Sequential(te.ops.Linear(32, 64), op())
    act = model[1]
    x = _x((6, 32)).requires_grad_()
    y = model(x)
    plan = model.fusion_plan()
    assert "not " + act.kind in plan and "backward_activation_bias" in plan, plan
    dy = _x(y.shape, seed=4)
    y.backward(dy)
    lin = model[0]
    x64, b64 = x.detach().double().requires_grad_(), lin.bias.detach().double().requires_grad_()
    pre = x64 @ lin.weight.detach().double().t() + b64
    y64 = ref.activation_reference(pre, act.kind, params=act.params)
    y64.backward(dy.double())
    assert_close(y, y64, torch.float32, f"{act.kind} after Linear")
    assert_close(x.grad, x64.grad, torch.float32, f"{act.kind} dx", scaled=True)
    assert_close(lin.bias.grad, b64.grad, "column_sums_fp32", f"{act.kind} dbias", scaled=True)


def test_scaled_activations_are_not_fused_with_the_linear_before():
    model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.ScaledClampedQGeGLU(limit=0.75))
    x, scales = _x((6, 32)).requires_grad_(), _x((6,), seed=5).requires_grad_()
    y = model(x, scales)
    y.backward(_x(y.shape, seed=6))
    plan = model.fusion_plan()
    assert "ScaledClampedQGeGLU(2:ScaledClampedQGeGLU)" in plan and "backward_activation_bias" not in plan, plan
    assert scales.grad is not None and scales.grad.shape == (6,)
