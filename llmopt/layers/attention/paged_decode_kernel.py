"""The paged decode-attention kernel (`paged_decode.c`), built by `llmopt.native` and called through
ctypes. It reads K/V blocks where they lie (bf16, or int8 / fp8 codes with their scales; float32 for an
fp32 engine) instead of gathering them for SDPA (docs/BENCHMARKS.md, "Paged decode kernel"); when it
cannot be built, `load()` returns None and attention stays on SDPA."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("paged_decode.c")
MAX_QUERY_GROUP = 64  # query heads per KV head the kernel takes (its per-group scratch)
CODES = {None: 0, "int8": 1, "fp8": 2}  # paged_decode.c's pool kinds, by PagedKVCache.codes
F32 = 3  # paged_decode.c's float32 kind: q, pools and output all float32 (an fp32 engine)


def build(cc: str, cache_dir: Path) -> Path:
    """Compile the kernel with `cc` into `cache_dir` (once); returns the .so."""
    return native.build(SOURCE, cc, cache_dir)


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one decode group of one layer."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.paged_decode
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float, ptr, i32]
        fn.restype = ctypes.c_int
        quantize = lib.paged_kv_quantize
        quantize.argtypes = [ptr, i64, i64, i64, i64, ptr, i32, ptr, ptr, ptr, i64]
        quantize.restype = ctypes.c_int
        self._fn, self._quantize, self._lib, self.path = fn, quantize, lib, path

    def address(self) -> int:
        """The attention function's address, for callers that run it from C (llmopt/step/decode_step.c)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value or 0

    def quantize_address(self) -> int:
        """`paged_kv_quantize`'s address (the decode step writes quantized K/V rows with it)."""
        return ctypes.cast(self._quantize, ctypes.c_void_p).value or 0

    @staticmethod
    def supports(q: torch.Tensor, k_pool: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        """bf16 queries on a CPU over a bf16 pool or int8 / fp8 codes (uint8 bytes), or float32 queries over a
        float32 pool."""
        kinds = (torch.bfloat16, torch.int8, torch.uint8) if q.dtype == torch.bfloat16 else (torch.float32,)
        return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32) and k_pool.dtype in kinds
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERY_GROUP)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                 lens: torch.Tensor, start_block: int, block_size: int, window: int, scale: float,
                 codes: str | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] bf16 (or float32, over float32 pools); k_pool, v_pool [Hkv, slots, D] (one layer; with
        `codes` "int8" / "fp8", their codes and k_scale, v_scale [Hkv, slots, 1] float32); blocks [B, n] (the
        first holds positions from start_block * block_size); lens [B]. Returns [B, H*D]."""
        b, h, d = q.shape
        q = q.contiguous()
        out = torch.empty(b, h * d, dtype=q.dtype)
        kind = F32 if q.dtype == torch.float32 else CODES[codes]
        rc = self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                      None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
                      kind, blocks.data_ptr(), blocks.shape[1], lens.data_ptr(), b, h, k_pool.shape[0], d,
                      k_pool.shape[1], block_size, start_block, window, scale, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("paged decode kernel failed: a shape it does not take, or no memory for its scratch")
        return out

    def quantize(self, x: torch.Tensor, slots: torch.Tensor, codes: str, pool: torch.Tensor, scales: torch.Tensor,
                 static_scale: torch.Tensor | None = None) -> None:
        """Write x [T, Hkv, D] bf16 (rows contiguous) as `codes` into pool [Hkv, slots, D] and scales
        [Hkv, slots, 1] at `slots` [T] int64: what PagedKVCache.write stores, bit for bit."""
        t, hkv, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError("paged_kv_quantize: each row's heads must be contiguous")
        rc = self._quantize(x.data_ptr(), x.stride(0), t, hkv, d, slots.data_ptr(), CODES[codes],
                            None if static_scale is None else static_scale.data_ptr(), pool.data_ptr(),
                            scales.data_ptr(), pool.shape[1])
        if rc != 0:
            raise ValueError(f"paged_kv_quantize: unknown codes {codes!r}")


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    return native.load(SOURCE, PagedDecodeKernel, "bf16 decode attention uses SDPA")
