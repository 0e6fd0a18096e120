"""Builds and loads the CUDA extension (JIT, once per process, on first use).

Nothing is compiled at import: :func:`extension` builds the sources next to this
file with ``torch.utils.cpp_extension.load`` the first time a CUDA kernel runs.
The objects are kept in a persistent build directory, so later processes only
load them:

- ``$TORCH_EXTENSIONS_DIR/<name>`` when that variable is set (PyTorch's own
  setting for JIT extensions, read at the first build);
- ``~/.cache/te_fuser/torch_extensions/<name>`` otherwise.

``<name>`` carries the PyTorch and CUDA versions, and PyTorch rebuilds when a
source or a flag changes. The build targets sm_90a (Hopper) only. The time the
first load took (compile included, if any) is logged once at INFO level.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from .. import env as _env

__all__ = ["SOURCES", "NVCC_FLAGS", "unavailable_reason", "extension", "is_loaded", "raw_stream",
           "set_one_launch_casts", "one_launch_casts", "set_one_launch_casts_in_capture"]

_log = logging.getLogger("te_fuser.kernels.cuda")

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("binding.cpp", "cublaslt_gemm.cpp", "cast_kernels.cu", "epilogue_kernels.cu", "scaling_kernels.cu",
           "norm_kernels.cu", "rotary_kernels.cu", "activation_kernels.cu", "attention_kernels.cu",
           "attention_hp_kernels.cu")
# Bit-exact casts need IEEE arithmetic: no fast-math flags (no flush to zero,
# exact division). -gencode, not -arch=sm_90a: see the project's Hopper notes.
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a")
CXX_FLAGS = ("-O3", "-std=c++20")  # binding.cpp includes torch's headers
REQUIRED_CAPABILITY = (9, 0)

_state: dict = {"module": None, "one_launch": True, "one_launch_in_capture": True}


def _nvcc_path() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home:
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.exists():
            return str(candidate)
    return shutil.which("nvcc")


def _cublaslt() -> tuple[Path, Path] | None:
    """(the directory holding ``cublasLt.h``, the ``libcublasLt`` file) this build
    links: the CUDA toolkit's, else the ``nvidia`` wheel's PyTorch runs with."""
    from torch.utils import cpp_extension

    roots = [Path(cpp_extension.CUDA_HOME)] if cpp_extension.CUDA_HOME else []
    try:
        import nvidia  # the CUDA wheels PyTorch depends on (nvidia/cu13, nvidia/cublas)

        roots += [Path(p) / sub for p in nvidia.__path__ for sub in ("cu13", "cublas", "cu12")]
    except ImportError:
        pass
    headers = [r / "include" for r in roots if (r / "include" / "cublasLt.h").exists()]
    libraries = [lib for r in roots for d in ("lib64", "lib") for lib in sorted((r / d).glob("libcublasLt.so*"))]
    return (headers[0], libraries[0]) if headers and libraries else None


_READY_DEVICES: set = set()  # devices the loaded extension was found to run on: nothing can change after


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the CUDA kernels cannot run here (``None`` when they can). Once the
    extension is loaded, a device found able is not asked again (the Hopper
    attention kernels ask on every call)."""
    if device in _READY_DEVICES:
        return None
    if torch.version.cuda is None:
        return "PyTorch is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability(device)
    if capability != REQUIRED_CAPABILITY:
        return f"the kernels are built for sm_90a (Hopper, capability 9.0); this GPU has capability {capability}"
    if _state["module"] is None:
        if _nvcc_path() is None:
            return "nvcc was not found (set CUDA_HOME or put nvcc on PATH) to build the CUDA kernels"
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            return "ninja was not found; torch.utils.cpp_extension needs it to build the CUDA kernels"
        if _cublaslt() is None:
            return "cuBLASLt (cublasLt.h and libcublasLt.so) was found neither in CUDA_HOME nor in the nvidia wheels"
    elif device is not None:
        _READY_DEVICES.add(device)
    return None


def is_loaded() -> bool:
    """Whether the extension has been built and loaded in this process."""
    return _state["module"] is not None


def _build_directory(name: str) -> Path:
    root = _env.extensions_dir()
    base = Path(root) if root else Path.home() / ".cache" / "te_fuser" / "torch_extensions"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _extension_name() -> str:
    torch_version = torch.__version__.split("+")[0].replace(".", "_")
    cuda_version = (torch.version.cuda or "none").replace(".", "_")
    return f"te_fuser_cuda_kernels_torch{torch_version}_cu{cuda_version}"


def extension():
    """The compiled extension module, built on first use.

    Raises ``RuntimeError`` naming what is missing (GPU, CUDA build of PyTorch,
    Hopper GPU, nvcc, ninja) or why the build failed.
    """
    module = _state["module"]
    if module is not None:
        return module
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"te_fuser.kernels.cuda cannot run: {reason}")
    from torch.utils import cpp_extension

    name = _extension_name()
    build_dir = _build_directory(name)
    cublaslt_include, cublaslt_library = _cublaslt()
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(NVCC_FLAGS),
            extra_include_paths=[str(SOURCE_DIR), str(cublaslt_include)],
            extra_ldflags=[str(cublaslt_library), f"-Wl,-rpath,{cublaslt_library.parent}"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as err:  # the compiler's message is in err
        raise RuntimeError(f"te_fuser.kernels.cuda: building the CUDA extension in {build_dir} failed: {err}") from err
    _log.info("te_fuser.kernels.cuda: extension ready in %.1f s (built or loaded from %s)", time.perf_counter() - start, build_dir)
    if not _state["one_launch"]:
        module.one_launch_casts(False)
    if not _state["one_launch_in_capture"]:
        module.one_launch_casts_in_capture(False)
    _state["module"] = module
    return module


def set_one_launch_casts(enable: bool) -> bool:
    """Whether the transposing casts run as one cooperative launch (the default)
    or as their separate launches (the same bits), for this process; kept for an
    extension not loaded yet. Returns the previous setting."""
    previous = _state["one_launch"]
    _state["one_launch"] = bool(enable)
    if _state["module"] is not None:
        _state["module"].one_launch_casts(bool(enable))
    return previous


def one_launch_casts() -> bool:
    """The setting of :func:`set_one_launch_casts`."""
    return _state["one_launch"]


def set_one_launch_casts_in_capture(enable: bool) -> bool:
    """Whether the one-launch casts (where :func:`set_one_launch_casts` leaves them on)
    also run while a CUDA graph is being captured, as a cooperative kernel node of
    the graph (the default), or take their separate launches there (the same bits);
    kept for an extension not loaded yet. Returns the previous setting."""
    previous = _state["one_launch_in_capture"]
    _state["one_launch_in_capture"] = bool(enable)
    if _state["module"] is not None:
        _state["module"].one_launch_casts_in_capture(bool(enable))
    return previous


_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of_index(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The cudaStream_t of the current stream on the CUDA device of that index (an int):
# torch's C entry where it has one (the launchers' hot path), else its Python call.
stream_of_index = _get_raw_stream if _get_raw_stream is not None else _stream_of_index


def raw_stream(device: torch.device) -> int:
    """The cudaStream_t of the current stream on ``device``, as an integer."""
    return stream_of_index(device.index)
