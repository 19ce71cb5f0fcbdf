"""How a quantized KV cache stores a value: int8 codes (x ≈ q · scale, |q| ≤ 127) or float8 e4m3 values
(x ≈ f · scale, |f| ≤ 448, vLLM's `fp8` KV cache). fp8 values are kept as their bytes (uint8) so that
indexed copies and gathers, which CPU kernels do not all implement for float8 dtypes, move plain bytes.

A scale is one of: calibrated static per layer and head (from the checkpoint), or dynamic per token and
head (absmax / the format's largest value), kept next to the codes in float32."""

from __future__ import annotations

import torch

KV_CODE_DTYPES = ("int8", "fp8")
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
LARGEST = {"int8": 127.0, "fp8": FP8_MAX}


def encode(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """float x and its scale (broadcastable) → stored codes (int8, or fp8 bits as uint8)."""
    y = x.float() / scale
    if kind == "int8":
        return torch.round(y).clamp(-127, 127).to(torch.int8)
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode(q: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Stored codes and their scales → values in `dtype`."""
    v = q.float() if kind == "int8" else q.view(torch.float8_e4m3fn).float()
    return (v * scale).to(dtype)


def storage_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8" else torch.uint8
