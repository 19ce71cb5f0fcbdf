"""The error term of GPTQ's weighted range search (`range_search.c`), built on first use by `llmopt.native`
and called through ctypes.

Why: `rtn.mse_params` scores 24 shrunk ranges of every group, and in torch each score is ten element-wise
passes over a [candidates, rows, cols] temporary: ~80% of a GPTQ call's time on a 1.2B gate_proj. The C
loop keeps a row in L1 for all its candidates (docs/QUANTIZE.md, "GPTQ's cost per call").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("range_search.c")


class RangeSearchKernel:
    """The loaded library; `errors` is one call over every row and candidate."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.range_errors
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_float, ptr, ctypes.c_int]
        fn.restype = None
        self._fn, self._lib, self.path = fn, lib, path

    def errors(self, w: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               maxq: int) -> torch.Tensor:
        """[c, rows] Σ_j weights·(scale·(clamp(round(w / scale) + zero, 0, maxq) - zero) - w)² per row of `w`
        [rows, cols] (on the CPU) and candidate: `scale`, `zero` [c, rows]; `weights` [rows, cols], or one value or
        one [cols] / [1, cols] row shared by every row."""
        rows, cols = w.shape
        w = w.float().contiguous()
        wt = weights.float()
        if wt.dim() < 2 or wt.shape[0] == 1:
            wt, stride = wt.reshape(-1).expand(cols).contiguous(), 0
        else:
            wt, stride = wt.expand(rows, cols).contiguous(), cols
        scale, zero = scale.float().contiguous(), zero.float().contiguous()
        if scale.dim() != 2 or scale.shape[1] != rows or zero.shape != scale.shape:  # the C code trusts these
            raise ValueError(f"range search: scale and zero [c, {rows}] expected")
        err = torch.empty(scale.shape, dtype=torch.float32)
        self._fn(w.data_ptr(), wt.data_ptr(), stride, rows, cols, scale.data_ptr(), zero.data_ptr(),
                 scale.shape[0], float(maxq), err.data_ptr(), torch.get_num_threads())
        return err


def load() -> RangeSearchKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    return native.load(SOURCE, RangeSearchKernel, "GPTQ's range search runs in torch")
