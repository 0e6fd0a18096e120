"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU and count
their global memory instructions by width.

    python scripts/triton_sm90.py [--json] [CASE ...]

Whether a tile's loads and stores become 16-byte vector instructions or one
instruction an element is decided when Triton compiles a launch: its JIT
specializes the integer arguments divisible by 16 and the 16-byte aligned
pointers, and the kernel's index arithmetic must let the compiler see contiguous,
aligned runs. This compiles a kernel as such a launch is compiled
(``triton.compile`` for the cuda target of capability 9.0, through the ptxas in
Triton's wheel) and counts the PTX's ``ld.global`` / ``st.global`` by width, so a
kernel that went element by element (``st.global.b8``, ``ld.global.b16``, a scalar
load of one scale per element) shows it before a GPU times it, and so do its
registers a thread (what caps the programs an SM holds). The CASES are the
GPU's launches at the yardstick GPT's shapes (every size a multiple of the tile).
Run it without ``TRITON_INTERPRET`` (the interpreter's kernels do not compile).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's Triton fuses multiplies and adds by default

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["unavailable_reason", "compile_sm90", "memory_ops", "registers", "CASES", "case_ops"]


def unavailable_reason() -> str | None:
    """Why kernels cannot be compiled for sm_90 here (None: they can)."""
    try:
        importlib.import_module("triton.backends.compiler").GPUTarget
        importlib.import_module("triton.compiler").ASTSource
    except (ImportError, AttributeError) as e:
        return f"this Triton cannot compile ahead of time: {e}"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set (the interpreter's kernels do not compile)"
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        return "this Triton has no nvidia backend"
    return None


def compile_sm90(fn, types: dict, constexprs: dict, aligned=(), num_warps: int = 4):
    """``fn`` compiled for sm_90 as a launch would compile it: ``types`` the runtime
    arguments' Triton types (``*bf16``, ``i32``, ...), ``constexprs`` the compile-time
    ones, ``aligned`` the arguments the launch specializes as divisible by 16
    (pointers: 16-byte aligned). Returns Triton's compiled kernel (``asm`` holds its
    PTX and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" for name in fn.arg_names}
    signature.update(types)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def memory_ops(kernel) -> Counter:
    """A compiled kernel's global loads and stores by PTX mnemonic (e.g. ``st.global.v4.b32``)."""
    return Counter(re.findall(r"\b((?:ld|st)\.global[\w.]*)", kernel.asm["ptx"]))


def registers(kernel) -> int | None:
    """A compiled kernel's registers a thread (from its cubin, by Triton's cuobjdump;
    None where that tool is missing): with the program's threads, how many of its
    programs an SM holds (65,536 registers)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        run = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", run.stdout)
    return int(found.group(1)) if found else None


def _module(name: str):
    return importlib.import_module(f"te_fuser.kernels.triton.{name}")


def _dequantize(tile_r: int, tile_c: int):
    """The dequantization with a scale grid of (tile_r, tile_c) tiles (0: the whole dimension)."""
    cast = _module("cast")
    types = {"q_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_sm": "i32",
             "stride_sn": "i32"}
    consts = dict(TILE_R=tile_r, TILE_C=tile_c, E8M0=False, IS_E4M3=True, OUT_DTYPE=tl.bfloat16,
                  BLOCK_M=32, BLOCK_N=128)
    aligned = ["q_ptr", "s_ptr", "out_ptr", "M", "N", "stride_sn"]  # stride 0 (unused): divisible by 16
    if tile_r == 1 and tile_c == 0:  # a row's scale one element apart: the JIT makes a stride of 1 a constant
        del types["stride_sm"]
        consts["stride_sm"] = 1
    else:  # the whole tensor's scale, or the lookup through zero strides: 0
        aligned.append("stride_sm")
    return cast._dequantize_kernel, types, consts, tuple(aligned)


def _activation(kind: str):
    act = _module("activation")
    types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "amax_ptr": "*i32", "rows": "i32", "cols_out": "i32"}
    plan = act.ACTIVATION_PLANS["elementwise"]
    consts = dict(KIND=act.activation_code(kind), GATED=kind in act.GLU_GATES, COMPUTE=tl.float32,
                  ROUND_TO=tl.bfloat16, AMAX=True, P0=0.0, P1=0.0, P2=0.0, BLOCK_R=plan.block_m, BLOCK_C=plan.block_n)
    return act._activation_kernel, types, consts, ("x_ptr", "y_ptr", "rows", "cols_out")


def _dact_dbias(kind: str):
    act = _module("activation")
    types = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "dx_ptr": "*bf16", "partial_ptr": "*fp32", "amax_ptr": "*i32",
             "rows": "i32", "cols_dy": "i32", "rows_per_split": "i32"}
    plan = act.ACTIVATION_PLANS["dact_dbias"]
    consts = dict(KIND=act.activation_code(kind), GATED=kind in act.GLU_GATES, COMPUTE=tl.float32,
                  ROUND_TO=tl.bfloat16, AMAX=True, P0=0.0, P1=0.0, P2=0.0, BLOCK_R=plan.block_m, BLOCK_C=plan.block_n)
    return act._dact_dbias_kernel, types, consts, ("dy_ptr", "x_ptr", "dx_ptr", "partial_ptr", "rows", "cols_dy",
                                                   "rows_per_split")


def _block(tile_rows: int, columnwise: bool):
    """The block cast at its GPU launch: 1x128 row-wise in 32-row programs, or a
    128-row program making the row-wise and the transposed copy from one read."""
    cast = _module("cast")
    types = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_inv_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
             "stride_sm": "i32", "stride_sn": "i32", "qt_ptr": "*u8", "scale_t_ptr": "*fp32", "stride_tm": "i32",
             "stride_tn": "i32"}
    rows = 128 if tile_rows == 128 or columnwise else 32
    consts = dict(stride_xn=1, TILE_ROWS=tile_rows, ROWS_PER_PROGRAM=rows, POWER_2=True, EPSILON=0.0, EVEN=True,
                  ROWWISE=True, COLUMNWISE=columnwise, OUT_DTYPE=tl.float8e4nv, FMAX=448.0, MANT_BITS=3,
                  MIN_STEP_EXP=127 - 9, HW_FP8=True, ROW_MAJOR=True)
    return cast._quantize_block_kernel, types, consts, ("x_ptr", "q_ptr", "scale_inv_ptr", "M", "N", "stride_xm",
                                                        "qt_ptr", "scale_t_ptr"), 8 if rows == 128 else 4


# name -> (kernel, runtime types, constexprs, arguments divisible by 16[, warps])
CASES = {
    "dequantize per tensor": lambda: _dequantize(0, 0),
    # the lookup the per-tensor path replaced: one scale through zero strides, a load an element
    "dequantize per tensor, looked up": lambda: _dequantize(1, 1),
    "dequantize per row": lambda: _dequantize(1, 0),
    "activation gelu": lambda: _activation("gelu"),
    "activation swiglu": lambda: _activation("swiglu"),
    "dact_dbias gelu": lambda: _dact_dbias("gelu"),
    "dact_dbias swiglu": lambda: _dact_dbias("swiglu"),
    "block 1x128": lambda: _block(1, False),
    "block 1x128 both copies": lambda: _block(1, True),
    "block 128x128 both copies": lambda: _block(128, True),
}


def case_ops(name: str) -> tuple[Counter, int | None]:
    """A case's global loads and stores and its registers a thread."""
    fn, types, consts, aligned, *warps = CASES[name]()
    kernel = compile_sm90(fn, types, consts, aligned, *warps)
    return memory_ops(kernel), registers(kernel)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help=f"of {list(CASES)} (default: all)")
    p.add_argument("--json", action="store_true",
                   help="print {case: {instruction: count}} (and {case: registers} on a second line) as JSON")
    args = p.parse_args(argv)
    names = args.cases or list(CASES)
    unknown = [name for name in names if name not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"triton_sm90: {reason}")
    results = {name: case_ops(name) for name in names}
    if args.json:
        print(json.dumps({name: dict(ops) for name, (ops, _) in results.items()}))
        print(json.dumps({name: regs for name, (_, regs) in results.items()}))
        return
    print(f"triton {triton.__version__}, sm_90; registers and global memory instructions a thread")
    for name, (ops, regs) in results.items():
        print(f"  {name:34s} {regs if regs is not None else '?':>4} regs  "
              + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))


if __name__ == "__main__":
    main()
