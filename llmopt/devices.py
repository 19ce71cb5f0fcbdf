"""Device selection shared by the engine, quantization and calibration."""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import llmopt.native as native
from llmopt.errors import LlmoptError


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when available; asking for CUDA without it is a one-line user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LlmoptError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise LlmoptError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None


FORWARD_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@functools.cache
def onednn_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build's oneDNN has a CPU matmul for `dtype` (bf16 needs AVX512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def forward_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of calibration's and quantization's layer-by-layer forwards. `auto`: bf16 where the device
    multiplies it natively (CUDA; a CPU whose oneDNN has bf16 matmuls, with AVX512-BF16 or AMX), else float32:
    on an AVX2-only CPU torch's bf16 matmul ran 10x slower than its float32 one (docs/QUANTIZE.md)."""
    if name != "auto":
        return FORWARD_DTYPES[name]
    return torch.bfloat16 if device.type != "cpu" or onednn_supported(torch.bfloat16) else torch.float32


def free_memory(device: torch.device | str | None = None) -> None:
    """Hand back the memory of models no longer referenced (cycles included), before the next one loads:
    the collector for cycles, glibc's heap for freed host tensors, the caching allocator for CUDA ones."""
    gc.collect()
    native.trim_heap()
    if device is not None and resolve_device(str(device)).type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block on `threads` CPU threads (None: as the process has it), then put the count back; yields
    the count in use. Why a fixed count for quantize and calibrate: GPTQ's Hessian, its Cholesky and the error
    feedback round differently with the thread count, and borderline weights then take the other code
    (docs/QUANTIZE.md: 122 of 490 Gemma 3 tensors differ between 1 and 2 threads), so the count is part of
    what makes a checkpoint reproducible; and on a shared CPU fewer threads than cores avoid OpenMP's
    barriers waiting for a core another process holds."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
