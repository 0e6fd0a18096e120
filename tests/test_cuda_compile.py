"""The CUDA backend's sources compile for sm_90a, with the flags of the JIT build.

Runs on CPU-only machines: nvcc compiles the device code (no GPU needed), and
the host compiler checks the Python binding (it includes no torch header, only
pybind11). Skipped only when nvcc (or, for the binding, a C++ compiler) is absent.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from te_fuser.kernels.cuda import _build

SOURCE_DIR = _build.SOURCE_DIR
REPO = Path(__file__).resolve().parent.parent
# .ci/run compiles every source after the suite with scripts/check_cuda_sources.py (the
# CUDA 13.0 wheels' toolchain, the .cpp files against torch's and cuBLAS's headers
# too) and sets this, so the suite does not compile them a second time there.
COMPILED_BY_SCRIPT = os.environ.get("TE_FUSER_CUDA_SOURCES_CHECKED_BY") == "scripts/check_cuda_sources.py"
_BY_SCRIPT = pytest.mark.skipif(COMPILED_BY_SCRIPT, reason="compiled after the suite by scripts/check_cuda_sources.py")


def _nvcc() -> str | None:
    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _include_flags() -> list[str]:
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{SOURCE_DIR}"]


def _compile_cu(nvcc: str, source: Path, out_dir: Path) -> subprocess.CompletedProcess:
    cmd = [nvcc, "-c", *_build.NVCC_FLAGS, *cpp_extension.COMMON_NVCC_FLAGS, *_include_flags(), str(source),
           "-o", str(out_dir / f"{source.stem}.o")]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True)


def test_build_flags_target_sm90a_without_fast_math():
    flags = " ".join(_build.NVCC_FLAGS)
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    for unsafe in ("fast_math", "fast-math", "-ftz=true", "-prec-div=false"):
        assert unsafe not in flags, f"{unsafe} breaks the bit-exact casts"


def test_every_source_is_built_and_shipped():
    on_disk = {p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".cu", ".cpp")}
    assert on_disk == set(_build.SOURCES), "every .cu/.cpp in kernels/cuda must be in _build.SOURCES"
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["te_fuser.kernels.cuda"]
    for path in SOURCE_DIR.iterdir():
        if path.suffix in (".cu", ".cuh", ".cpp", ".h", ".hpp"):
            assert any(fnmatch.fnmatch(path.name, pat) for pat in patterns), f"{path.name} is not package data"


@_BY_SCRIPT
@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_device_sources_compile_for_sm90a(tmp_path):
    nvcc = _nvcc()
    sources = sorted(SOURCE_DIR.glob("*.cu"))
    assert sources
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: (s, _compile_cu(nvcc, s, tmp_path)), sources))
    failures = [f"{s.name}:\n{r.stderr}" for s, r in results if r.returncode != 0]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)
    for source, _ in results:
        assert (tmp_path / f"{source.stem}.o").stat().st_size > 0


@_BY_SCRIPT
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_binding_compiles():
    cxx = shutil.which("c++") or shutil.which("g++")
    python_include = sysconfig.get_paths()["include"]
    cmd = [cxx, "-fsyntax-only", *_build.CXX_FLAGS, "-DTORCH_EXTENSION_NAME=te_fuser_cuda_kernels",
           *_include_flags(), f"-I{python_include}", str(SOURCE_DIR / "binding.cpp")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


def test_sources_compile_check_catches_errors(tmp_path):
    """The check is real: a broken kernel fails it."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    broken = tmp_path / "broken.cu"
    broken.write_text('#include "fp8_common.cuh"\n__global__ void k(float* p) { p[0] = undefined_symbol; }\n')
    result = _compile_cu(nvcc, broken, tmp_path)
    assert result.returncode != 0 and "undefined_symbol" in result.stderr

