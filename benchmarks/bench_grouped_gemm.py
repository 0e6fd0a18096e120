"""Grouped FP8 GEMMs (MoE experts): what GroupedLinear runs, beside one launch, a loop of GEMMs and bf16.

For each case (G experts, tokens per expert or explicit splits, K, N), bf16 output,
x with one current scale, each expert's weight with its own, forward then wgrad:

- ``dispatch fp8 -> grouped|loop``: what ``te.ops.GroupedLinear`` runs
  (``grouped_gemm_dispatch`` / ``grouped_gemm_wgrad_dispatch`` under ``LOOP_RULE``:
  the one grouped launch or a loop of the dense FP8 GEMM), from the experts' own
  casts and the host's split sizes, as the op has them: the stacking of the
  experts' weights (grouped) or the copy of each expert's result into the one
  output (loop), and the offsets' copy to the device, are inside the time;
- ``grouped fp8``: the Triton kernel alone (``grouped_gemm``, ``grouped_gemm_wgrad``)
  on operands stacked beforehand;
- ``loop fp8``: one dense FP8 ``gemm`` per expert (the ``auto`` backend's: cuBLASLt
  on an H200) on the same operands, results left apart; in the wgrad on the
  column-wise copies' column blocks (which cuBLASLt takes contiguous: copied), only
  where every group's token count is a multiple of 16;
- ``loop bf16``: one ``torch.mm`` per expert; ``grouped_mm bf16`` /
  ``scaled_grouped_mm fp8``: ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``
  (row-wise scales) where this torch has them.

TFLOP/s count 2·M·N·K over the tokens actually routed; ratios are against the bf16
loop, the note gives the dispatch against the loop of FP8 GEMMs and the grouped
kernel. ``moe512`` and ``moe1024`` sit on either side of the rule's threshold;
``small`` is host-bound. ``--fprop-tiles`` / ``--wgrad-tiles`` BMxBNxBKxWARPSxSTAGES
replace the grouped kernels' GPU tiles (TMA on) to tune them.

    python benchmarks/bench_grouped_gemm.py [--cases moe skewed small] [--wgrad-tiles 128x128x128x8x4]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Row  # noqa: E402

from te_fuser import backend  # noqa: E402
from te_fuser.kernels import triton as tk  # noqa: E402
from te_fuser.kernels.operand import ScaledOperand  # noqa: E402
from te_fuser.kernels.triton.gemm import Tiles  # noqa: E402
from te_fuser.ops.basic import grouped_linear as gl  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CASES = {  # name -> (splits, K, N)
    "moe": ([2048] * 8, 4096, 4096),
    "skewed": ([0, 3001, 1, 4095, 2048, 7000, 0, 239], 4096, 4096),
    "wide": ([2048] * 8, 4096, 14336),
    "moe1024": ([1024] * 8, 4096, 4096),
    "moe512": ([512] * 8, 4096, 4096),
    "small": ([128] * 8, 1024, 1024),
}


def _tensorwise(x: torch.Tensor, fp8_dtype=E4M3) -> ScaledOperand:
    data, _, _, scale_inv, _ = tk.quantize_current(x, fp8_dtype)
    return ScaledOperand(data, scale_inv, "tensor")


def _operands(splits, k, n):
    g, m = len(splits), sum(splits)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    casts = [_tensorwise(w[i]) for i in range(g)]
    return dict(x=x, w=w, dy=dy, a=_tensorwise(x), b=gl.Experts(casts).stacked(), casts=casts,
                dy_t=_tensorwise(dy.t().contiguous(), E5M2), x_t=_tensorwise(x.t().contiguous()))


def _bounds(splits):
    out = [0]
    for s in splits:
        out.append(out[-1] + s)
    return out


def _peers(ops, bounds, offsets) -> dict:
    """torch's grouped GEMMs, where this torch has them."""
    x, w, a, casts = ops["x"], ops["w"], ops["a"], ops["casts"]
    peers = {}
    ends = offsets[1:].to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        peers["grouped_mm bf16"] = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends,
                                                             out_dtype=torch.bfloat16)
    if hasattr(torch, "_scaled_grouped_mm"):
        w_fp8 = torch.stack([c.data for c in casts])  # (G, N, K)
        scale_a = a.scale_inv.float().reshape(1).expand(a.data.shape[0]).contiguous()  # (M,)
        scale_b = torch.stack([c.scale_inv.float().reshape(1).expand(w.shape[1]) for c in casts])  # (G, N)
        peers["scaled_grouped_mm fp8"] = lambda: torch._scaled_grouped_mm(
            a.data, w_fp8.transpose(-2, -1), scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16)
    return peers


def bench_case(name: str) -> list[Row]:
    splits, k, n = CASES[name]
    bounds = _bounds(splits)
    m, g = bounds[-1], len(splits)
    flops = 2 * m * n * k
    ops = _operands(splits, k, n)
    offsets = torch.tensor(bounds, device="cuda", dtype=torch.int64)
    dense = backend.resolve("gemm", "cuda")
    a, casts, x, w, dy = ops["a"], ops["casts"], ops["x"], ops["w"], ops["dy"]
    dy_t, x_t = ops["dy_t"], ops["x_t"]
    spans = gl.Groups(bounds, "cuda").spans()
    fprop_path = gl.fprop_path(a, gl.Experts(casts), gl.Groups(bounds, "cuda"))
    wgrad_path = gl.wgrad_path(dy_t, x_t, gl.Groups(bounds, "cuda"))

    def block(op, s, e):
        return ScaledOperand(op.data[:, s:e], op.scale_inv, op.scaling)

    timed = {
        f"dispatch fp8 -> {fprop_path}": lambda: gl.grouped_gemm_dispatch(
            a, gl.Experts(casts), gl.Groups(bounds, "cuda"), torch.bfloat16),
        "grouped fp8": lambda: tk.grouped_gemm(a, ops["b"], offsets, torch.bfloat16),
        f"loop fp8 ({dense.backend})": lambda: [
            dense.fn(ScaledOperand(a.data[s:e], a.scale_inv, "tensor"), casts[i], torch.bfloat16)
            for i, s, e in spans],
        "loop bf16": lambda: [torch.mm(x[s:e], w[i].t()) for i, s, e in spans],
        **_peers(ops, bounds, offsets),
        f"wgrad dispatch fp8 -> {wgrad_path}": lambda: gl.grouped_gemm_wgrad_dispatch(
            dy_t, x_t, gl.Groups(bounds, "cuda"), torch.bfloat16),
        "wgrad grouped fp8": lambda: tk.grouped_gemm_wgrad(dy_t, x_t, offsets, torch.bfloat16),
    }
    if all((e - s) % 16 == 0 for _, s, e in spans):
        timed[f"wgrad loop fp8 ({dense.backend})"] = lambda: [
            dense.fn(block(dy_t, s, e), block(x_t, s, e), torch.bfloat16) for _, s, e in spans]
    timed["wgrad loop bf16"] = lambda: [torch.mm(dy[s:e].t(), x[s:e]) for _, s, e in spans]
    times = {}
    for label, fn in timed.items():
        try:
            fn()
            times[label] = harness.time_ms(fn)
        except Exception as err:  # a peer this torch or device lacks: report, keep going
            print(f"{name} {label}: {type(err).__name__}: {str(err)[:100]}")
    return _rows(name, f"G={g} M={m} K={k} N={n}", flops, times)


def _rows(name: str, shape: str, flops: int, times: dict) -> list[Row]:
    rows = []
    for label, ms in times.items():
        wgrad = label.startswith("wgrad")
        prefix = "wgrad " if wgrad else ""
        peer_ms = times.get(f"{prefix}loop bf16")
        extra = {}
        if label.startswith(f"{prefix}dispatch"):
            for key, other in ((f"{prefix}loop fp8", "vs_loop_fp8"), (f"{prefix}grouped fp8", "vs_grouped")):
                ref = next((v for lab, v in times.items() if lab.startswith(key)), None)
                if ref:
                    extra[other] = round(ref / ms, 3)
        kind = "triton" if "grouped fp8" in label else "te_fuser" if "dispatch" in label else "torch"
        rows.append(harness.progress(Row(
            "grouped_gemm", f"{name} {label}", kind, shape, ms, flops / (ms * 1e-3) / 1e12, "TFLOP/s",
            vs_peer=None if peer_ms is None else peer_ms / ms, peer="bf16 loop",
            note=" ".join(f"{k}={v}" for k, v in extra.items()), extra=extra)))
    return rows


def _tiles(spec: str) -> Tiles:
    bm, bn, bk, warps, stages = (int(v) for v in spec.lower().split("x"))
    return Tiles(bm, bn, bk, 1, warps, stages, use_tma=True)


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--fprop-tiles", default=None, help="BMxBNxBKxWARPSxSTAGES for grouped_gemm")
    parser.add_argument("--wgrad-tiles", default=None, help="BMxBNxBKxWARPSxSTAGES for grouped_gemm_wgrad")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm: needs a CUDA GPU")
    overrides = importlib.import_module("te_fuser.kernels.triton.grouped_gemm").TILE_OVERRIDES
    for which, spec in (("fprop", args.fprop_tiles), ("wgrad", args.wgrad_tiles)):
        if spec:
            overrides[which] = _tiles(spec)
    rows = [r for name in args.cases for r in bench_case(name)]
    harness.append_csv(rows, args.csv)
    harness.print_table(rows, "Grouped GEMMs (bf16 output): vs the bf16 loop; note: the dispatch vs the loop of "
                        "FP8 GEMMs and vs the grouped kernel")
    return rows


if __name__ == "__main__":
    main()
