"""Launch shapes of the fused activation backward (``dact_dbias``) on the GPU.

    python benchmarks/tune_dact_dbias.py [--rows 16384] [--cols 4096]

Times ``dact_dbias`` (GELU, bf16 dy and x, the MLP's shape) under each launch
shape of a sweep (rows and columns per tile, warps, programs per SM), checks each
against the default shape's result (dx bit for bit, dbias within fp32 summation
tolerance), and prints them fastest first with the bytes-moved rate (dy and x
read once, dx written once).
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

from harness import time_ms
triton_activation = importlib.import_module("te_fuser.kernels.triton.activation")  # the module, not the kernel
from te_fuser.kernels.triton.cast import CastPlan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--kind", default="gelu")
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [tuple(torch.randn(args.rows, args.cols, device="cuda", generator=g).bfloat16() for _ in range(2))
              for _ in range(3)]
    default = triton_activation.ACTIVATION_PLANS["dact_dbias"]
    want_dx, want_db = triton_activation.dact_dbias(*inputs[0], args.kind)
    io_bytes = 3 * args.rows * args.cols * 2
    rows = []
    for br, bc, warps, per_sm in itertools.product((8, 16, 32, 64), (64, 128, 256), (4, 8), (2, 4, 8, 16)):
        if br * bc > 16384:
            continue
        triton_activation.ACTIVATION_PLANS["dact_dbias"] = CastPlan(br, bc, warps, per_sm)
        dx, db = triton_activation.dact_dbias(*inputs[0], args.kind)
        assert torch.equal(dx, want_dx), (br, bc, warps, per_sm)
        torch.testing.assert_close(db, want_db, rtol=1e-4, atol=1e-2)
        ms = time_ms(lambda dy, x: triton_activation.dact_dbias(dy, x, args.kind), inputs)
        rows.append((ms, br, bc, warps, per_sm))
    triton_activation.ACTIVATION_PLANS["dact_dbias"] = default
    rows.sort()
    base = next(ms for ms, *plan in rows if CastPlan(*plan) == default)
    print(f"dact_dbias {args.kind} {args.rows}x{args.cols} bf16; default {default}: {base:.3f} ms")
    print("   ms   TB/s  vs default  block_r block_c warps per_sm")
    for ms, br, bc, warps, per_sm in rows[:12]:
        print(f"{ms:6.3f} {io_bytes / ms / 1e9:6.2f} {base / ms:8.2f}x  {br:7d} {bc:7d} {warps:5d} {per_sm:6d}")


if __name__ == "__main__":
    main()
