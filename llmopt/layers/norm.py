"""RMSNorm, computed in float32 like transformers does, so fp32 outputs match token for token."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the add is fused into the norm."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
