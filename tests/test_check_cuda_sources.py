"""The schedule checks of scripts/check_cuda_sources.py on machine code written out
here (the real kernels' code is checked where CI compiles them)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_cuda_sources as ccs  # noqa: E402


def _code(*lines: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))


def _tile(exponentials: int) -> list[str]:
    return (["QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             "FMNMX R16, R24, R25, !PT"] + ["MUFU.EX2 R17, R17"] * exponentials
            + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R152, R17, R18, RZ"])


def test_a_tile_whose_exponentials_run_between_the_two_waits_passes():
    first = ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + ["MUFU.EX2 R1, R1"] * 64  # the first tile, not overlapped
    assert ccs.softmax_overlap_faults(_code(*first, *_tile(66), *_tile(64))) == []


def test_the_wait_for_p_v_hoisted_above_the_softmax_is_found():
    hoisted = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R16, R24, R25, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + [
        "MUFU.EX2 R17, R17"] * 66
    faults = ccs.softmax_overlap_faults(_code(*_tile(66), *hoisted))
    assert faults == ["only 0 MUFU.EX2 between the scores' wait and the next (wait 0x0)"]
    assert ccs.softmax_overlap_faults(_code(*_tile(63))) == [
        "only 63 MUFU.EX2 between the scores' wait and the next (wait 0x0)"]
    assert ccs.softmax_overlap_faults(_code("WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R1, R2, R3, !PT")) == [
        "only 0 MUFU.EX2 after the last scores' wait"]


def test_code_without_an_overlapped_loop_fails():
    in_order = ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + ["MUFU.EX2 R1, R1"] * 64
    assert ccs.softmax_overlap_faults(_code(*in_order)) == [
        "no wait for the scores alone (WARPGROUP.DEPBAR.LE gsb0, 0x1)"]


def test_kernel_code_splits_nvdisasm_output_by_kernel():
    sass = "\n".join([
        "\t.headerflags\t@\"EF_CUDA_SM90\"",
        "\t.text._Z5otherv:",
        _code("MUFU.EX2 R1, R1"),
        "\t.text._Z28attention_fp8_forward_kernelILi128EEvv:",
        _code(*_tile(64)),
        "\t.text._Z28attention_fp8_forward_kernelILi64EEvv:",
        _code("EXIT"),
    ])
    kernels = ccs.kernel_code(sass, "attention_fp8_forward_kernel")
    assert list(kernels) == ["_Z28attention_fp8_forward_kernelILi128EEvv", "_Z28attention_fp8_forward_kernelILi64EEvv"]
    assert ccs.softmax_overlap_faults(kernels["_Z28attention_fp8_forward_kernelILi128EEvv"]) == []
    assert "EXIT" in kernels["_Z28attention_fp8_forward_kernelILi64EEvv"]
    assert "MUFU" not in kernels["_Z28attention_fp8_forward_kernelILi64EEvv"]
