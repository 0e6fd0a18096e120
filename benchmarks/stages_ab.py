"""The Hopper attention kernels in turns beside SDPA's cuDNN kernels: per causal
shape, ``--rounds`` rounds in which each arm is timed once (``harness.time_ms``: the
median of a ``do_bench``, L2 flushed), so clock and host drift fall on every arm
alike; the medians over the rounds and their ratios.

- the backward's in-kernel stages (``set_hopper_backward_stages``): the backend's
  backward as chosen (stages by shape), with nothing in the dk / dv kernel, with dq
  stored in it, with delta made in it, and cuDNN's; every stage's dq, dk and dv
  checked bit for bit against nothing-in-the-kernel's first;
- ``--forward``: the FP8 forward (E4M3 q, k, v by current scaling, cast before the
  rounds: the QKV GEMM's epilogue writes them under ``fp8_mha``), the same with V
  handed as a transposed copy (keys inner, as a transposing cast of V writes it:
  read as it lies, K's rows copied permuted, no rewrite of V), the cuda backend's
  bf16 forward (cuDNN's unless ``set_forward_kernel`` chose ours) and cuDNN's
  bf16 forward through SDPA (#16's FP8 bar: 1.3x cuDNN's time), and our
  persistent forwards (FP8, FP8 with V given, the Hopper bf16) with their items
  dealt forwards every round instead of forwards and backwards in turn
  (``set_hopper_schedule``'s ``mirrored``: the same bits, checked); with
  ``--schedules`` also the FP8 forward under the other schedules
  (``set_hopper_schedule``: without turns, in order, in order without turns; each
  checked against the default within FP8's bound), the rewrite of V with its
  keys inner alone (the launch before the forward's every call where V is not
  rewritten in the kernel), and the FP8 forward with V rewritten in the kernel and
  by that launch (``set_hopper_schedule``'s ``v_in_kernel``: the same bits, checked).

    python benchmarks/stages_ab.py [--forward [--schedules]] [--cases 4x16x4096x128 ...] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import harness
from bench_attention import _fp8  # current scaling to E4M3: (data, scale_inv)
from te_fuser.kernels.cuda import attention as cuda_attn
from te_fuser.kernels.triton import attention as triton_attn

ARMS = {"by shape": (cuda_attn.BY_SHAPE, False), "nothing": (False, False), "dq": (True, False),
        "delta": (False, True)}


def _with(setter, settings: tuple, fn):
    """``fn`` run with ``setter(*settings)`` in force (a process setting of the
    extension's kernels that returns the previous ones), then set back."""
    def run():
        previous = setter(*settings)
        try:
            return fn()
        finally:
            setter(*previous)
    return run


def compare(B: int, H: int, T: int, D: int, rounds: int) -> None:
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(D)
    o, lse = triton_attn.attention_forward(q, k, v, True, scale)[:2]
    ours = lambda: cuda_attn.attention_backward(q, k, v, o, lse, do, True, scale)  # noqa: E731
    arms = {label: _with(cuda_attn.set_hopper_backward_stages, stages, ours) for label, stages in ARMS.items()}
    want = arms["nothing"]()
    for label, arm in arms.items():
        if not all(torch.equal(g, w) for g, w in zip(arm(), want)):
            raise SystemExit(f"{B}x{H}x{T}x{D}: {label} does not give the bits of nothing in the kernel")
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    arms["cudnn"] = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
    case = f"{B}x{H}x{T}x{D}"
    median = _print_rounds(case, harness.rounds_ms(arms, rounds))
    print(f"  {case:16s} cudnn / by shape {median['cudnn'] / median['by shape']:.3f}x, cudnn / nothing "
          f"{median['cudnn'] / median['nothing']:.3f}x, dq / nothing {median['dq'] / median['nothing']:.3f}, "
          f"delta / nothing {median['delta'] / median['nothing']:.3f}", flush=True)


def _print_rounds(case: str, times: dict) -> dict:
    """Each arm's median and rounds; returns the medians."""
    median = {label: statistics.median(t) for label, t in times.items()}
    for label, t in times.items():
        print(f"  {case:16s} {label:>9s} {median[label]:8.4f} ms  (min {min(t):.4f}; "
              + " ".join(f"{x:.3f}" for x in t) + ")")
    return median


def compare_forwards(B: int, H: int, T: int, D: int, rounds: int, schedules: bool = False) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(D)
    (q8, qsi), (k8, ksi), (v8, vsi) = _fp8(q), _fp8(k), _fp8(v)
    if cuda_attn.attention_forward_fp8_unsupported_reason(q8, k8) is not None:
        raise SystemExit(f"{B}x{H}x{T}x{D}: {cuda_attn.attention_forward_fp8_unsupported_reason(q8, k8)}")
    p_scale = torch.tensor(448.0, device="cuda")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o_cudnn = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    # V as its producer's transposed copy would hand it (keys inner): read as it lies, K's rows copied permuted
    v8_inner = v8.view(torch.uint8).transpose(2, 3).contiguous().transpose(2, 3).view(v8.dtype)
    arms = {"fp8": lambda: cuda_attn.attention_forward_fp8(q8, k8, v8, qsi, ksi, vsi, p_scale, True, scale,
                                                           torch.bfloat16),
            "fp8, V keys inner given": lambda: cuda_attn.attention_forward_fp8(q8, k8, v8_inner, qsi, ksi, vsi,
                                                                               p_scale, True, scale, torch.bfloat16),
            "bf16": lambda: cuda_attn.attention_forward(q, k, v, True, scale),
            "bf16 hopper": lambda: cuda_attn.attention_forward_hopper(q, k, v, True, scale),
            "cudnn": cudnn}
    for label in ("fp8", "fp8, V keys inner given", "bf16 hopper"):
        forwards = arms[f"{label}, dealt forwards"] = _with(cuda_attn.set_hopper_schedule,
                                                            (None, None, None, False), arms[label])
        if not all(torch.equal(a, b) for a, b in zip(forwards(), arms[label]())):
            raise SystemExit(f"{B}x{H}x{T}x{D}: the {label} forward dealt forwards is not the default's o and lse")
    o8 = arms["fp8"]()[0]
    o8_inner = arms["fp8, V keys inner given"]()[0]
    print(f"  {B}x{H}x{T}x{D}: max|o fp8 - o cudnn| {(o8.float() - o_cudnn.float()).abs().max().item():.2e}, "
          f"max|o fp8 V keys inner given - o fp8| {(o8_inner.float() - o8.float()).abs().max().item():.2e}")
    if schedules:
        for label, (turns, overlap) in SCHEDULES.items():
            arms[label] = _with(cuda_attn.set_hopper_schedule, (turns, overlap), arms["fp8"])
            other = arms[label]()[0]
            if (other.float() - o8.float()).abs().max().item() > 0.05:  # the schedules' sums differ in order only
                raise SystemExit(f"{B}x{H}x{T}x{D}: the FP8 forward {label} is not the default's o")
        from te_fuser.kernels.cuda._build import extension, stream_of_index

        index = torch.cuda.current_device()
        arms["V keys inner"] = lambda: extension().attention_fp8_keys_inner(v8, index, stream_of_index(index))
        for label, in_kernel in (("V launched", False), ("V in kernel", True)):
            arms[label] = _with(cuda_attn.set_hopper_schedule, (None, None, in_kernel), arms["fp8"])
            if not all(torch.equal(a, b) for a, b in zip(arms[label](), arms["fp8"]())):  # the same Vᵀ tiles
                raise SystemExit(f"{B}x{H}x{T}x{D}: the FP8 forward, {label}, is not the default's o and lse")
    case = f"{B}x{H}x{T}x{D} fwd"
    median = _print_rounds(case, harness.rounds_ms(arms, rounds))
    print(f"  {case:16s} cudnn / fp8 {median['cudnn'] / median['fp8']:.3f}x, cudnn / fp8 V keys inner given "
          f"{median['cudnn'] / median['fp8, V keys inner given']:.3f}x, cudnn / bf16 "
          f"{median['cudnn'] / median['bf16']:.3f}x; mirrored / dealt forwards " + ", ".join(
              f"{label} {median[label] / median[f'{label}, dealt forwards']:.3f}"
              for label in ("fp8", "fp8, V keys inner given", "bf16 hopper")) + "".join(
              f", cudnn / fp8 {label} {median['cudnn'] / median[label]:.3f}x" for label in SCHEDULES if label in median)
          + (f", V keys inner {median['V keys inner'] / median['fp8']:.1%} of fp8, V in kernel / V launched "
             f"{median['V in kernel'] / median['V launched']:.3f}" if "V keys inner" in median else ""),
          flush=True)


SCHEDULES = {"no turns": (False, True), "in order": (True, False), "in order, no turns": (False, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["4x16x4096x128", "8x16x2048x128", "2x16x8192x128",
                                                         "4x16x4096x64", "2x16x8192x64"],
                        help="B x H x T x D, causal, as many kv heads as query heads")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--forward", action="store_true", help="the forwards (FP8, bf16, cuDNN's) instead")
    parser.add_argument("--schedules", action="store_true",
                        help="with --forward: the FP8 forward's other schedules and the V rewrite alone too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("stages_ab needs a GPU (Hopper: our attention kernels' extension)")
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for case in args.cases:
        shape = (int(x) for x in case.split("x"))
        if args.forward:
            compare_forwards(*shape, rounds=args.rounds, schedules=args.schedules)
        else:
            compare(*shape, rounds=args.rounds)


if __name__ == "__main__":
    main()
