"""What one call of each CUDA entry the GPT's step uses puts on the GPU: kernels
and memsets per call, at the GPT's shapes (GPU only).

    python benchmarks/count_launches.py [--tokens 16384] [--calls 3]

A step of the yardstick GPT makes about 500 launches, 65 of them memsets, and on a
host-bound step every launch is host time. This names the entries that make the
memsets. Rows:

- the FP8 GEMMs through cuBLASLt (``fp8_gemm_tensorwise``) of each linear of a
  block (qkv 1024 -> 3072, proj 1024 -> 1024, fc1 1024 -> 4096, fc2 4096 -> 1024):
  fprop (E4M3 x E4M3, bf16 out, fast accumulation), the same into fp32 (the
  residual epilogue's input), dgrad (E5M2 x E4M3, bf16 out) and wgrad (E5M2 x E4M3
  of the transposed copies, fp32 out);
- the casts: delayed scaling with and without the transposed copy, current
  scaling with and without it, and the column-sums cast of an fp32 gradient.

Each row: kernels and memsets per call as the GPU saw them (CUPTI's device
events, driver-internal memsets included), the memset API calls per call on the
host, and the first kernel's name. ``--candidates N`` first times the first N
algorithms of cuBLASLt's heuristic for each GEMM (0 is the one the GEMM uses), with
their workspace and memsets: whether one without the memset runs as fast.
``--workspace-limit 0`` plans every GEMM (and lists the candidates) among the
algorithms that ask for no workspace.
"""

from __future__ import annotations

import argparse

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LINEARS = {"qkv": (1024, 3072), "proj": (1024, 1024), "fc1": (1024, 4096), "fc2": (4096, 1024)}  # (in, out)


def gemm_problems(tokens: int) -> dict:
    """name -> (a, b, out dtype, fast accumulation): the FP8 GEMMs of a block at the
    GPT's shapes (fresh operands, made once)."""
    dev = torch.device("cuda", torch.cuda.current_device())

    def fp8(shape, dtype):
        return (torch.randn(shape, device=dev) * 0.1).to(dtype)

    problems = {}
    for name, (k, n) in LINEARS.items():
        x, w, dy = fp8((tokens, k), E4M3), fp8((n, k), E4M3), fp8((tokens, n), E5M2)
        w_t, dy_t, x_t = fp8((k, n), E4M3), fp8((n, tokens), E5M2), fp8((k, tokens), E4M3)
        problems[f"gemm {name} fprop bf16"] = (x, w, torch.bfloat16, True)
        problems[f"gemm {name} fprop fp32"] = (x, w, torch.float32, True)
        problems[f"gemm {name} dgrad"] = (dy, w_t, torch.bfloat16, False)
        problems[f"gemm {name} wgrad"] = (dy_t, x_t, torch.float32, False)
    return problems


def _binding() -> tuple:
    """(the CUDA extension, a one-element fp32 scale of 1, the current stream's handle)."""
    from te_fuser.kernels.cuda._build import extension, raw_stream

    return extension(), torch.ones(1, device="cuda"), raw_stream(torch.device("cuda", torch.cuda.current_device()))


def gemm_cases(tokens: int) -> dict:
    """name -> a call of ``fp8_gemm_tensorwise`` (the heuristic's first algorithm) of each problem."""
    ext, one, stream = _binding()
    return {name: (lambda a=a, b=b, out=out, fast=fast: ext.fp8_gemm_tensorwise(a, b, one, one, None, out, fast,
                                                                                   stream))
            for name, (a, b, out, fast) in gemm_problems(tokens).items()}


def candidate_rows(tokens: int, candidates: int, calls: int) -> list[tuple]:
    """Per problem and candidate algorithm of cuBLASLt's heuristic (0: the one the
    GEMM uses): (problem, candidate, workspace bytes, kernels a call, memsets a call,
    ms a call, its kernel), the time a median of CUDA-event timings over ``calls``
    calls after a warm-up."""
    ext, one, stream = _binding()
    rows = []
    for name, (a, b, out, fast) in gemm_problems(tokens).items():
        for candidate in range(candidates):
            try:
                _, workspace = ext.fp8_gemm_tensorwise_candidate(a, b, one, one, out, fast, candidate, stream)
            except RuntimeError:  # the heuristic has fewer
                break

            def fn(a=a, b=b, out=out, fast=fast, candidate=candidate):
                return ext.fp8_gemm_tensorwise_candidate(a, b, one, one, out, fast, candidate, stream)

            kernels, memsets, _, first = count(fn, 2)
            times = []
            for _ in range(calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            rows.append((name, candidate, workspace, kernels, memsets, sorted(times)[len(times) // 2], first))
    return rows


def cast_cases(tokens: int) -> dict:
    """name -> a cast at the GPT's activation shape (tokens x 1024)."""
    from te_fuser.kernels.cuda import cast

    dev = torch.device("cuda")
    x = torch.randn(tokens, 1024, device=dev).to(torch.bfloat16)
    g = torch.randn(tokens, 1024, device=dev)
    scale = torch.ones((), device=dev)
    return {
        "cast delayed, both copies": lambda: cast.quantize_tensorwise(x, scale, E4M3, True, True),
        "cast delayed, row-wise only": lambda: cast.quantize_tensorwise(x, scale, E4M3, True, False),
        "cast current, both copies": lambda: cast.quantize_current(x, E4M3, rowwise=True, columnwise=True),
        "cast current, row-wise only": lambda: cast.quantize_current(x, E4M3, rowwise=True, columnwise=False),
        "cast delayed + column sums (fp32 through bf16)": lambda: cast.quantize_tensorwise_column_sums(
            g, scale, E5M2, True, True, None, True),
    }


def count(fn, calls: int) -> tuple[float, float, float, str]:
    """(kernels, memsets, memset API calls) per call of ``fn`` and its first kernel's name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = memsets = api = 0
    first = ""
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if ev.name.startswith("Memset"):
                memsets += 1
            elif not ev.name.startswith("Memcpy"):
                kernels += 1
                first = first or ev.name
        elif "emset" in ev.name and ev.name.startswith("cu"):
            api += 1
    return kernels / calls, memsets / calls, api / calls, first


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="rows of the activations (the GPT's B x T)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--candidates", type=int, default=0, metavar="N",
                   help="also time the heuristic's first N algorithms of each GEMM, with their memsets")
    p.add_argument("--workspace-limit", type=int, metavar="BYTES",
                   help="plan the GEMMs under this workspace limit (kernels.cuda.gemm.set_workspace_limit; "
                        "0: algorithms that ask for none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("count_launches needs a GPU")
        return
    if args.workspace_limit is not None:
        from te_fuser.kernels.cuda.gemm import set_workspace_limit

        set_workspace_limit(args.workspace_limit)
        print(f"GEMMs planned under a workspace limit of {args.workspace_limit} bytes")
    if args.candidates:
        print(f"{'problem':<24} {'cand':>4} {'workspace':>10} {'kernels':>8} {'memsets':>8} {'ms':>8}  kernel")
        for name, candidate, workspace, kernels, memsets, ms, first in candidate_rows(args.tokens, args.candidates,
                                                                                      21):
            print(f"{name:<24} {candidate:4d} {workspace:10d} {kernels:8.1f} {memsets:8.1f} {ms:8.4f}  {first[:60]}")
        print()
    print(f"{'entry':<48} {'kernels':>8} {'memsets':>8} {'memset API':>11}  first kernel")
    for name, fn in {**gemm_cases(args.tokens), **cast_cases(args.tokens)}.items():
        kernels, memsets, api, first = count(fn, args.calls)
        print(f"{name:<48} {kernels:8.1f} {memsets:8.1f} {api:11.1f}  {first[:70]}")


if __name__ == "__main__":
    main()
