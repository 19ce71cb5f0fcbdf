"""RMSNorm, computed in float32 like transformers does, so fp32 outputs match token for token."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers import compiled as kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the residual add fused into the norm."""
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, compiled: bool = False):
        """With `residual`, returns (norm(x + residual), x + residual). `compiled`: run the
        TorchInductor version (`llmopt.layers.compiled`)."""
        if residual is None:
            return kernels.call(compiled, rms_norm, x, self.weight, self.eps)
        return kernels.call(compiled, add_rms_norm, x, residual, self.weight, self.eps)
