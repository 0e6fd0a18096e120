"""The GPT's eager step with the ops handing x of any dims to the kernels that take
it, against the same step reshaping to rows around them (as the ops did before),
in turns in one process.

    python benchmarks/dims_ab.py [--recipes delayed current] [--rounds 10] [--steps 8] [--sizes full w128]

The "rows" arm runs the same model under patches installed around each of its
steps that put back the reshapes the ops no longer make: the FP8 quantizers
report that they do not flatten (so the linear reshapes x and dy to rows), the
linear's GEMM gets 2-D residuals and hands back (M, N) to reshape, and the
LayerNorm's lean entries get 2-D tensors. Both arms compute the same numbers;
only the host's calls differ. Rows: ms a step (median over the rounds of
``--steps`` steps back to back, the arms taking turns), and the ``Tensor.reshape``
calls a step seen by the Python profiler hook. ``w128`` is the GPT at width 128
(``profile_gpt.host_only``), where the step is the host's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from profile_gpt import RECIPES, host_only, step_fn, text_batch  # noqa: E402

from te_fuser import backend  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT, copy_weights  # noqa: E402
from te_fuser.ops.basic import linear as linear_module  # noqa: E402
from te_fuser.quantization.base import Quantizer  # noqa: E402


@contextlib.contextmanager
def as_rows():
    """The reshapes around the casts, GEMMs and LayerNorms put back (see the module docstring)."""
    gemm = linear_module.gemm
    device = torch.device("cuda", torch.cuda.current_device())
    # the norms' kernels as the ops resolve them (a size-split dispatch carries the lean entries it was made with)
    norm_fn, grad_fn = (backend.resolve(k, device).fn for k in ("layer_norm", "layer_norm_grad"))
    norm, norm_grad = norm_fn.lean, grad_fn.lean

    def gemm_rows(a, b, out_dtype, bias=None, activation=None, residual=None, fast_accum=False, compute_dtype=None,
                  bias_round=None, a_shape=None):
        if residual is not None and residual.dim() != 2:
            residual = residual.reshape(-1, residual.shape[-1])
        out = gemm(a, b, out_dtype, bias, activation, residual, fast_accum, compute_dtype, bias_round)
        return out if a_shape is None or len(a_shape) == 2 else out.reshape(*a_shape[:-1], out.shape[-1])

    def norm_rows(x, weight, bias, eps, out_dtype=None):
        out = norm(x.reshape(-1, x.shape[-1]), weight, bias, eps, out_dtype)
        return None if out is None else (out[0].reshape(x.shape), *out[1:])

    def norm_grad_rows(dy, x, weight, mean, rstd, grad_add=None):
        rows = (lambda t: t.reshape(-1, t.shape[-1]))
        out = norm_grad(rows(dy), rows(x), weight, mean, rstd, None if grad_add is None else rows(grad_add))
        return None if out is None else (out[0].reshape(dy.shape), *out[1:])

    Quantizer.flattens = False
    linear_module.gemm = gemm_rows
    norm_fn.lean, grad_fn.lean = norm_rows, norm_grad_rows
    try:
        yield
    finally:
        Quantizer.flattens = True
        linear_module.gemm = gemm
        norm_fn.lean, grad_fn.lean = norm, norm_grad


def under(context, step):
    def run():
        with context():
            step()

    return run


def reshapes_a_step(step) -> int:
    """``Tensor.reshape`` calls made from Python in one steady step (autograd's device
    threads off for it, so the backward's calls are seen), after two steps that build
    the plans and seed delayed scaling's scales (a seeding step makes its own)."""
    step()
    step()
    count = [0]

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "reshape":
            count[0] += 1

    with torch.autograd.set_multithreading_enabled(False):
        sys.setprofile(hook)
        try:
            step()
        finally:
            sys.setprofile(None)
    return count[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["delayed", "current"], choices=[r for r in RECIPES if r != "bf16"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sizes", nargs="+", default=["full", "w128"], choices=["full", "w128"])
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    for size in args.sizes:
        config = GPTConfig.gpu() if size == "full" else host_only(GPTConfig.gpu())
        torch.manual_seed(0)
        batch = text_batch(config)
        twin = TorchGPT(config, device="cuda")
        arms = {}
        for name in args.recipes:
            for label, context in (("any dims", contextlib.nullcontext), ("rows", as_rows)):
                torch.manual_seed(0)
                model = GPT(config, device="cuda")
                copy_weights(model, twin)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                arms[f"te {name}, {label}"] = under(context, step_fn(model, opt, RECIPES[name], batch, clip=args.clip))
        arms["torch bf16"] = step_fn(twin, torch.optim.AdamW(twin.parameters(), lr=1e-4, fused=True), None, batch,
                                     clip=args.clip)
        counts = {label: reshapes_a_step(step) for label, step in arms.items()}
        medians = harness.interleaved_ms(arms, args.rounds, steps=args.steps, sync=torch.cuda.synchronize)
        tokens = config.batch_size * config.seq_len
        print(f"\n{size}: d {config.d_model}, {args.rounds} rounds of {args.steps} steps, arms in turns")
        print(f"{'arm':<26} {'ms/step':>8} {'k tok/s':>9} {'reshapes':>9}")
        for label, ms in medians.items():
            print(f"{label:<26} {ms:8.2f} {tokens / ms:9.0f} {counts[label]:9d}")
        for name in args.recipes:
            new, old = medians[f"te {name}, any dims"], medians[f"te {name}, rows"]
            print(f"te {name}: any dims / rows time {new / old:.3f}")


if __name__ == "__main__":
    main()
