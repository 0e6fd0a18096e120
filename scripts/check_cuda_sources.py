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
(what sets how many blocks an SM holds, and so the one-launch casts' grids). Exits
1 with the compiler's message on the first source that does not compile, 3 when
the wheels cannot be installed (nothing compiled), 0 otherwise.
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

if __name__ == "__main__":
    main()
