"""Device selection shared by the engine, quantization and calibration."""

from __future__ import annotations

import gc

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


def free_memory(device: torch.device | str | None = None) -> None:
    """Hand back the memory of models no longer referenced (cycles included), before the next one loads:
    the collector for cycles, glibc's heap for freed host tensors, the caching allocator for CUDA ones."""
    gc.collect()
    native.trim_heap()
    if device is not None and resolve_device(str(device)).type == "cuda":
        torch.cuda.empty_cache()
