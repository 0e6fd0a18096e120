"""The yardstick GPT under FSDP2 on several GPUs: bf16, FP8, and FP8 with the FP8 weight all-gather.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--recipe current] [--steps 3] [--timed 10]
    python benchmarks/bench_distributed.py --smoke       # CPU: two local gloo processes, the smoke-size GPT

The GPT of ``te_fuser.models.gpt`` (``GPTConfig.gpu()``: 8 layers, d 1024, seq
1024, batch 16 per GPU) with ``fully_shard`` on its embeddings, every block and
its head, then the root, ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, under ``torch.autocast(bf16)`` and fused AdamW. Arms:

- ``bf16``: no FP8 recipe;
- ``fp8``: ``--recipe`` (delayed or current scaling), weights gathered in bf16;
- ``fp8_all_gather``: the same with ``te.enable_fsdp_fp8_all_gather``: the
  linears' weights gathered in FP8;
- ``torch_bf16``: the same network in plain torch (``TorchGPT``) under FSDP2: what
  FSDP2 costs a model without te_fuser;
- ``unsharded_bf16`` / ``unsharded_fp8`` / ``unsharded_torch_bf16``: those models
  and steps without ``fully_shard``, each rank alone on its GPU: the one-GPU
  baseline that the scaling efficiency (an FSDP2 arm's tokens/s per GPU over its
  unsharded twin's) is measured against.

``--profile`` adds, per arm, one profiled step: its GPU kernel time (annotations'
spans left out) beside its wall time, and the kernels that take most of it (rank 0
prints them; the JSON keeps every kernel) and the host's calls into the CUDA
runtime by time. ``--host-profile`` adds one step under cProfile, its backward on
the calling thread: the host's own time by where the Python runs (te_fuser, FSDP2,
DTensor, the optimizer, the rest of torch, calls into C), the functions that take
most of it and te_fuser's that do. ``--caller-backward`` runs every step's backward
on the calling thread (autograd's device threads off: no hand-offs between
threads); with ``--smoke --stub-kernels`` te's
kernels are ``host_time_cpu.py``'s stand-ins, so the CPU's figures are the
layers' own (the numbers computed are then meaningless).

Per arm: tokens/s per GPU (``--timed`` steps back to back), and per rank and step the bytes its
all-gathers send (counted at the one-tensor all-gather that FSDP2 and the FP8
all-gather call: ``torch.distributed.all_gather_single``, or
``all_gather_into_tensor`` where torch lacks it) and their time (on CUDA the GPU
time of the NCCL all-gather kernels in a profiled step; on CPU the time the calls
take). Rank 0 prints the table and appends rows to
``benchmarks/out/results.csv``; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import te_fuser as te  # noqa: E402
from te_fuser.models.gpt import GPT, GPTConfig, TorchGPT  # noqa: E402
from te_fuser.ops.fp8_all_gather import ALL_GATHER_NAME  # noqa: E402

ARMS = ("bf16", "fp8", "fp8_all_gather", "torch_bf16", "unsharded_bf16", "unsharded_fp8", "unsharded_torch_bf16")


class _Sent:
    """The bytes every all-gather of this rank sends (its input), and the calls' time."""

    def __init__(self) -> None:
        self.bytes, self.calls, self.seconds = 0, 0, 0.0
        self._original = getattr(dist, ALL_GATHER_NAME)

    def __enter__(self):
        def counted(output_tensor, input_tensor, *args, **kwargs):
            self.bytes += input_tensor.numel() * input_tensor.element_size()
            self.calls += 1
            t0 = time.perf_counter()
            try:
                return self._original(output_tensor, input_tensor, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(dist, ALL_GATHER_NAME, counted)
        return self

    def __exit__(self, *exc) -> None:
        setattr(dist, ALL_GATHER_NAME, self._original)


def build(arm: str, config: GPTConfig, device: torch.device, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = (TorchGPT if "torch" in arm else GPT)(config, device=device)
    if arm.startswith("unsharded"):
        return model
    if arm == "fp8_all_gather":
        te.enable_fsdp_fp8_all_gather(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model.embed, *model.blocks, model.head):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def measure(arm: str, recipe, config: GPTConfig, device: torch.device, mesh, steps: int, timed: int,
            profile: bool = False, host_profile: bool = False, caller_backward: bool = False) -> dict:
    """One arm's figures; ``caller_backward``: its backwards on the calling thread
    (autograd's device threads off), not handed to autograd's thread for the GPU."""
    with torch.autograd.set_multithreading_enabled(not caller_backward):
        return _measure(arm, recipe, config, device, mesh, steps, timed, profile, host_profile)


def _measure(arm: str, recipe, config: GPTConfig, device: torch.device, mesh, steps: int, timed: int,
             profile: bool, host_profile: bool) -> dict:
    model = build(arm, config, device, mesh)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=gen).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    fp8 = recipe if "bf16" not in arm else None

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16), te.autocast(enabled=fp8 is not None, recipe=fp8):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(steps):  # warm-up: plans built, kernels compiled, FP8 gathers under way
        step()
    with _Sent() as sent:  # the steps back to back, the host running ahead of the GPU as in training
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(timed):
            loss = step()
        if cuda:
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / timed
    gather_ms = sent.seconds * 1e3 / timed
    if cuda:
        gather_ms = _nccl_all_gather_ms(step)
    kernels = _profiled_step(step, cuda) if profile else None
    host = _host_profile(step, cuda) if host_profile else None
    return {"arm": arm, "device": str(device), "kernels": kernels, "host": host, "step_ms": step_s * 1e3,
            "tokens_per_s_per_gpu": config.batch_size * config.seq_len / step_s,
            "all_gather_bytes_per_step": sent.bytes // timed, "all_gathers_per_step": sent.calls // timed,
            "all_gather_ms_per_step": gather_ms, "loss": loss.item(), "gathers": te.fp8_all_gather_stats(model)}


def _nccl_all_gather_ms(step) -> float:
    """GPU milliseconds of one step's NCCL all-gather kernels (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if "AllGather" in e.key)
    return total_us / 1e3


def _profiled_step(step, cuda: bool, top: int = 12) -> dict:
    """One step under the profiler: its wall time, its kernels' total device time, the
    ``top`` kernels (or, without a GPU, operators) by self time, and the host's calls
    into the CUDA runtime by time (allocations, synchronizations: what blocks a host
    beside its launches)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0
              and not _annotation(e)]
    events = [e for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events.sort(key=own, reverse=True)
    runtime = sorted(((e.key, e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
                      if e.key.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda r: -r[2])
    return {"wall_ms": wall * 1e3, "busy_ms": sum(own(e) for e in events) / 1e3,
            "top": [(e.key[:90], e.count, own(e) / 1e3) for e in events[:top]],
            "all": [(e.key, e.count, own(e) / 1e3) for e in events], "runtime": runtime[:8]}


# where a function's own host time goes, by the path of its source (first match)
_HOST_PLACES = (("te_fuser", ("/te_fuser/", "/kernels/")), ("FSDP2", ("/torch/distributed/fsdp/",)),
                ("DTensor", ("/torch/distributed/tensor/",)), ("optimizer", ("/torch/optim/",)),
                ("torch.distributed", ("/torch/distributed/",)), ("torch", ("/torch/",)), ("calls into C", ("~",)))


def _host_profile(step, cuda: bool, top: int = 12) -> dict:
    """One step under cProfile with autograd's device threads off (the backward on
    this thread, where cProfile sees it): milliseconds of own time by place
    (``_HOST_PLACES``, else "other"), the ``top`` functions by own time, and
    te_fuser's own ``top`` (what of te's grows under FSDP2)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        if cuda:
            torch.cuda.synchronize()
        profiler.enable()
        step()
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    places: dict[str, float] = {}
    for (path, _, _), (_, _, own, _, _) in stats.items():
        place = next((name for name, marks in _HOST_PLACES if any(m in path for m in marks)), "other")
        places[place] = places.get(place, 0.0) + own * 1e3
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])
    te_marks = _HOST_PLACES[0][1]
    te_ranked = [kv for kv in ranked if any(m in kv[0][0] for m in te_marks)]

    def rows(items):
        return [(f"{name} ({Path(path).name}:{line})", v[0], v[2] * 1e3) for (path, line, name), v in items[:top]]

    return {"own_ms": places, "calls": sum(v[0] for v in stats.values()), "top": rows(ranked),
            "te_top": rows(te_ranked)}


def _annotation(event) -> bool:
    """A span that names work (FSDP2's ``FSDP::...``, the optimizer's step, a
    ``record_function``), not work of its own: on the GPU its time is the span of
    the kernels under it, gaps included."""
    return getattr(event, "is_user_annotation", False) or event.key.startswith(("FSDP::", "Optimizer.", "ProfilerStep"))


def run(rank: int, world: int, args) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world and not args.smoke
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        if getattr(args, "stub_kernels", False):
            if cuda:
                raise SystemExit("--stub-kernels: the CPU run's host study only (with --smoke)")
            from host_time_cpu import stub_kernels

            stub_kernels(update_in_call=True)
        mesh = init_device_mesh(device.type, (world,))
        config = GPTConfig.smoke() if args.smoke else GPTConfig.gpu()
        recipe = {"delayed": te.recipe.DelayedScaling(), "current": te.recipe.Float8CurrentScaling()}[args.recipe]
        figures = [measure(arm, recipe, config, device, mesh, args.steps, args.timed, getattr(args, "profile", False),
                           getattr(args, "host_profile", False), getattr(args, "caller_backward", False))
                   for arm in args.arms]
        if rank == 0:
            report(figures, config, world, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def report(figures: list[dict], config: GPTConfig, world: int, args) -> None:
    shape = f"GPT {config.n_layer}x{config.d_model}, seq {config.seq_len}, batch {config.batch_size}/GPU, {world} ranks"
    base = next((f for f in figures if f["arm"] == "bf16"), None)
    unsharded = {f["arm"].removeprefix("unsharded_"): f for f in figures if f["arm"].startswith("unsharded")}
    for f in figures:  # scaling efficiency: tokens/s per GPU over the unsharded twin's on one GPU
        twin = unsharded.get(f["arm"] if "bf16" in f["arm"] else "fp8")
        f["vs_unsharded"] = (f["tokens_per_s_per_gpu"] / twin["tokens_per_s_per_gpu"]
                             if twin and not f["arm"].startswith("unsharded") else None)
    print(shape)
    print(f"{'arm':20} {'tok/s/GPU':>12} {'vs bf16':>8} {'vs 1 GPU':>9} {'step ms':>9} {'AG MB/step':>11} "
          f"{'AG ms/step':>11}")
    for f in figures:
        ratio = f["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
        eff = f"{f['vs_unsharded']:9.2f}" if f["vs_unsharded"] is not None else f"{'-':>9}"
        print(f"{f['arm']:20} {f['tokens_per_s_per_gpu']:12.0f} {ratio:8.2f} {eff} {f['step_ms']:9.2f} "
              f"{f['all_gather_bytes_per_step'] / 2**20:11.2f} {f['all_gather_ms_per_step']:11.2f}")
    for f in figures:
        if f.get("kernels"):
            k = f["kernels"]
            what = "kernels" if "cuda" in str(f.get("device", "")) else "operators (self CPU time)"
            print(f"\n{f['arm']}: a profiled step {k['wall_ms']:.2f} ms, {what} {k['busy_ms']:.2f} ms")
            for name, count, ms in k["top"]:
                print(f"  {ms:9.3f} ms {count:5d}x  {name}")
            if k.get("runtime"):
                print("  the host's calls into the CUDA runtime: "
                      + ", ".join(f"{name} {count}x {ms:.2f} ms" for name, count, ms in k["runtime"]))
    for f in figures:
        if f.get("host"):
            h = f["host"]
            places = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(h["own_ms"].items(), key=lambda kv: -kv[1]))
            print(f"\n{f['arm']}: a step's host time under cProfile, ms of own time by place ({h['calls']} calls): "
                  f"{places}")
            for name, count, ms in h["top"]:
                print(f"  {ms:9.3f} ms {count:6d}x  {name}")
            print("  te_fuser's own:")
            for name, count, ms in h.get("te_top", []):
                print(f"  {ms:9.3f} ms {count:6d}x  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "recipe": args.recipe, "arms": figures}, indent=1))
    if not args.no_csv:
        import harness

        rows = [harness.Row("distributed_fsdp2", f"{f['arm']} ({args.recipe})", "auto", shape, f["step_ms"],
                            f["tokens_per_s_per_gpu"], "tok/s/GPU",
                            vs_peer=(f["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]) if base else None,
                            peer="bf16 arm", extra={"all_gather_bytes": f["all_gather_bytes_per_step"],
                                                    "all_gather_ms": round(f["all_gather_ms_per_step"], 3)})
                for f in figures]
        print(f"rows appended to {harness.append_csv(rows)}")


def _spawned(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    run(rank, world, args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    p.add_argument("--recipe", default="current", choices=["delayed", "current"])
    p.add_argument("--steps", type=int, default=3, help="warm-up steps per arm")
    p.add_argument("--timed", type=int, default=10, help="timed steps per arm")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, the smoke-size GPT, two local processes")
    p.add_argument("--profile", action="store_true", help="per arm, one profiled step's kernels (rank 0 prints)")
    p.add_argument("--host-profile", action="store_true",
                   help="per arm, one step's host time under cProfile by place (rank 0 prints)")
    p.add_argument("--stub-kernels", action="store_true",
                   help="with --smoke: te's kernels as stand-ins (host_time_cpu.py's): the CPU's times are the host's")
    p.add_argument("--caller-backward", action="store_true",
                   help="every arm's backwards on the calling thread (autograd's device threads off)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-csv", action="store_true")
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as sock:  # two local processes, meeting on a free port
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(KeyboardInterrupt):
        torch.multiprocessing.spawn(_spawned, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
