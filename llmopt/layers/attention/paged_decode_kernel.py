"""The bf16 paged decode-attention kernel (`paged_decode.c`), built by `llmopt.native` and called through
ctypes. It reads K/V blocks where they lie instead of gathering them for SDPA (docs/BENCHMARKS.md,
"Paged decode kernel"); when it cannot be built, `load()` returns None and attention stays on SDPA."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("paged_decode.c")
MAX_QUERY_GROUP = 64  # query heads per KV head the kernel takes (its per-group scratch)


def build(cc: str, cache_dir: Path) -> Path:
    """Compile the kernel with `cc` into `cache_dir` (once); returns the .so."""
    return native.build(SOURCE, cc, cache_dir)


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one decode group of one layer."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_decode_bf16
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn, self._lib, self.path = fn, lib, path

    def address(self) -> int:
        """The C function's address, for callers that run it from C (llmopt/step/decode_step.c)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value or 0

    @staticmethod
    def supports(q: torch.Tensor, k_pool: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_pool.dtype == torch.bfloat16
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERY_GROUP)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                 lens: torch.Tensor, start_block: int, block_size: int, window: int, scale: float) -> torch.Tensor:
        """q [B, H, D]; k_pool, v_pool [Hkv, slots, D] (one layer); blocks [B, n] (the first holds
        positions from start_block * block_size); lens [B]. Returns [B, H*D]."""
        b, h, d = q.shape
        q = q.contiguous()
        out = torch.empty(b, h * d, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                      lens.data_ptr(), b, h, k_pool.shape[0], d, k_pool.shape[1], block_size, start_block, window,
                      scale, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("paged decode kernel failed: a shape it does not take, or no memory for its scratch")
        return out


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    return native.load(SOURCE, PagedDecodeKernel, "bf16 decode attention uses SDPA")
