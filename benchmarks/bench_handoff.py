"""The FP8 hand-off on the GPU: Linear -> Bias [-> GELU] -> Linear under delayed scaling.

With the hand-off, the first GEMM's epilogue casts the second linear's input to
FP8 (``gemm_fp8_out``), so the high-precision activation is never written and read
back. The hand-off needs the GEMM and the epilogue on one backend; under ``auto``
the GEMM is cuBLASLt's and the epilogue would be a Triton GEMM, so the rule
declines there. This script times, side by side in one run (8192 tokens, 4096 ->
14336 -> 4096, bf16, delayed scaling):

- ``auto``: cuBLASLt GEMMs and a separate cast (what a user gets by default),
- ``triton``, hand-off rules on: Triton GEMMs, the cast in the epilogue,
- ``triton``, hand-off rules off: Triton GEMMs and a separate Triton cast,

for a training step (Linear -> Bias -> Linear, forward + backward) and for
inference (Linear -> Bias -> GELU -> Linear, forward only: the activation's
backward is what keeps the hand-off out of training steps with an activation).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

import te_fuser as te
from te_fuser.ops import rules
from te_fuser.ops.fused import DEFAULT_RULES, ForwardLinearBiasLinear

HAND_OFF = [r.name for r in DEFAULT_RULES if r.build is ForwardLinearBiasLinear]
RECIPE = te.recipe.DelayedScaling(amax_history_len=16)


def hand_off(enabled: bool):
    """The hand-off rules registered (as by default) or not, inside the block."""
    return contextlib.nullcontext() if enabled else rules.without_fusion_rules(*HAND_OFF)


def model(hidden: int, ffn: int, gelu: bool) -> te.ops.Sequential:
    torch.manual_seed(0)
    ops = [te.ops.Linear(hidden, ffn)] + ([te.ops.GELU()] if gelu else []) + [te.ops.Linear(ffn, hidden)]
    return te.ops.Sequential(*ops).cuda().bfloat16()


def step(m, x, dy, training: bool):
    def run():
        if training:
            for p in m.parameters():
                p.grad = None
            with te.autocast(recipe=RECIPE):
                y = m(x)
            y.backward(dy)
        else:
            with torch.no_grad(), te.autocast(recipe=RECIPE):
                m(x)

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_handoff needs a GPU")
        return
    t, h, f = args.tokens, args.hidden, args.ffn
    shape = f"tokens={t} hidden={h} ffn={f}"
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    rows = []
    for case, training, gelu in (("Linear-Bias-Linear fwd+bwd", True, False),
                                 ("Linear-Bias-GELU-Linear forward", False, True)):
        flops = 2 * t * h * f * 2 * (3 if training else 1)
        base_ms = None
        for label, backend_name, enabled in (("auto", "auto", True), ("triton, hand-off", "triton", True),
                                             ("triton, separate cast", "triton", False)):
            m = model(h, f, gelu)
            with te.autocast(enabled=False, backend=backend_name), hand_off(enabled):
                run = step(m, x, dy, training)
                run()
                run()  # the first call seeds the delayed scales; the second hands off
                fused = "ForwardLinearBiasLinear" in m.fusion_plan()
                ms = harness.time_ms(run)
            base_ms = base_ms or ms
            rows.append(harness.Row("handoff", case, label, shape, ms, flops / ms / 1e9, "TFLOP/s",
                                    vs_peer=base_ms / ms if label != "auto" else None,
                                    peer="auto" if label != "auto" else "",
                                    note="hand-off fired" if fused else "no hand-off"))
    harness.print_table(rows, "FP8 hand-off (delayed scaling)")
    harness.append_csv(rows)


if __name__ == "__main__":
    main()
