"""The reference GEMM against float64 on representable inputs, for every scaling pair.

The three GEMMs of a linear layer ``y = x @ w.T`` (x (M, K), w (N, K), dy (M, N)),
each taking operands quantized along its reduction dimension:

- fprop ``y  = x @ w.T``:  x row-wise (M, K),      w row-wise (N, K)
- dgrad ``dx = dy @ w``:   dy row-wise (M, N),     w column-wise (K, N)
- wgrad ``dw = dy.T @ x``: dy column-wise (N, M),  x column-wise (K, M)

The expected values come from the FP8 bytes and scales decoded here in float64,
independently of the library's dequantization.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from te_fuser.kernels.operand import ScaledOperand
from te_fuser.kernels.reference import activation_reference, gemm_reference, quantize_rowwise_reference
from te_fuser.quantization import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def decode_f64(op: ScaledOperand) -> torch.Tensor:
    """``data * scale_inv`` in float64, the scale grid expanded here."""
    rows, cols = op.data.shape
    data = op.data.double()
    if op.scaling == "tensor":
        return data * op.scale_inv.double()
    if op.scaling == "row":
        return data * op.scale_inv.double().reshape(rows, 1)
    if op.scaling == "mx_32":
        scale = torch.pow(2.0, op.scale_inv.double() - 127.0)
        return data * scale.repeat_interleave(32, dim=1)
    tile_rows = 1 if op.scaling == "block_1x128" else 128
    scale = op.scale_inv.double().repeat_interleave(tile_rows, dim=0)[:rows]
    return data * scale.repeat_interleave(128, dim=1)[:, :cols]


class RowScaled:
    """Row-wise scaling (one scale per row of each copy); no recipe uses it, the GEMMs do."""

    def __init__(self, fp8_dtype):
        self.fp8_dtype = fp8_dtype

    def copies(self, t):
        return quantize_rowwise_reference(t, self.fp8_dtype), quantize_rowwise_reference(t.t(), self.fp8_dtype)


class FromQuantizer:
    def __init__(self, quantizer):
        self.quantizer = quantizer

    def copies(self, t):
        q = self.quantizer.cast(t, rowwise=True, columnwise=True)
        return q.rowwise, q.columnwise


# scheme -> (x, w, dy) quantizers and an (M, K, N) that the scheme allows
SCHEMES = {
    "tensor": (lambda dt: [FromQuantizer(Float8CurrentScalingQuantizer(dt))] * 3, (67, 160, 136)),
    "row": (lambda dt: [RowScaled(dt)] * 3, (67, 160, 136)),
    "block_1x128_128x128": (
        lambda dt: [FromQuantizer(Float8BlockQuantizer(dt, d, power_2_scales=False)) for d in (1, 2, 1)],
        (67, 160, 136),
    ),
    "block_1x128_1x128": (lambda dt: [FromQuantizer(Float8BlockQuantizer(dt, 1))] * 3, (67, 160, 136)),
    "mx_32": (lambda dt: [FromQuantizer(MXFP8Quantizer(dt))] * 3, (64, 160, 96)),
}


def off_centre(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -2.3 + 0.5 * torch.randn(shape, generator=g)


def linear_operands(scheme: str, fp8_dtype):
    make, (m, k, n) = SCHEMES[scheme]
    x_q, w_q, dy_q = make(fp8_dtype)
    x_hp, w_hp, dy_hp = off_centre((m, k), 0), off_centre((n, k), 1), off_centre((m, n), 2)
    x_row, x_col = x_q.copies(x_hp)  # (M, K), (K, M)
    w_row, w_col = w_q.copies(w_hp)  # (N, K), (K, N)
    dy_row, dy_col = dy_q.copies(dy_hp)  # (M, N), (N, M)
    return dict(x_row=x_row, x_col=x_col, w_row=w_row, w_col=w_col, dy_row=dy_row, dy_col=dy_col), (x_hp, w_hp, dy_hp)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_linear_gemms_match_float64(scheme, fp8_dtype):
    ops, (x_hp, w_hp, dy_hp) = linear_operands(scheme, fp8_dtype)
    f64 = {name: decode_f64(op) for name, op in ops.items()}
    gemms = {
        "fprop": (ops["x_row"], ops["w_row"], f64["x_row"] @ f64["w_row"].t(), x_hp @ w_hp.t()),
        "dgrad": (ops["dy_row"], ops["w_col"], f64["dy_row"] @ f64["w_col"].t(), dy_hp @ w_hp),
        "wgrad": (ops["dy_col"], ops["x_col"], f64["dy_col"] @ f64["x_col"].t(), dy_hp.t() @ x_hp),
    }
    for name, (a, b, expected, high_precision) in gemms.items():
        context = f"{scheme} {fp8_dtype} {name}"
        out = gemm_reference(a, b, out_dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert_close(out, expected, "fp8_gemm_fp32_out", context)
        assert_close(gemm_reference(a, b), expected, torch.bfloat16, context + " bf16 out")
        assert_close(out, high_precision.double(), fp8_dtype, context + " vs unquantized")


@pytest.mark.parametrize("activation", [None, "gelu", "relu", "silu", "swiglu"])
@pytest.mark.parametrize("scheme", ["tensor", "block_1x128_128x128", "mx_32"])
def test_epilogue_bias_activation_residual(scheme, activation):
    ops, _ = linear_operands(scheme, E4M3)
    m, n = ops["dy_row"].data.shape
    bias = off_centre((n,), 3)
    out_cols = n // 2 if activation == "swiglu" else n
    residual = off_centre((m, out_cols), 4)
    expected = decode_f64(ops["x_row"]) @ decode_f64(ops["w_row"]).t() + bias.double()
    if activation is not None:
        expected = activation_reference(expected, activation)  # float64 in, float64 out
    expected = expected + residual.double()
    out = gemm_reference(
        ops["x_row"], ops["w_row"], torch.float32, bias=bias, activation=activation, residual=residual
    )
    assert_close(out, expected, "fp8_gemm_fp32_out", f"{scheme} epilogue {activation}")


def test_high_precision_operand_stands_in():
    ops, (x_hp, _, _) = linear_operands("tensor", E4M3)
    out = gemm_reference(x_hp, ops["w_row"], torch.float32)
    assert_close(out, x_hp.double() @ decode_f64(ops["w_row"]).t(), "fp8_gemm_fp32_out", "hp x fp8")


def test_reduction_mismatch_is_rejected():
    ops, _ = linear_operands("tensor", E4M3)
    with pytest.raises(ValueError, match="reduction dims differ"):
        gemm_reference(ops["x_row"], ops["w_col"])


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("residual", [None, torch.float32], ids=["no residual", "fp32 residual"])
def test_the_ops_gemm_adds_a_bias_rounded_as_bias_round_says(fp8, residual):
    """``te_fuser.ops.gemm.gemm(..., bias_round=bfloat16)`` with an fp32 bias off the
    bf16 grid gives the bits of passing ``bias.to(bfloat16)``: on the reference
    backend (the FP8 GEMM and the high-precision one) the bias is converted first."""
    from tolerances import assert_bitwise

    from te_fuser.ops.gemm import gemm

    torch.manual_seed(0)
    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    bias = torch.randn(48) * 1.0001
    res = None if residual is None else torch.randn(32, 48, dtype=residual)
    if fp8:
        q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        x, w = q(x).rowwise, q(w).rowwise
    want = gemm(x, w, torch.bfloat16 if res is None else torch.float32, bias=bias.to(torch.bfloat16), residual=res,
                compute_dtype=torch.bfloat16)
    got = gemm(x, w, torch.bfloat16 if res is None else torch.float32, bias=bias, residual=res,
               compute_dtype=torch.bfloat16, bias_round=torch.bfloat16)
    assert_bitwise(got, want)
    assert not torch.equal(bias, bias.to(torch.bfloat16).float())  # the rounding matters here
