"""The Triton dequantization of per-tensor FP8 data (GPU): its scale read once a
program (the scale grid's tile the whole tensor) against looked up element by
element through zero strides (tiles of one element: the kernel's lookup for block
scales, which the per-tensor path took before). Shapes of the GPT's backward under ``fp8_dpa``: the
saved QKV bytes and dO. The arms take turns, ``--rounds`` times (medians, µs), the
bits checked equal.

    python benchmarks/bench_dequantize.py [--shapes 16384x3072 16384x1024 8192x8192] [--rounds 9]
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

from harness import rounds_ms


def _looked_up(cast, fn):
    """``fn`` with a per-tensor scale looked up element by element: tiles of one
    element and zero strides, the grid the kernel was handed before."""
    def run():
        lookup = cast._scale_lookup
        cast._scale_lookup = lambda op: (1, 1, 0, 0)
        try:
            return fn()
        finally:
            cast._scale_lookup = lookup
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["16384x3072", "16384x1024", "8192x8192"])
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dequantize needs a GPU (the compiled Triton kernel)")
        return
    cast = importlib.import_module("te_fuser.kernels.triton.cast")  # the module: its _scale_lookup
    from te_fuser.kernels.operand import ScaledOperand

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes:
        M, N = (int(v) for v in shape.split("x"))
        data = (torch.randn(M, N, device="cuda") * 20).to(torch.float8_e4m3fn)
        op = ScaledOperand(data, torch.tensor(0.37, device="cuda"), "tensor")
        arms = {"scale once": lambda: cast.dequantize(op, torch.bfloat16)}
        arms["looked up"] = _looked_up(cast, arms["scale once"])
        same = torch.equal(arms["scale once"]().view(torch.int16), arms["looked up"]().view(torch.int16))
        med = {k: statistics.median(v) * 1e3 for k, v in rounds_ms(arms, args.rounds).items()}
        once, looked = med["scale once"], med["looked up"]
        print(f"dequantize {shape} e4m3 -> bf16: scale once {once:.1f} us ({3 * M * N / once / 1e3:.0f} GB/s), "
              f"looked up {looked:.1f} us, once / looked up {once / looked:.3f}; the same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
