"""One kernel's auto-table entry A/B on the GPT's eager training step, in one process:
the entry switched between two backends (``te_fuser.backend.set_auto_entry``) in
turns, the order reversed every other round, one untimed step after each switch
(the plans rebuild for it), then ``--steps`` steps timed between two syncs.

    python benchmarks/auto_entry_ab.py --kernel dact_dbias --entries triton cuda [--full-size] [--rounds 8]
    python benchmarks/auto_entry_ab.py --cuda-forward [--entries cudnn hopper]
    python benchmarks/auto_entry_ab.py --kernel attention_backward --cuda-backward hopper

``--cuda-forward`` takes, instead of an auto entry, the cuda backend's bf16
attention forward in turns: cuDNN's and our Hopper kernel's (``set_forward_kernel``).
``--cuda-backward NAME`` makes NAME the cuda backend's attention backward first
(``set_backward_kernel``: the fastest deterministic one, the default; our Hopper
kernels wherever they run; cuDNN's), e.g. to take Triton's and ours in turns.

Per recipe: each entry's median ms a step and in how many rounds the second entry
was faster. Between processes the host's speed moves by ±15% (RESULTS.md), so an
entry's worth is measured in turns within one. At width 128 (the default) the step
is its host's; ``--full-size`` runs the GPT of DESIGN.md §6. On a machine without a
GPU the auto table sends every kernel to the reference, so both entries run the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_gpt import RECIPES, host_only, step_fn, text_batch  # noqa: E402

from te_fuser import backend  # noqa: E402
from te_fuser.kernels.contract import KERNELS  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig  # noqa: E402


def compare(step, switch, entries: list[str], rounds: int, steps: int, sync) -> dict:
    """Per entry, its ms a step in each round (the entries in turns; ``switch(entry)``
    makes one the current)."""
    times: dict = {entry: [] for entry in entries}
    for entry in entries * 2:  # every entry's plans built and warm before the first timed round
        switch(entry)
        step()
    for r in range(rounds):
        for entry in (entries if r % 2 == 0 else entries[::-1]):
            switch(entry)
            step()  # the rebuild for this entry, untimed
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times[entry].append((time.perf_counter() - t0) * 1e3 / steps)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", help="a kernel of kernels/contract.py's KERNELS")
    p.add_argument("--entries", nargs=2, default=None, metavar="BACKEND",
                   help="the two backends the entry takes in turns (default: triton cuda)")
    p.add_argument("--cuda-forward", action="store_true",
                   help="instead of an auto entry, the cuda backend's attention forward kernels in turns "
                        "(set_forward_kernel; default entries: cudnn hopper)")
    p.add_argument("--cuda-backward", default=None, choices=["fastest", "hopper", "cudnn"],
                   help="the cuda backend's attention backward for this run (set_backward_kernel)")
    p.add_argument("--recipes", nargs="+", default=["current", "delayed"], choices=sorted(RECIPES))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps timed a turn")
    p.add_argument("--full-size", action="store_true", help="the GPT at its GPU size (default: width 128)")
    args = p.parse_args(argv)
    if args.cuda_forward:
        args.kernel = "attention_forward"
        args.entries = args.entries or ["cudnn", "hopper"]
    elif args.kernel not in KERNELS:
        p.error(f"--kernel: must be one of {sorted(KERNELS)}, got {args.kernel!r}")
    args.entries = args.entries or ["triton", "cuda"]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    base = GPTConfig.gpu() if cuda else GPTConfig.smoke()
    config = base if args.full_size else host_only(base)
    torch.manual_seed(0)
    batch = (text_batch(config) if cuda
             else torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1)))
    model = GPT(config, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first, second = args.entries
    if args.cuda_backward is not None:
        from te_fuser.kernels.cuda import attention as cuda_attention

        cuda_attention.set_backward_kernel(args.cuda_backward)
    if args.cuda_forward:
        from te_fuser.kernels.cuda import attention as cuda_attention

        for entry in args.entries:
            if entry not in cuda_attention.FORWARD_KERNELS:
                p.error(f"--entries: with --cuda-forward, of {list(cuda_attention.FORWARD_KERNELS)}, got {entry!r}")
        previous = cuda_attention.set_forward_kernel(first)
        switch = cuda_attention.set_forward_kernel
        restore = lambda: cuda_attention.set_forward_kernel(previous)  # noqa: E731
    else:
        previous = backend.set_auto_entry(args.kernel, first)
        switch = lambda entry: backend.set_auto_entry(args.kernel, entry)  # noqa: E731
        restore = lambda: backend.set_auto_entry(args.kernel, previous if previous is not None else "triton")  # noqa
    try:
        print(f"torch {torch.__version__}, {device}, width {config.d_model}, {args.kernel}: {first} against "
              f"{second}, {args.rounds} rounds x {args.steps} steps in turns (medians, ms a step)")
        for name in args.recipes:
            step = step_fn(model, opt, RECIPES[name], batch, device_type=device, clip=1.0)
            times = compare(step, switch, [first, second], args.rounds, args.steps, sync)
            a, b = statistics.median(times[first]), statistics.median(times[second])
            wins = sum(x > y for x, y in zip(times[first], times[second]))
            print(f"te {name:<8} {first} {a:8.2f}  {second} {b:8.2f}  ({b / a:.3f}x; {second} faster in "
                  f"{wins}/{args.rounds} rounds)", flush=True)
    finally:
        restore()


if __name__ == "__main__":
    main()
