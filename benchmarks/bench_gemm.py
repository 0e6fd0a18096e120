"""FP8 GEMMs: TFLOP/s side by side with cuBLASLt (torch._scaled_mm) and bf16 matmul.

Cases at M = N = K in --sizes (default 1024, 4096, 8192), bf16 output:
tensorwise and row-wise vs ``torch._scaled_mm`` of the same scaling, block-scaled
(1x128 x 128x128 and 1x128 x 1x128) and MXFP8 vs bf16 ``torch.matmul``. Each
backend in --backends runs the pairs it supports (a ``cuda`` backend only where
its ``gemm_unsupported_reason`` is None). ``--sweep`` also times a few tile
configurations of the Triton kernels and prints them.

    python benchmarks/bench_gemm.py [--backends triton cuda] [--sizes 1024 4096 8192] [--sweep]
                                    [--sweep-families tensor block mx]
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

from te_fuser.kernels import triton as tk  # noqa: E402
from te_fuser.kernels.operand import ScaledOperand  # noqa: E402
triton_gemm = importlib.import_module("te_fuser.kernels.triton.gemm")  # the module (the package's `gemm` is the kernel)

E4M3 = torch.float8_e4m3fn
SCHEMES = ("tensor", "row", "block_1x128_128x128", "block_1x128_1x128", "mx")


def _quantize(scheme: str, x: torch.Tensor, w: torch.Tensor) -> tuple[ScaledOperand, ScaledOperand]:
    if scheme == "tensor":
        qa, qb = tk.quantize_current(x, E4M3), tk.quantize_current(w, E4M3)
        return ScaledOperand(qa[0], qa[3], "tensor"), ScaledOperand(qb[0], qb[3], "tensor")
    if scheme == "row":
        return tk.quantize_rowwise(x, E4M3), tk.quantize_rowwise(w, E4M3)
    if scheme == "block_1x128_128x128":
        return tk.quantize_block(x, E4M3, 1), tk.quantize_block(w, E4M3, 128)
    if scheme == "block_1x128_1x128":
        return tk.quantize_block(x, E4M3, 1), tk.quantize_block(w, E4M3, 1)
    return tk.quantize_mxfp8(x, E4M3), tk.quantize_mxfp8(w, E4M3)


def _scaled_mm(a: ScaledOperand, b: ScaledOperand, fast_accum: bool = False):
    """cuBLASLt through torch._scaled_mm: b must be column-major, i.e. b.data.t()."""
    if a.scaling == "tensor":
        sa, sb = a.scale_inv.reshape(()), b.scale_inv.reshape(())
    else:
        sa, sb = a.scale_inv.reshape(-1, 1), b.scale_inv.reshape(1, -1)
    return lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


def _tflops(n: int, ms: float) -> float:
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _operand_sets(scheme: str, n: int):
    def make():
        x = torch.randn(n, n, device="cuda").bfloat16()
        w = torch.randn(n, n, device="cuda").bfloat16()
        return _quantize(scheme, x, w)
    return harness.rotation(make, 2 * n * n)


def bench_size(n: int, backends: list[str]) -> list[Row]:
    label = f"{n}^3"
    rows: list[Row] = []
    bf16_sets = harness.rotation(lambda: (torch.randn(n, n, device="cuda").bfloat16(),
                                          torch.randn(n, n, device="cuda").bfloat16()), 4 * n * n)
    bf16_ms = harness.time_ms(lambda a, b: a @ b.t(), bf16_sets)
    rows.append(harness.progress(Row("gemm", "bf16 matmul", "torch", label, bf16_ms, _tflops(n, bf16_ms), "TFLOP/s")))
    for scheme in SCHEMES:
        sets = _operand_sets(scheme, n)
        peer_ms, peer = bf16_ms, "bf16"
        if scheme in ("tensor", "row"):
            peer_ms = harness.time_ms(lambda a, b: _scaled_mm(a, b)(), sets)
            peer = "cuBLASLt"
            rows.append(harness.progress(Row("gemm", scheme, "cuBLASLt", label, peer_ms, _tflops(n, peer_ms), "TFLOP/s",
                            vs_peer=bf16_ms / peer_ms, peer="bf16")))
            fast_ms = harness.time_ms(lambda a, b: _scaled_mm(a, b, fast_accum=True)(), sets)
            rows.append(harness.progress(Row("gemm", f"{scheme} fast-accum", "cuBLASLt", label, fast_ms,
                                             _tflops(n, fast_ms), "TFLOP/s", vs_peer=bf16_ms / fast_ms, peer="bf16")))
            if scheme == "tensor":
                ours_ms = harness.time_ms(lambda a, b: tk.gemm(a, b, fast_accum=True), sets)
                rows.append(harness.progress(Row("gemm", f"{scheme} fast-accum", "triton", label, ours_ms,
                                                 _tflops(n, ours_ms), "TFLOP/s", vs_peer=fast_ms / ours_ms,
                                                 peer="cuBLASLt fast-accum")))
        for backend in backends:
            mod = harness.backend_module(backend)
            reason = getattr(mod, "gemm_unsupported_reason", lambda a, b: None)(*sets[0])
            if reason is not None:
                continue
            try:
                mod.gemm(*sets[0])
                ms = harness.time_ms(lambda a, b: mod.gemm(a, b), sets)
            except Exception as err:
                rows.append(harness.progress(Row("gemm", scheme, backend, label, float("nan"), float("nan"), "TFLOP/s",
                                note=f"{type(err).__name__}: {str(err)[:80]}")))
                continue
            rows.append(harness.progress(Row("gemm", scheme, backend, label, ms, _tflops(n, ms), "TFLOP/s",
                            vs_peer=peer_ms / ms, peer=peer)))
    rows += _epilogue_rows(n, bf16_ms)
    return rows


def _epilogue_rows(n: int, bf16_ms: float) -> list[Row]:
    """What the fused epilogues cost on the tensorwise kernel."""
    sets = _operand_sets("tensor", n)
    bias = torch.randn(n, device="cuda").bfloat16()
    rows = []
    for case, kwargs in (("tensor+bias+gelu", dict(bias=bias, activation="gelu")),
                         ("tensor+swiglu", dict(activation="swiglu"))):
        ms = harness.time_ms(lambda a, b: tk.gemm(a, b, torch.bfloat16, **kwargs), sets)
        rows.append(harness.progress(Row("gemm", case, "triton", f"{n}^3", ms, _tflops(n, ms), "TFLOP/s",
                                         vs_peer=bf16_ms / ms,
                        peer="bf16")))
    return rows


SWEEP = {
    "tensor": [triton_gemm.Tiles(256, 128, 128, 8, 8, 3), triton_gemm.Tiles(256, 128, 128, 8, 8, 4),
               triton_gemm.Tiles(128, 256, 128, 8, 8, 3), triton_gemm.Tiles(128, 256, 128, 16, 8, 3),
               triton_gemm.Tiles(256, 128, 128, 16, 8, 3), triton_gemm.Tiles(128, 128, 128, 8, 4, 4),
               # 256-deep tiles: half the loop iterations, still promoted every 128 products
               triton_gemm.Tiles(128, 256, 256, 8, 8, 2), triton_gemm.Tiles(256, 128, 256, 8, 8, 2),
               triton_gemm.Tiles(128, 128, 256, 8, 8, 3)],
    "block": [triton_gemm.Tiles(128, 128, 128, 8, 8, 4), triton_gemm.Tiles(256, 128, 128, 8, 8, 3),
              triton_gemm.Tiles(128, 128, 128, 8, 8, 3), triton_gemm.Tiles(128, 128, 128, 16, 8, 5),
              triton_gemm.Tiles(128, 128, 128, 8, 4, 4), triton_gemm.Tiles(64, 128, 128, 8, 4, 5)],
    "mx": [triton_gemm.Tiles(128, 128, 128, 8, 8, 3), triton_gemm.Tiles(128, 256, 128, 8, 8, 3)],
}


def sweep(sizes: list[int], families: list[str] | None = None) -> list[Row]:
    """Time the Triton kernels under a few tile shapes (and MX / accumulation modes);
    ``families`` limits it to some of "tensor", "block", "mx"."""
    rows = []
    variants = [("tensor", "tensor", {}), ("tensor", "tensor", {"fast_accum": True}),
                ("block_1x128_128x128", "block", {}), ("block_1x128_1x128", "block", {}), ("mx", "mx", {})]
    variants = [v for v in variants if families is None or v[1] in families]
    for n in sizes:
        for scheme, family, knobs in variants:
            sets = _operand_sets(scheme, n)
            for tiles in SWEEP[family]:
                triton_gemm.TILE_OVERRIDES[family] = tiles
                try:
                    tk.gemm(*sets[0], **knobs)
                    ms = harness.time_ms(lambda a, b: tk.gemm(a, b, **knobs), sets)
                    note = ""
                except Exception as err:
                    ms, note = float("nan"), f"{type(err).__name__}: {str(err)[:60]}"
                finally:
                    triton_gemm.TILE_OVERRIDES.clear()
                t = tiles
                case = (f"{scheme} {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}"
                        f"{'' if t.use_tma else ' ptr'}{''.join(f' {k}={v}' for k, v in knobs.items())}")
                rows.append(harness.progress(Row("gemm-sweep", case, "triton", f"{n}^3", ms, _tflops(n, ms),
                                                 "TFLOP/s", note=note)))
    return rows


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--sweep", action="store_true", help="also time a few tile shapes")
    parser.add_argument("--sweep-families", nargs="+", choices=["tensor", "block", "mx"], default=None,
                        help="sweep only these kernel families")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    args = parser.parse_args(argv)
    backends = args.backends or harness.default_backends("gemm")
    rows: list[Row] = []
    for n in args.sizes:
        rows += bench_size(n, backends)
    if args.sweep:
        sweep_rows = sweep([n for n in args.sizes if n >= 8192], args.sweep_families)
        harness.print_table(sweep_rows, "Triton GEMM tile sweep")
        rows += sweep_rows
    harness.append_csv(rows, args.csv)
    harness.print_table([r for r in rows if r.bench == "gemm"], "FP8 GEMMs (bf16 output)")
    return rows


if __name__ == "__main__":
    main()
