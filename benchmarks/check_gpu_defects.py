"""Bit-exactness check of two Triton kernels at real shapes on a CUDA GPU.

1. ``quantize_block`` (1x128 and 128x128 tiles) of transposed (strided) views,
   read in place, against ``quantize_block_reference``: data bytes and scales.
2. ``dact_dbias_fp8`` (SwiGLU and GELU, E4M3 and E5M2, fp32 and bf16 inputs)
   against the delayed-scaling cast of ``dact_dbias``'s dx: FP8 bytes and amax
   bit for bit, dbias within the fp32 tolerance (two kernels may sum a column in
   different orders); ``dact_dbias``'s dx itself against the reference (float64
   for fp32 inputs, ``dact_dbias_reference`` for bf16) within the tolerance (the
   kernel's exp-based tanh and sigmoid differ from torch's in the last bits).

Prints one PASS/FAIL row per case, with the number of differing elements and the
first one (index, got and expected bytes); exits 1 on any failure.

    python benchmarks/check_gpu_defects.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch

from te_fuser.kernels import reference as ref
from te_fuser.kernels import triton as tk

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_NAMES = {E4M3: "e4m3", E5M2: "e5m2", torch.bfloat16: "bf16", torch.float32: "fp32"}
_RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2}


def _data(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Off-centre values over a wide range, an all-zero 128-column band and FP8 ties."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = -2.3 + 0.5 * torch.randn(rows, cols, device="cuda", generator=gen)
    x = x * torch.exp2(torch.randint(-14, 14, (rows, cols), device="cuda", generator=gen).float())
    if cols > 256:
        x[:, 128:256] = 0.0
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 448.0, 464.0, -6e4, 2.0**-17])
    return x.to(dtype)


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, str]:
    """(number of differing elements, description of the first) of two same-shape tensors, as bits."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return -1, f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    a, e = got.reshape(got.shape or (1,)).view(ints), want.reshape(want.shape or (1,)).view(ints)
    diff = a != e
    count = int(diff.sum())
    if not count:
        return 0, ""
    idx = tuple(int(i) for i in diff.nonzero()[0])
    width = 2 * got.element_size()
    g, w = int(a[idx]) & (2 ** (8 * got.element_size()) - 1), int(e[idx]) & (2 ** (8 * got.element_size()) - 1)
    values = f" ({got.reshape(a.shape)[idx].item():g} vs {want.reshape(e.shape)[idx].item():g})"
    return count, f"first at {idx}: got 0x{g:0{width}x}, want 0x{w:0{width}x}{values}"


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        count, first = _first_difference(got, want)
        total = want.numel()
        self.rows.append((case, what, "PASS" if count == 0 else "FAIL",
                          f"{count} of {total} differ; {first}" if count else f"{total} equal"))

    def add_close(self, case: str, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
        """Within rtol, the absolute bound grown to rtol * max|want| (the tests' ``scaled``)."""
        err = (got.double() - want.double()).abs()
        bound = rtol * want.double().abs() + max(1e-5, rtol * want.double().abs().max().item())
        bad = err > bound
        detail = f"max |err| {err.max().item():.3g}"
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            detail += f"; first outside rtol {rtol} at {idx}: {got[idx].item():g} vs {want[idx].item():g}"
        self.rows.append((case, what, "FAIL" if bad.any() else "PASS", detail))

    def show(self) -> bool:
        widths = [max(len(r[i]) for r in self.rows) for i in range(3)]
        for case, what, verdict, detail in self.rows:
            print(f"{case:<{widths[0]}}  {what:<{widths[1]}}  {verdict:<{widths[2]}}  {detail}")
        failed = sum(r[2] == "FAIL" for r in self.rows)
        print(f"\n{len(self.rows) - failed} PASS, {failed} FAIL")
        return failed == 0


def check_block_cast(table: Table, shapes, dtypes) -> None:
    for rows, cols in shapes:
        for dtype in dtypes:
            base = _data(cols, rows, dtype, seed=rows + cols)
            for layout, x in (("transposed", base.t()), ("contiguous", base.t().contiguous())):
                for fp8 in (E4M3, E5M2):
                    for tile_rows in (1, 128):
                        case = "block 1x128" if tile_rows == 1 else "block 128x128"
                        case += f" {rows}x{cols} {layout} {_NAMES[dtype]} {_NAMES[fp8]}"
                        got = tk.quantize_block(x, fp8, tile_rows)
                        want = ref.quantize_block_reference(x, fp8, tile_rows)
                        table.add(case, "data", got.data, want.data)
                        table.add(case, "scale_inv", got.scale_inv, want.scale_inv)


def check_dact_dbias_fp8(table: Table, shapes, dtypes) -> None:
    for rows, cols in shapes:
        for dtype in dtypes:
            for kind, fp8, scale in (("swiglu", E5M2, 1024.0), ("swiglu", E4M3, 4.0),
                                     ("gelu", E5M2, 1024.0), ("gelu", E4M3, 4.0)):
                case = f"dact_dbias_fp8 {kind} {rows}x{cols} {_NAMES[dtype]} {_NAMES[fp8]}"
                gen = torch.Generator(device="cuda").manual_seed(rows * 7 + cols)
                x = (-0.3 + 2.5 * torch.randn(rows, cols, device="cuda", generator=gen)).to(dtype)
                dy_cols = cols // 2 if kind == "swiglu" else cols
                dy = (-0.3 + 2.5 * torch.randn(rows, dy_cols, device="cuda", generator=gen)).to(dtype)
                scale_t = torch.tensor(scale, device="cuda")  # some values saturate
                dx_fp8, dbias, amax = tk.dact_dbias_fp8(dy, x, kind, scale_t, fp8)
                dx, dbias_hp = tk.dact_dbias(dy, x, kind)
                want, _, want_amax = ref.quantize_tensorwise_reference(dx, scale_t, fp8)
                table.add(case, "dx bytes", dx_fp8, want)
                table.add(case, "amax", amax, want_amax)
                table.add_close(case, "dbias (sum order may differ)", dbias, dbias_hp, _RTOL[torch.float32])
                if fp8 == E5M2:  # once per (kind, shape, dtype)
                    if dtype == torch.float32:  # against float64, as the tests do
                        dx_ref = ref.activation_grad_reference(dy.double(), x.double(), kind)
                    else:
                        dx_ref, _ = ref.dact_dbias_reference(dy, x, kind)
                    table.add_close(case.replace(" e5m2", ""), "dx vs reference", dx, dx_ref,
                                    _RTOL[dtype] if dtype == torch.bfloat16 else 1e-5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_gpu_defects: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}\n")
    dtypes = (torch.bfloat16, torch.float32)
    block_shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (8192, 1001), (1001, 8192), (8191, 1000)]
    dact_shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (8192, 1002), (1001, 8192)]
    table = Table()
    check_block_cast(table, block_shapes, dtypes)
    check_dact_dbias_fp8(table, dact_shapes, dtypes)
    return 0 if table.show() else 1


if __name__ == "__main__":
    sys.exit(main())
