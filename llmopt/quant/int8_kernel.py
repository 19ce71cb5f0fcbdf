"""The int8 weight-only matmul for decode-size batches (`int8_linear.c`), built on first use by
`llmopt.native` and called through ctypes.

Why: torch's CPU `_weight_int8pack_mm` streams int8 weights at a fraction of memory speed with a few
activation rows (slower per token than the bf16 matmul over twice the bytes), and decode reads every
weight per token, so W8A16 decoded slower than bf16. The kernel reads `Int8WeightOnlyLinear`'s own
[N, K] int8 buffer (no second copy) once per call for all rows, sums in float32 and rounds once, as
torch's kernel does. Past MAX_ROWS rows the weight dequantized per call (`dequantize`, in C at memory
speed) and one dense matmul are faster (`Int8WeightOnlyLinear._cpu_matmul`; docs/BENCHMARKS.md, "int8
decode kernel").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("int8_linear.c")
MAX_ROWS = 16  # rows of x up to which the kernel runs; past that the dequantized weight + one matmul is faster
DTYPES = (torch.bfloat16, torch.float32)


class Int8LinearKernel:
    """The loaded library: `__call__` is one matmul, `dequantize` the weight for bigger batches."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.int8_linear
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        lib.int8_dequant.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
        lib.int8_dequant.restype = None
        self._fn, self._lib, self.path = fn, lib, path

    @staticmethod
    def takes(weight: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether the kernel reads this weight and its scales as they are (x is checked per call)."""
        return weight.dtype == torch.int8 and weight.is_contiguous() and scales.dtype in DTYPES

    @classmethod
    def supports(cls, x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> bool:
        return x2.device.type == "cpu" and scales.dtype == x2.dtype and cls.takes(weight, scales)

    def __call__(self, x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] (bf16 or float32); weight int8 [N, K]; scales [N] in x2's dtype. Returns [M, N]."""
        x2, scales = x2.contiguous(), scales.contiguous()
        m, k = x2.shape
        n = weight.shape[0]
        if weight.shape[1] != k or tuple(scales.shape) != (n,):  # the C code trusts these shapes
            raise ValueError(f"int8 kernel: x [M, {weight.shape[1]}] and scales [{n}] expected")
        out = torch.empty(m, n, dtype=x2.dtype)
        rc = self._fn(x2.data_ptr(), m, k, weight.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
                      int(x2.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("int8 linear kernel failed: no memory for its float32 copy of the activations")
        return out


    def dequantize(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """weight int8 [N, K] times scales [N] (bf16 or float32), as [N, K] in the scales' dtype (bf16:
        each product rounded once, as torch's int8 * bf16 multiply does)."""
        if weight.dtype != torch.int8 or not weight.is_contiguous() or scales.dtype not in DTYPES:
            raise ValueError("int8 dequantize: a contiguous int8 weight and bf16 or float32 scales")
        scales = scales.contiguous()
        n, k = weight.shape
        if tuple(scales.shape) != (n,):
            raise ValueError(f"int8 dequantize: scales [{n}] expected")
        out = torch.empty(n, k, dtype=scales.dtype)
        self._lib.int8_dequant(weight.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(),
                               int(scales.dtype == torch.bfloat16), torch.get_num_threads())
        return out


def load() -> Int8LinearKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    return native.load(SOURCE, Int8LinearKernel, "int8 weight-only matmuls use torch's _weight_int8pack_mm")
