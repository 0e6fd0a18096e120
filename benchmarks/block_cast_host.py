"""The block cast's host work alone: ``quantize_block``'s Python (checks, allocations,
the operands it returns) with the kernel launch stubbed out, on CPU tensors, in
microseconds a call (the best of five means over 3,000 calls). What the GPU host pays on
top is the launch itself.

    python benchmarks/block_cast_host.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_refusion import per_call_us  # noqa: E402

from te_fuser.kernels.triton import cast  # noqa: E402


def measure(calls: int = 3000) -> dict[str, float]:
    """Microseconds a call of each case, the launch stubbed out meanwhile."""
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    cases = {
        "1x128 row-wise": lambda: cast.quantize_block(x, fp8, 1),
        "1x128 both copies": lambda: cast.quantize_block(x, fp8, 1, True, 0.0, True, True),
        "128x128 both copies": lambda: cast.quantize_block(x, fp8, 128, True, 0.0, True, True),
    }
    launch = cast.launch
    cast.launch = lambda *args, **meta: None  # the wrapper's own work alone
    try:
        for fn in cases.values():
            fn()  # the configuration checked and its launch constants kept
        return {name: per_call_us(fn, calls, 5) for name, fn in cases.items()}
    finally:
        cast.launch = launch


def main() -> None:
    print(f"torch {torch.__version__}; quantize_block's host work, the launch stubbed (us a call)")
    for name, us in measure().items():
        print(f"{name:<22} {us:7.2f}")


if __name__ == "__main__":
    main()
