"""Grouped FP8 GEMMs (MoE experts): one launch for all experts beside a loop of GEMMs.

For each case (G experts, tokens per expert or explicit splits, K, N), bf16 output:

- ``grouped fp8``: ``grouped_gemm`` (Triton), x with one current scale, each
  expert's weight with its own; ``wgrad`` the same for ``grouped_gemm_wgrad``;
- ``loop fp8``: one dense FP8 ``gemm`` per expert (the ``auto`` backend's: cuBLASLt
  on an H200), the same operands;
- ``loop bf16``: one ``torch.mm`` per expert; ``grouped_mm bf16``: ``torch._grouped_mm``
  where this torch has it.

TFLOP/s count 2·M·N·K over the tokens actually routed; ratios are against the
loop of FP8 GEMMs and against the bf16 loop. One small, host-bound case is included.

    python benchmarks/bench_grouped_gemm.py [--cases moe skewed small]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Row  # noqa: E402

from te_fuser import backend  # noqa: E402
from te_fuser.kernels import triton as tk  # noqa: E402
from te_fuser.kernels.operand import ScaledOperand  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CASES = {  # name -> (splits, K, N)
    "moe": ([2048] * 8, 4096, 4096),
    "skewed": ([0, 3001, 1, 4095, 2048, 7000, 0, 239], 4096, 4096),
    "wide": ([2048] * 8, 4096, 14336),
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
    w_data = torch.cat([c.data.view(torch.uint8) for c in casts]).view(E4M3)
    w_scales = torch.cat([c.scale_inv.reshape(1, 1).expand(n, 1) for c in casts])
    return dict(x=x, w=w, dy=dy, a=_tensorwise(x), b=ScaledOperand(w_data, w_scales, "row"), casts=casts,
                dy_t=_tensorwise(dy.t().contiguous(), E5M2), x_t=_tensorwise(x.t().contiguous()))


def _bounds(splits):
    out = [0]
    for s in splits:
        out.append(out[-1] + s)
    return out


def bench_case(name: str) -> list[Row]:
    splits, k, n = CASES[name]
    bounds = _bounds(splits)
    m, g = bounds[-1], len(splits)
    flops = 2 * m * n * k
    ops = _operands(splits, k, n)
    offsets = torch.tensor(bounds, device="cuda", dtype=torch.int64)
    dense = backend.resolve("gemm", "cuda")
    a, casts, x, w, dy = ops["a"], ops["casts"], ops["x"], ops["w"], ops["dy"]
    groups = [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s]

    def loop_fp8():
        return [dense.fn(ScaledOperand(a.data[s:e], a.scale_inv, "tensor"), casts[i], torch.bfloat16)
                for i, (s, e) in enumerate(zip(bounds, bounds[1:])) if e > s]

    def loop_bf16():
        return [torch.mm(x[s:e], w[i].t()) for i, (s, e) in enumerate(zip(bounds, bounds[1:])) if e > s]

    def wgrad_bf16():
        return [torch.mm(dy[s:e].t(), x[s:e]) for s, e in groups]

    timed = {
        "grouped fp8": lambda: tk.grouped_gemm(a, ops["b"], offsets, torch.bfloat16),
        f"loop fp8 ({dense.backend})": loop_fp8,
        "loop bf16": loop_bf16,
    }
    if hasattr(torch, "_grouped_mm"):
        ends = offsets[1:].to(torch.int32)
        timed["grouped_mm bf16"] = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends,
                                                             out_dtype=torch.bfloat16)
    timed["wgrad grouped fp8"] = lambda: tk.grouped_gemm_wgrad(ops["dy_t"], ops["x_t"], offsets, torch.bfloat16)
    timed["wgrad loop bf16"] = wgrad_bf16
    shape = f"G={g} M={m} K={k} N={n}"
    times = {}
    for label, fn in timed.items():
        try:
            fn()
            times[label] = harness.time_ms(fn)
        except Exception as err:  # a peer this torch or device lacks: report, keep going
            print(f"{name} {label}: {type(err).__name__}: {str(err)[:100]}")
    rows = []
    loop_fp8_ms = next((v for key, v in times.items() if key.startswith("loop fp8")), None)
    for label, ms in times.items():
        wgrad = label.startswith("wgrad")
        peer_ms = times.get("wgrad loop bf16" if wgrad else "loop bf16")
        extra = {}
        if label == "grouped fp8" and loop_fp8_ms:
            extra["vs_loop_fp8"] = round(loop_fp8_ms / ms, 3)
        rows.append(harness.progress(Row("grouped_gemm", f"{name} {label}", "triton" if "grouped fp8" in label
                                         else "torch", shape, ms, flops / (ms * 1e-3) / 1e12, "TFLOP/s",
                                         vs_peer=None if peer_ms is None else peer_ms / ms, peer="bf16 loop",
                                         note=" ".join(f"{k}={v}" for k, v in extra.items()), extra=extra)))
    return rows


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm: needs a CUDA GPU")
    rows = [r for name in args.cases for r in bench_case(name)]
    harness.append_csv(rows, args.csv)
    harness.print_table(rows, "Grouped GEMMs (bf16 output): vs the bf16 loop; note: vs the loop of FP8 GEMMs")
    return rows


if __name__ == "__main__":
    main()
