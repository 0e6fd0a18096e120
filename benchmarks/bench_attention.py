"""Flash attention: our kernels side by side with torch SDPA bf16 (its flash and cuDNN kernels).

For each case (B, H, Hkv, T, D, causal): the forward in bf16 and in FP8 (E4M3 q, k,
v; also with the three current-scaling casts that produce them), and the backward,
each with TFLOP/s and its ratio to SDPA's (SDPA time / ours: > 1 is faster), plus
the largest difference from SDPA's output as a check. FLOPs: 4·B·H·T²·D for the
forward (half of it causal), 2.5 times that for the backward. ``of ceil`` is the
rate over the bf16 matmul ceiling measured in this run. The targets (H200, T=4096,
D=128, 16 heads, causal): bf16 forward >= 0.9x SDPA, FP8 forward >= 1.3x, backward
>= 0.9x; the last lines say which are met against each of SDPA's kernels.

    python benchmarks/bench_attention.py [--cases main all] [--sweep] [--autotune] [--csv FILE]

``--sweep`` times every launch shape of ``AUTOTUNE_CONFIGS`` for each kernel at the
main case, or at ``--sweep-case`` (the plans ``ATTENTION_PLANS`` should hold); ``--autotune`` times the
kernels under triton.autotune instead of the fixed plans and prints its picks.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Row  # noqa: E402

from te_fuser.kernels import cuda as ck  # noqa: E402
from te_fuser.kernels import triton as tk  # noqa: E402

attn = importlib.import_module("te_fuser.kernels.triton.attention")  # the module (the package exports the kernels)
cuda_attn = importlib.import_module("te_fuser.kernels.cuda.attention")  # its FP8 forward is not a backend kernel yet
E4M3 = torch.float8_e4m3fn

# name -> (B, H, Hkv, T, D, causal)
CASES = {
    "main": (4, 16, 16, 4096, 128, True),  # the targets' shape
    "noncausal": (4, 16, 16, 4096, 128, False),
    "d64": (4, 16, 16, 4096, 64, True),
    "gqa": (4, 16, 4, 4096, 128, True),
    "small": (1, 4, 4, 256, 64, True),  # launch-bound
    "gpt": (16, 16, 16, 1024, 64, True),  # the yardstick GPT's attention (examples/train_gpt.py --size gpu)
}


def _flops(B, H, T, D, causal) -> float:
    return 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)


def _label(B, H, Hkv, T, D, causal) -> str:
    return f"{B}x{H}:{Hkv}x{T}x{D}{' causal' if causal else ''}"


def _sdpa(q, k, v, causal, backend: str = "flash"):
    """torch SDPA on its flash (or cuDNN) backend (grouped kv heads through
    enable_gqa, or repeated when that backend refuses them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    gqa = q.shape[1] != k.shape[1]
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        if not gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except RuntimeError:
            G = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                                  is_causal=causal)


def _fp8(t: torch.Tensor):
    """Current scaling of ``t`` to E4M3: (data, scale_inv) through the Triton cast."""
    data, _, _, scale_inv, _ = tk.quantize_current(t.reshape(-1, t.shape[-1]), E4M3)
    return data.view(t.shape), scale_inv.reshape(())


class _Case:
    """One case's inputs (rotating sets of bf16 q, k, v on ``device``) and its rows."""

    def __init__(self, name: str, ceiling: float, device: str) -> None:
        B, H, Hkv, T, D, causal = CASES[name]
        self.causal, self.scale, self.ceiling, self.device = causal, 1 / math.sqrt(D), ceiling, device
        self.label = _label(B, H, Hkv, T, D, causal)
        self.fwd_flops = _flops(B, H, T, D, causal)
        self.bwd_flops = 2.5 * self.fwd_flops

        def make():
            q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16)
            v = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16)
            return q, k, v

        self.sets = harness.rotation(make, 2 * (B * H * T * D + 2 * B * Hkv * T * D))
        self.rows: list[Row] = []

    def row(self, case, backend, ms, flops, peer_ms=None, peer="", note="") -> float:
        rate = flops / (ms * 1e-3) / 1e12
        r = Row("attention", case, backend, self.label, ms, rate, "TFLOP/s", of_ceiling=rate / self.ceiling,
                vs_peer=None if peer_ms is None else peer_ms / ms, peer=peer, note=note)
        self.rows.append(harness.progress(r))
        return ms


def bench_case(name: str, ceiling: float, device: str = "cuda") -> list[Row]:
    """Every row of case ``name`` (on a CPU: the Triton kernels under the
    interpreter and SDPA's flash kernel; the others refuse the CPU's tensors)."""
    c = _Case(name, ceiling, device)
    sdpa_ms, o_sdpa, triton_out, cuda_out = _bf16_forward_rows(c)
    _fp8_forward_rows(c, sdpa_ms, o_sdpa)
    _backward_rows(c, triton_out, cuda_out)
    return c.rows


def _bf16_forward_rows(c: _Case):
    """SDPA's flash and cuDNN kernels, Triton's, the cuda backend's (cuDNN) and our
    Hopper kernel: ``(sdpa ms, sdpa's o, Triton's (o, lse), the cuda backend's (o,
    lse) or None where it does not take the case)``."""
    causal, scale, fwd_flops = c.causal, c.scale, c.fwd_flops
    sdpa_ms = c.row("fwd bf16", "torch sdpa flash", harness.time_ms(lambda q, k, v: _sdpa(q, k, v, causal), c.sets),
                    fwd_flops)
    try:  # cuDNN's kernel, what SDPA picks by default on Hopper: a second peer
        _sdpa(*c.sets[0], causal, "cudnn")
        c.row("fwd bf16", "torch sdpa cudnn",
              harness.time_ms(lambda q, k, v: _sdpa(q, k, v, causal, "cudnn"), c.sets), fwd_flops, sdpa_ms,
              "sdpa bf16")
    except RuntimeError as err:
        print(f"  (sdpa cudnn: {str(err)[:80]})")
    q, k, v = c.sets[0]
    o_sdpa = _sdpa(q, k, v, causal)
    o, lse = tk.attention_forward(q, k, v, causal, scale)
    diff = f"max|o - sdpa| {(o.float() - o_sdpa.float()).abs().max().item():.2e}"
    c.row("fwd bf16", "triton", harness.time_ms(lambda q, k, v: tk.attention_forward(q, k, v, causal, scale), c.sets),
          fwd_flops, sdpa_ms, "sdpa bf16", diff)
    cuda_out = None
    if ck.attention_forward_unsupported_reason(q, k) is None:  # the cuda backend's kernels (cuDNN)
        cuda_out = ck.attention_forward(q, k, v, causal, scale)
        o_c = cuda_out[0]
        diff = f"max|o - sdpa| {(o_c.float() - o_sdpa.float()).abs().max().item():.2e}"
        c.row("fwd bf16", "cuda",
              harness.time_ms(lambda q, k, v: ck.attention_forward(q, k, v, causal, scale), c.sets), fwd_flops,
              sdpa_ms, "sdpa bf16", diff)
    if cuda_attn.attention_forward_hopper_unsupported_reason(q, k) is None:  # our Hopper kernel (wgmma)
        o_h, _ = cuda_attn.attention_forward_hopper(q, k, v, causal, scale)
        diff = (f"max|o - sdpa| {(o_h.float() - o_sdpa.float()).abs().max().item():.2e}, "
                f"max|o - triton| {(o_h.float() - o.float()).abs().max().item():.2e}")
        c.row("fwd bf16", "cuda hopper", harness.time_ms(
            lambda q, k, v: cuda_attn.attention_forward_hopper(q, k, v, causal, scale), c.sets), fwd_flops, sdpa_ms,
            "sdpa bf16", diff)
    return sdpa_ms, o_sdpa, (o, lse), cuda_out


def _fp8_forward_rows(c: _Case, sdpa_ms: float, o_sdpa: torch.Tensor) -> None:
    """The FP8 forwards (E4M3 q, k, v by current scaling): Triton's, with the three
    casts, and our Hopper kernel under each consumer schedule."""
    causal, scale, fwd_flops = c.causal, c.scale, c.fwd_flops
    fp8_sets = [tuple(x for t in s for x in _fp8(t)) for s in c.sets]  # (q8, qsi, k8, ksi, v8, vsi)
    p_scale = torch.tensor(448.0, device=c.device)

    def fp8_forward(q8, qsi, k8, ksi, v8, vsi):
        return tk.attention_forward_fp8(q8, k8, v8, qsi, ksi, vsi, p_scale, causal, scale, torch.bfloat16)

    o8, _ = fp8_forward(*fp8_sets[0])
    diff = f"max|o - sdpa| {(o8.float() - o_sdpa.float()).abs().max().item():.2e}"
    c.row("fwd fp8", "triton", harness.time_ms(fp8_forward, fp8_sets), fwd_flops, sdpa_ms, "sdpa bf16", diff)
    c.row("fwd fp8 + q/k/v casts", "triton",
          harness.time_ms(lambda q, k, v: fp8_forward(*_fp8(q), *_fp8(k), *_fp8(v)), c.sets), fwd_flops, sdpa_ms,
          "sdpa bf16")
    q8 = fp8_sets[0][0]
    if cuda_attn.attention_forward_fp8_unsupported_reason(q8, q8) is not None:  # our Hopper kernel (wgmma)
        return

    def fp8_forward_cuda(q8, qsi, k8, ksi, v8, vsi):
        return cuda_attn.attention_forward_fp8(q8, k8, v8, qsi, ksi, vsi, p_scale, causal, scale, torch.bfloat16)

    o8c, _ = fp8_forward_cuda(*fp8_sets[0])
    diff = (f"max|o - sdpa| {(o8c.float() - o_sdpa.float()).abs().max().item():.2e}, "
            f"max|o - triton fp8| {(o8c.float() - o8.float()).abs().max().item():.2e}")
    c.row("fwd fp8", "cuda", harness.time_ms(fp8_forward_cuda, fp8_sets), fwd_flops, sdpa_ms, "sdpa bf16", diff)
    default = cuda_attn.set_hopper_schedule()
    try:  # the other schedules of the consumers: in order (other bits), without turns (the same bits)
        for turns, overlap, schedule in ((True, False, "cuda, in order"), (False, False, "cuda, in order, no turns"),
                                         (False, True, "cuda, no turns")):
            cuda_attn.set_hopper_schedule(turns, overlap)
            o8s = fp8_forward_cuda(*fp8_sets[0])[0]
            note = ("the same bits" if torch.equal(o8s, o8c) else
                    f"max|o - overlapped| {(o8s.float() - o8c.float()).abs().max().item():.2e}")
            c.row("fwd fp8", schedule, harness.time_ms(fp8_forward_cuda, fp8_sets), fwd_flops, sdpa_ms, "sdpa bf16",
                  note)
    finally:
        cuda_attn.set_hopper_schedule(*default)


def _backward_rows(c: _Case, triton_out: tuple, cuda_out: tuple | None) -> None:
    """The bf16 backwards from each forward's o and lse: SDPA's flash and cuDNN
    kernels, Triton's two kernels, the cuda backend's (its deterministic default, then
    cuDNN's)."""
    causal, scale, bwd_flops = c.causal, c.scale, c.bwd_flops
    q, k, v = c.sets[0]
    o, lse = triton_out
    do = torch.randn_like(q)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o_graph = _sdpa(qg, kg, vg, causal)
    sdpa_bwd_ms = c.row("bwd bf16", "torch sdpa flash", harness.time_ms(
        lambda: torch.autograd.grad(o_graph, (qg, kg, vg), do, retain_graph=True)), bwd_flops)
    dq_sdpa = torch.autograd.grad(o_graph, (qg, kg, vg), do, retain_graph=True)[0]
    dq = tk.attention_backward(q, k, v, o, lse, do, causal, scale)[0]
    diff = f"max|dq - sdpa| {(dq.float() - dq_sdpa.float()).abs().max().item():.2e}"
    c.row("bwd bf16", "triton", harness.time_ms(lambda: tk.attention_backward(q, k, v, o, lse, do, causal, scale)),
          bwd_flops, sdpa_bwd_ms, "sdpa bf16", diff)
    if cuda_out is None:
        return
    try:
        with torch.enable_grad():
            o_cg = _sdpa(qg, kg, vg, causal, "cudnn")
        c.row("bwd bf16", "torch sdpa cudnn", harness.time_ms(
            lambda: torch.autograd.grad(o_cg, (qg, kg, vg), do, retain_graph=True)), bwd_flops, sdpa_bwd_ms,
            "sdpa bf16")
    except RuntimeError as err:
        print(f"  (sdpa cudnn backward: {str(err)[:80]})")
    o_c, lse_c = cuda_out
    for choice, label in (("fastest", "cuda"), ("cudnn", "cuda cudnn")):  # the default, then cuDNN's (atomics)
        previous = cuda_attn.set_backward_kernel(choice)
        try:
            dq = ck.attention_backward(q, k, v, o_c, lse_c, do, causal, scale)[0]
            diff = f"max|dq - sdpa| {(dq.float() - dq_sdpa.float()).abs().max().item():.2e}"
            c.row("bwd bf16", label, harness.time_ms(
                lambda: ck.attention_backward(q, k, v, o_c, lse_c, do, causal, scale)), bwd_flops, sdpa_bwd_ms,
                "sdpa bf16", diff)
        finally:
            cuda_attn.set_backward_kernel(previous)
    if cuda_attn.attention_forward_hopper_unsupported_reason(q, k) is None:
        _hopper_dkdv_rows(c, o, lse, do, dq_sdpa, sdpa_bwd_ms)


def _hopper_dkdv_rows(c: _Case, o, lse, do, dq_sdpa, sdpa_bwd_ms: float) -> None:
    """The deterministic backwards with our Hopper kernels: Triton's dq kernel (which
    also stores delta), then our dk / dv kernel, each part alone (Triton's dk / dv
    kernel's time is its whole backward's less its dq kernel's), and our backward
    whose dk / dv kernel also adds dq (with delta before and dq's store after), and
    (causal) that backward with dq stored or delta made in its dk / dv kernel."""
    causal, scale, bwd_flops = c.causal, c.scale, c.bwd_flops
    q, k, v = c.sets[0]

    def backward():
        dq, delta = attn.attention_dq(q, k, v, o, lse, do, causal, scale)
        return (dq, *cuda_attn.attention_dkdv_hopper(q, k, v, o, lse, do, causal, scale, delta=delta))

    dk_triton = tk.attention_backward(q, k, v, o, lse, do, causal, scale)[1]
    dq, dk, _ = backward()
    diff = (f"max|dq - sdpa| {(dq.float() - dq_sdpa.float()).abs().max().item():.2e}, "
            f"max|dk - triton| {(dk.float() - dk_triton.float()).abs().max().item():.2e}")
    c.row("bwd bf16", "triton dq + cuda hopper dk/dv", harness.time_ms(backward), bwd_flops, sdpa_bwd_ms,
          "sdpa bf16", diff)
    delta = attn.attention_dq(q, k, v, o, lse, do, causal, scale)[1]
    c.row("bwd bf16 part", "triton dq (and delta)", harness.time_ms(
        lambda: attn.attention_dq(q, k, v, o, lse, do, causal, scale)), bwd_flops, sdpa_bwd_ms)
    c.row("bwd bf16 part", "cuda hopper dk/dv", harness.time_ms(
        lambda: cuda_attn.attention_dkdv_hopper(q, k, v, o, lse, do, causal, scale, delta=delta)), bwd_flops,
        sdpa_bwd_ms)
    dq, dk, _ = cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, causal, scale)
    diff = (f"max|dq - sdpa| {(dq.float() - dq_sdpa.float()).abs().max().item():.2e}, "
            f"max|dk - triton| {(dk.float() - dk_triton.float()).abs().max().item():.2e}")
    c.row("bwd bf16", "cuda hopper", harness.time_ms(
        lambda: cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, causal, scale)), bwd_flops, sdpa_bwd_ms,
        "sdpa bf16", diff)
    if not causal:
        return
    for stages, label in (((False, False), "nothing else"), ((True, False), "dq"), ((False, True), "delta"),
                          ((True, True), "dq and delta")):
        previous = cuda_attn.set_hopper_backward_stages(*stages)
        try:  # the same bits as the row above, whose stages are chosen by shape (test_cuda_attention_hopper.py)
            c.row("bwd bf16", f"cuda hopper, {label} in its dk/dv kernel", harness.time_ms(
                lambda: cuda_attn.attention_backward_hopper(q, k, v, o, lse, do, causal, scale)), bwd_flops,
                sdpa_bwd_ms, "sdpa bf16")
        finally:
            cuda_attn.set_hopper_backward_stages(*previous)


_JIT = {"fwd": "_attention_forward_kernel", "fwd_fp8": "_attention_forward_kernel", "dq": "_attention_dq_kernel",
        "dkdv": "_attention_dkdv_kernel"}


def _resources(kernel: str, plan) -> str:
    """The registers and local (spilled) bytes a thread of ``kernel``'s build at
    ``plan`` (the builds the direct launches kept; each specialization), or ""."""
    from te_fuser.kernels.triton import _launch

    jit_fn = getattr(attn, _JIT[kernel])
    seen = []
    for key, (compiled, _) in list(_launch._kept.items()):
        meta = dict(key[2])
        if key[0] is not jit_fn or (meta.get("BLOCK_M"), meta.get("BLOCK_N"), meta.get("num_warps"),
                                    meta.get("num_stages")) != (plan.block_m, plan.block_n, plan.num_warps,
                                                                plan.num_stages):
            continue
        if kernel in ("fwd", "fwd_fp8") and meta.get("FP8") != (kernel == "fwd_fp8"):
            continue
        regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
        if regs is not None:
            seen.append(f"{regs} regs, {spills} B local")
    return "; ".join(dict.fromkeys(seen))


def sweep(ceiling: float, case_name: str = "main", kernels=None, device: str = "cuda") -> list[Row]:
    """Every launch shape of AUTOTUNE_CONFIGS for each kernel (or those named), at
    one case (a shape that does not fit is a row with its error)."""
    B, H, Hkv, T, D, causal = CASES[case_name]
    label, scale = _label(B, H, Hkv, T, D, causal), 1 / math.sqrt(D)
    q, k, v = (torch.randn(B, h, T, D, device=device, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    (q8, qsi), (k8, ksi), (v8, vsi) = _fp8(q), _fp8(k), _fp8(v)
    p_scale = torch.tensor(448.0, device=device)
    o, lse = tk.attention_forward(q, k, v, causal, scale)
    do = torch.randn_like(q)
    calls = {
        "fwd": (lambda: tk.attention_forward(q, k, v, causal, scale), 1.0),
        "fwd_fp8": (lambda: tk.attention_forward_fp8(q8, k8, v8, qsi, ksi, vsi, p_scale, causal, scale,
                                                     torch.bfloat16), 1.0),
        "dq": (lambda: tk.attention_backward(q, k, v, o, lse, do, causal, scale), 2.5),
        "dkdv": (lambda: tk.attention_backward(q, k, v, o, lse, do, causal, scale), 2.5),
    }
    rows = []
    for kernel, configs in attn.AUTOTUNE_CONFIGS.items():
        if kernels and kernel not in kernels:
            continue
        fn, factor = calls[kernel]
        saved = attn.ATTENTION_PLANS.get((kernel, D))
        for config in configs:
            plan = attn.AttentionPlan(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                                      config.num_stages, config.kwargs.get("ONE_LOOP", False))
            attn.ATTENTION_PLANS[(kernel, D)] = plan
            try:
                fn()
                ms, note = harness.time_ms(fn), _resources(kernel, plan)
            except Exception as err:  # a shape that does not fit (shared memory, registers) is reported
                ms, note = float("nan"), f"{type(err).__name__}: {str(err)[:60]}"
            rate = factor * _flops(B, H, T, D, causal) / (ms * 1e-3) / 1e12
            case = (f"{kernel} {plan.block_m}x{plan.block_n} w{plan.num_warps} s{plan.num_stages}"
                    + (" one loop" if plan.one_loop else "")
                    + (" (whole backward)" if kernel in ("dq", "dkdv") else ""))
            rows.append(harness.progress(Row("attention-sweep", case, "triton", label, ms, rate, "TFLOP/s",
                                             of_ceiling=rate / ceiling, note=note)))
        if saved is not None:
            attn.ATTENTION_PLANS[(kernel, D)] = saved
    return rows


def _targets(rows: list[Row]) -> None:
    """Each target against SDPA's flash kernel and against its cuDNN kernel (what
    SDPA picks by default on Hopper), for what the auto backend runs: the cuda
    backend's (cuDNN) bf16 forward where it ran, the FP8 forwards, the deterministic
    backwards (Triton's, the cuda backend's default, our Hopper kernels'), and our
    Hopper kernels' forwards where they ran."""
    main = _label(*CASES["main"])
    wanted = {"fwd bf16": 0.9, "fwd fp8": 1.3, "bwd bf16": 0.9}
    ms = {(r.case, r.backend): r.ms for r in rows if r.shape == main}
    print()
    for case, target in wanted.items():
        peer_case = "bwd bf16" if case.startswith("bwd") else "fwd bf16"
        if case == "fwd bf16":  # cuDNN's (the cuda backend's) where it ran, else Triton's; and our Hopper kernel's
            candidates = (["cuda"] if (case, "cuda") in ms else ["triton"]) + (
                ["cuda hopper"] if (case, "cuda hopper") in ms else [])
        else:  # the FP8 forward: Triton's and our Hopper kernel's; the backward: the deterministic ones (not cuDNN's)
            candidates = [b for b in ("triton", "cuda", "triton dq + cuda hopper dk/dv", "cuda hopper")
                          if (case, b) in ms]
        for ours in candidates:
            for peer in ("torch sdpa flash", "torch sdpa cudnn"):
                if (peer_case, peer) in ms:
                    ratio = ms[(peer_case, peer)] / ms[(case, ours)]
                    verdict = "met" if ratio >= target else "MISSED"
                    print(f"target {case:9s} ({ours}) >= {target:.1f}x {peer} at {main}: {ratio:.2f}x  {verdict}")


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["all"], help=f"of {list(CASES)} or all")
    parser.add_argument("--sweep", action="store_true", help="time every launch shape at the main case")
    parser.add_argument("--sweep-case", default="main", choices=list(CASES), help="the case the sweep runs at")
    parser.add_argument("--sweep-kernels", nargs="+", choices=["fwd", "fwd_fp8", "dq", "dkdv"],
                        help="the kernels the sweep times (default: all)")
    parser.add_argument("--autotune", action="store_true", help="the kernels under triton.autotune")
    parser.add_argument("--csv", default=None, help="results CSV (default benchmarks/out/results.csv, untracked)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a GPU")
        return []
    attn.AUTOTUNE = args.autotune
    ceiling = harness.matmul_ceiling_tflops()
    print(f"bf16 matmul ceiling: {ceiling:.0f} TFLOP/s")
    names = list(CASES) if "all" in args.cases else args.cases
    rows: list[Row] = []
    for name in names:
        rows += bench_case(name, ceiling)
    if args.autotune:
        for kernel in attn.AUTOTUNE_CONFIGS:
            best = getattr(attn._autotuned(kernel), "best_config", None)
            print(f"autotune {kernel}: {best}")
    if args.sweep:
        sweep_rows = sweep(ceiling, args.sweep_case, args.sweep_kernels)
        harness.print_table(sweep_rows, f"attention launch shapes ({args.sweep_case} case)")
        rows += sweep_rows
    harness.append_csv(rows, args.csv)
    harness.print_table([r for r in rows if r.bench == "attention"], "flash attention vs torch SDPA bf16 (flash)")
    _targets(rows)
    return rows


if __name__ == "__main__":
    main()
