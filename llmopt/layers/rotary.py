"""Rotary position embeddings (rotate-half layout as in HF llama), with linear and llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmopt.layers import kernels


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; `forward` indexes them by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 device=None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T] as [T, 1, D]: gathered once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


@kernels.native_below(math.inf)
@kernels.has_native
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (q and k heads may be stacked); computed in float32, then cast back."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


class OnTheFlyRotary(nn.Module):
    """cos/sin computed per step from the positions (as transformers does) instead of a table: for long
    contexts with several RoPE bases (Gemma 3), a table per base would cost hundreds of MiB."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, device=None):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(head_dim, theta, scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()
