"""LayerNorm and RMSNorm kernels on the GPU: the backends side by side, and the op beside torch.

    python benchmarks/bench_norm.py [--rows 16384 256] [--n 1024 4096]

Per shape (rows x N: the GPT's 16k tokens, and 256 rows, where the launches'
host cost is what shows), in the GPT's dtypes (an fp32 residual stream
normalized into a bf16 output; a bf16 gradient coming back, an fp32 input
gradient going out):

- the kernels ``layer_norm`` / ``layer_norm_grad`` (and ``rms_norm`` /
  ``rms_norm_grad``) on each backend: the reference (torch's fp32 kernels with
  the dtype copies around them), triton, cuda where it has them, and auto; GB/s counts the bytes the kernel must
  move (x and y forward; x, dy and dx backward);
- ``te.ops.LayerNorm`` forward + backward under ``torch.autocast(bf16)``, auto
  backend, beside ``torch.nn.LayerNorm`` followed by the cast to bf16 that the
  next bf16 GEMM makes (what a torch model pays).

Times are medians from Python, L2 flushed between runs; "of ceil" is the rate
over the device copy rate measured in the same run. Rows go to
``benchmarks/out/results.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import te_fuser as te  # noqa: E402
from te_fuser import backend  # noqa: E402


def _kernel_rows(rows: int, n: int, ceiling_tbs: float) -> list:
    dev = torch.device("cuda")
    x = torch.randn(rows, n, device=dev) * 2 - 1  # fp32 residual stream
    w, b = 1 + 0.1 * torch.randn(n, device=dev), 0.1 * torch.randn(n, device=dev)
    dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    shape = f"{rows}x{n}"
    fwd_bytes, bwd_bytes = rows * n * (4 + 2), rows * n * (4 + 2 + 4)
    out = []
    for norm in ("layer_norm", "rms_norm"):
        ms = {}
        for name in ["reference"] + harness.default_backends(norm):
            fwd = backend.resolve(norm, dev, name).fn
            grad = backend.resolve(norm + "_grad", dev, name).fn
            if norm == "layer_norm":
                y, mean, rstd = fwd(x, w, b, 1e-5, torch.bfloat16)
                f_ms = harness.time_ms(lambda: fwd(x, w, b, 1e-5, torch.bfloat16))
                b_ms = harness.time_ms(lambda: grad(dy, x, w, mean, rstd))
            else:
                y, rstd = fwd(x, w, 1e-5, torch.bfloat16)
                f_ms = harness.time_ms(lambda: fwd(x, w, 1e-5, torch.bfloat16))
                b_ms = harness.time_ms(lambda: grad(dy, x, w, rstd, 1e-5))
            ms[name] = (f_ms, b_ms)
        base = ms.get("reference")
        for name, (f_ms, b_ms) in ms.items():
            for what, t, nbytes, ref_t in (("fwd", f_ms, fwd_bytes, base and base[0]),
                                           ("bwd", b_ms, bwd_bytes, base and base[1])):
                out.append(harness.progress(harness.Row(
                    "norm", f"{norm} {what} (x fp32, {'y' if what == 'fwd' else 'dy'} bf16)", name, shape, t,
                    nbytes / t / 1e6, "GB/s", of_ceiling=nbytes / t / 1e9 / ceiling_tbs,
                    vs_peer=ref_t / t if ref_t else None, peer="reference")))
    return out


def _op_rows(rows: int, n: int, ceiling_tbs: float) -> list:
    dev = torch.device("cuda")
    te_norm = te.ops.LayerNorm(n, device=dev)
    torch_norm = torch.nn.LayerNorm(n, device=dev)
    x = (torch.randn(rows, n, device=dev) * 2 - 1).requires_grad_()
    dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)

    def te_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = te_norm(x)
        y.backward(dy)

    def torch_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch_norm(x).to(torch.bfloat16)  # the cast the next bf16 GEMM makes
        y.backward(dy)

    t_torch, t_te = harness.time_ms(torch_step), harness.time_ms(te_step)
    fb = rows * n * (4 + 2 + 4 + 2 + 4)
    return [harness.progress(harness.Row("norm", "LayerNorm op fwd+bwd (autocast bf16)", label, f"{rows}x{n}", t,
                                         fb / t / 1e6, "GB/s", of_ceiling=fb / t / 1e9 / ceiling_tbs,
                                         vs_peer=t_torch / t, peer="torch"))
            for label, t in (("torch", t_torch), ("te auto", t_te))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16384, 256], help="256 rows: launch-bound")
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py: needs a CUDA GPU")
    ceiling = harness.copy_ceiling_tbs()
    rows = []
    for m in args.rows:
        for n in args.n:
            rows += _kernel_rows(m, n, ceiling) + _op_rows(m, n, ceiling)
    harness.print_table(rows, "LayerNorm / RMSNorm (vs peer: the reference's time over this one's)")
    harness.append_csv(rows)


if __name__ == "__main__":
    main()
