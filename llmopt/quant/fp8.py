"""FP8 (e4m3) weights with one scale per output channel: halves memory vs bf16 with no calibration.

scale = absmax / 448 (the largest finite float8_e4m3fn), w ≈ fp8(w / scale) · scale.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.scheme import QuantScheme

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0

FP8_SCHEME = QuantScheme(bits=8, group_size=-1, symmetric=True, kind="fp8", scale_dtype="float32")


def fp8_quantize(w: torch.Tensor, scheme: QuantScheme = FP8_SCHEME) -> QuantizedWeight:
    """Per-output-channel float8_e4m3fn quantization of `w` [out, in]; all-zero rows get scale 1."""
    if scheme.kind != "fp8":
        raise LlmoptError(f"fp8_quantize needs an fp8 scheme, got {scheme.describe()}")
    if w.dim() != 2:
        raise LlmoptError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    wf = w.detach().float()
    absmax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / FP8_E4M3_MAX, torch.ones_like(absmax))
    dt = scheme.torch_scale_dtype
    scale = scale.clamp(min=torch.finfo(dt).tiny).to(dt).float()
    # clamp: a scale rounded down could push |w/scale| past 448, which would cast to NaN
    q = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    g_idx = torch.zeros(w.shape[1], dtype=torch.int32, device=w.device)
    return QuantizedWeight(q=q, scale=scale, zero=None, g_idx=g_idx, scheme=scheme)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8 codes [out, in] times per-row scale [out] or [out, 1], computed in float32."""
    s = scale.float().reshape(-1, 1)
    return (q.float() * s).to(dtype)
