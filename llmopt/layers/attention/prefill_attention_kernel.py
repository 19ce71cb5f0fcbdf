"""Causal prefill attention (`prefill_attention.c`), built by `llmopt.native` and called through ctypes: on AMX
tiles for prefill chunks on a CPU with amx_bf16, where it replaces torch's flash SDPA (docs/BENCHMARKS.md,
"Prefill attention on AMX tiles"), and in AVX-512 float32 FMAs on Intel cores with AVX512-BF16 and no AMX, where
it replaces a torch.compile'd function ("Prefill attention in float32 FMAs"). `load()` returns None where it
cannot be built, and the call returns None where this CPU, compiler or OS lends neither: the caller then runs
its own path."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("prefill_attention.c")
# Off AMX the float32 kernel runs where FMAs beat vdpbf16ps (native.FMA_VENDORS: Intel cores) on a CPU with
# AVX512-BF16, what it is built for: on the Intel Xeon VM without AMX 3.0-8.9x the compiled function the backend ran
# there and 1.3-2.9x SDPA per call, prompts prefilled 1.16-2.92x faster on SmolLM2. AMD's Zen 4 keeps the compiled
# function (not measured there).


def runs_here() -> bool:
    """Whether the backend sends this CPU's bf16 prefill chunks to the kernel: AMX tiles, or the float32 kernel
    on an Intel core with AVX512-BF16."""
    return native.cpu_has("amx_bf16") or (native.cpu_has("avx512_bf16") and native.fma_beats_vdpbf16ps())


class PrefillAttentionKernel:
    """The loaded library; `__call__` runs one chunk of one layer."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.prefill_attention
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        fma = lib.prefill_attention_fma
        fma.argtypes, fma.restype = fn.argtypes, ctypes.c_int
        self._fn, self._fma, self._lib, self.path = fn, fma, lib, path
        self.amx = native.cpu_has("amx_bf16")  # tiles where the CPU lists them (False once the OS lends none)
        self.available = True  # False once the library says this machine runs neither

    @staticmethod
    def supports(q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        """bf16 on a CPU, head size a multiple of 32 up to 256, whole query groups."""
        d = q.shape[-1]
        return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
                and d % 32 == 0 and d <= 256 and num_heads % num_kv_heads == 0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int = 0) -> torch.Tensor | None:
        """q [L, H, D] at positions C-L..C-1 (bf16; each row's heads contiguous, or copied so); k and v [C, Hkv, D]
        at positions 0..C-1 (any row and head strides, each vector contiguous: a chunk's own K/V, or a cached
        context gathered as [Hkv, C, D] and transposed); `window` > 0: a sliding window of that many positions.
        Returns [L, H*D], or None where neither AMX tiles nor the float32 kernel's AVX-512 run here."""
        if not self.available:
            return None
        length, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (k, v))
        out = torch.empty(length, h * d, dtype=q.dtype)
        args = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                v.stride(1), length, k.shape[0], h, k.shape[1], d, window, scale, out.data_ptr(),
                torch.get_num_threads())
        rc = self._fn(*args) if self.amx else 1
        if rc == 1:  # no AMX here (or none lent by the OS): the float32 kernel
            self.amx = False
            rc = self._fma(*args)
        if rc == 1:
            self.available = False
            return None
        if rc != 0:
            raise RuntimeError("prefill attention kernel failed: a shape it does not take, or no memory for its "
                               "scratch")
        return out


def load() -> PrefillAttentionKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    return native.load(SOURCE, PrefillAttentionKernel, "prefill attention uses SDPA")
