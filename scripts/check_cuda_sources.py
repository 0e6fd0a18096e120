"""Compile the CUDA extension's sources on a machine without a GPU.

    python scripts/check_cuda_sources.py [--toolchain DIR] [--registers]

The extension (``kernels/cuda``) is built on a GPU machine when first used, so a
source that does not compile would otherwise first fail there. This compiles every
source as that build does, up to the object code:

- each ``.cu`` with NVIDIA's ``nvcc`` and ``ptxas`` (the CUDA 13.0 compiler wheels
  and the headers of the runtime, cuBLAS and CCCL wheels, installed into
  ``--toolchain`` on first use) to sm_90a machine code, with the build's flags;
- each ``.cpp`` with the host compiler against torch's headers (and cuBLASLt's), as
  far as its syntax and types (``-fsyntax-only``).

``--registers`` prints ptxas's registers, spills and shared memory of each kernel
(what sets how many blocks an SM holds, and so the one-launch casts' grids).

Then the schedules ptxas made of the kernels whose speed rests on one
(``SCHEDULES``), read from the machine code with ``nvdisasm`` (its wheel installed
beside the compiler's): the FP8 attention forward's overlapped loop must run a
tile's exponentials between its two waits, the scores' and the last P V's (ptxas
once hoisted the second wait above them, and the softmax no longer ran beside the
tensor cores' product: nothing else would have told).

Exits 1 with the compiler's message on the first source that does not compile or
with the schedule that is not as it must be, 3 when the compiler wheels cannot be
installed (nothing compiled), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIR = ROOT / "kernels" / "cuda"
NO_TOOLCHAIN = 3  # the exit status when the compiler wheels cannot be installed (nothing was compiled)
WHEELS = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-runtime==13.0.96", "nvidia-cublas==13.1.1.3",
          "nvidia-cuda-cccl==13.0.85", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88")
DISASSEMBLER = "nvidia-cuda-nvdisasm==13.5.37"  # no 13.0 wheel exists; it reads 13.0's sm_90a code
TILE_EXPONENTIALS = 64  # a consumer thread's share of a 64 x 128 tile of S


def build_settings() -> tuple[tuple, tuple, tuple]:
    """The build's (sources, nvcc flags, host compiler flags), read from ``_build.py``
    as text (importing it would import torch's CUDA extension machinery)."""
    text = (SOURCE_DIR / "_build.py").read_text()

    def tuple_of(name: str) -> tuple:
        match = re.search(rf"^{name} = \(([^)]*)\)", text, re.M | re.S)
        if match is None:
            raise SystemExit(f"check_cuda_sources: {name} not found in kernels/cuda/_build.py")
        return tuple(re.findall(r'"([^"]+)"', match.group(1)))

    return tuple_of("SOURCES"), tuple_of("NVCC_FLAGS"), tuple_of("CXX_FLAGS")


def toolchain(directory: Path) -> Path:
    """The ``nvidia/cu13`` directory of the wheels (bin/nvcc, include/), installed on first use."""
    cuda = directory / "nvidia" / "cu13"
    if not (cuda / "bin" / "nvcc").exists():
        print(f"installing the CUDA compiler wheels into {directory} ...", flush=True)
        run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(directory), *WHEELS],
                             capture_output=True, text=True)
        if run.returncode != 0 or not (cuda / "bin" / "nvcc").exists():
            print(f"check_cuda_sources: could not install {' '.join(WHEELS)}:\n{run.stderr[-2000:]}", file=sys.stderr)
            raise SystemExit(NO_TOOLCHAIN)
    return cuda


def compile_cuda(source: Path, cuda: Path, flags: tuple, out: Path, verbose: bool) -> str:
    """``nvcc`` with the build's flags to a cubin (device code through ``ptxas``, as the
    build does); with ``verbose``, ptxas's report of each kernel's resources."""
    cmd = [str(cuda / "bin" / "nvcc"), *flags, "-I", str(SOURCE_DIR), "-I", str(cuda / "include"), "-cubin",
           *(["-Xptxas", "-v"] if verbose else []), str(source), "-o", str(out)]
    return _run(cmd, source)


def compile_host(source: Path, cuda: Path, flags: tuple) -> None:
    import torch.utils.cpp_extension as ext

    includes = [*ext.include_paths(), sysconfig.get_paths()["include"], str(SOURCE_DIR), str(cuda / "include")]
    cmd = ["g++", *[f for f in flags if f != "-O3"], "-fsyntax-only", "-DTORCH_EXTENSION_NAME=te_fuser_check",
           *[f"-I{path}" for path in includes], str(source)]
    _run(cmd, source)


def _run(cmd: list, source: Path) -> str:
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"check_cuda_sources: {source.name} does not compile:\n{(run.stdout + run.stderr)[-4000:]}")
    return run.stdout + run.stderr


def disassembler(directory: Path) -> Path | None:
    """``nvdisasm`` from its wheel in ``directory/disasm`` (installed on first use; a
    folder of its own: pip's ``--target`` does not merge into the compiler's
    ``nvidia`` package), or None where it cannot be installed."""
    tool = directory / "disasm" / "nvidia" / "cu13" / "bin" / "nvdisasm"
    if not tool.exists():
        run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(directory / "disasm"),
                              DISASSEMBLER], capture_output=True, text=True)
        if run.returncode != 0 or not tool.exists():
            print(f"check_cuda_sources: schedules not checked, {DISASSEMBLER} could not be installed:\n"
                  f"{run.stderr[-1000:]}", file=sys.stderr)
            return None
    tool.chmod(0o755)
    return tool


def kernel_code(sass: str, name_part: str) -> dict[str, str]:
    """Each kernel's machine code in ``nvdisasm -c`` output, by mangled name, of the
    kernels whose name holds ``name_part``."""
    sections = re.split(r"^\s*\.text\.(\w+):\s*$", sass, flags=re.M)
    return {name: body for name, body in zip(sections[1::2], sections[2::2]) if name_part in name}


def softmax_overlap_faults(code: str) -> list[str]:
    """Where the FP8 forward's overlapped loop does not overlap: after each wait
    for the scores (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: all but the newest product,
    P V, done) a tile's exponentials (``MUFU.EX2``) must come before the next wait.
    An empty list where every such wait is followed so (and at least one exists)."""
    events = re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)|(MUFU\.EX2)", code)
    faults, waits, exponentials, after_scores = [], 0, 0, False
    for level, exponential in events:
        if exponential:
            exponentials += 1
            continue
        if after_scores and exponentials < TILE_EXPONENTIALS:
            faults.append(f"only {exponentials} MUFU.EX2 between the scores' wait and the next (wait {level})")
        after_scores, exponentials = int(level, 16) == 1, 0
        waits += after_scores
    if after_scores and exponentials < TILE_EXPONENTIALS:
        faults.append(f"only {exponentials} MUFU.EX2 after the last scores' wait")
    return faults + ([] if waits else ["no wait for the scores alone (WARPGROUP.DEPBAR.LE gsb0, 0x1)"])


# The kernels whose speed rests on ptxas's schedule: source -> (a part of their
# names, the check that lists what is wrong in one kernel's code).
SCHEDULES = {"attention_kernels.cu": ("attention_fp8_forward_kernel", softmax_overlap_faults)}


def check_schedules(tool: Path, cubin: Path, source: str) -> int:
    """The schedules of ``source``'s kernels in ``cubin``, each checked; prints one
    line per kernel and returns how many kernels failed."""
    name_part, check = SCHEDULES[source]
    run = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"check_cuda_sources: nvdisasm failed on {cubin.name}:\n{run.stderr[-2000:]}")
    kernels = kernel_code(run.stdout, name_part)
    if not kernels:
        raise SystemExit(f"check_cuda_sources: no kernel named *{name_part}* in {source}")
    failed = 0
    for (name, code), plain in zip(kernels.items(), demangled(list(kernels))):
        faults = check(code)
        failed += bool(faults)
        print(f"  schedule {'FAILED' if faults else 'as it must be'}: {plain}" + "".join(f"\n    {f}" for f in faults))
    return failed


def resources(report: str) -> list[tuple[str, str]]:
    """(kernel, its registers and shared memory, and spills if any) from ptxas's report."""
    rows, name = [], None
    for line in report.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used and name:  # ptxas leaves the shared memory out of the line of a kernel that has none
            shared = re.search(r"(\d+) bytes smem", line)
            rows.append((name, f"REG:{used.group(1)} SHARED:{shared.group(1) if shared else 0}"))
        spill = re.search(r"(\d+) bytes spill stores", line)
        if spill and name and spill.group(1) != "0":
            rows.append((name, f"SPILL STORES:{spill.group(1)}"))
    return rows


def demangled(names: list[str]) -> list[str]:
    """The kernels' C++ names without the anonymous namespace and the parameter list
    (the mangled names where ``c++filt`` is missing)."""
    try:
        run = subprocess.run(["c++filt", "-p"], input="\n".join(names), capture_output=True, text=True)
    except FileNotFoundError:
        return names
    plain = run.stdout.splitlines() if run.returncode == 0 else names
    return [re.sub(r"^.*?\(anonymous namespace\)::", "", name) for name in plain]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toolchain", type=Path, default=ROOT / ".cuda-toolchain",
                   help="where the CUDA compiler wheels are (installed there on first use)")
    p.add_argument("--registers", action="store_true", help="also print each kernel's registers, spills, shared memory")
    args = p.parse_args(argv)
    sources, nvcc_flags, cxx_flags = build_settings()
    cuda = toolchain(args.toolchain)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        # every source at once (a compiler a core), reported in the build's order
        def check(name: str) -> str | None:
            source = SOURCE_DIR / name
            if name.endswith(".cu"):
                return compile_cuda(source, cuda, nvcc_flags, Path(tmp) / (source.stem + ".cubin"), args.registers)
            compile_host(source, cuda, cxx_flags)
            return None

        for name, job in [(name, pool.submit(check, name)) for name in sources]:
            report = job.result()  # the first source that does not compile (in this order) exits with its message
            if report is None:
                print(f"{name}: compiles (host, syntax and types)", flush=True)
                continue
            print(f"{name}: compiles (sm_90a)", flush=True)
            rows = resources(report)
            for (_, usage), kernel in zip(rows, demangled([kernel for kernel, _ in rows])):
                print(f"  {usage:<24} {kernel}")
        tool = disassembler(args.toolchain) if SCHEDULES else None
        failed = 0
        for name in SCHEDULES if tool else ():
            print(f"{name}: ptxas's schedules", flush=True)
            failed += check_schedules(tool, Path(tmp) / (Path(name).stem + ".cubin"), name)
        if failed:
            raise SystemExit(f"check_cuda_sources: {failed} kernel(s) not scheduled as they must be (above)")

if __name__ == "__main__":
    main()
