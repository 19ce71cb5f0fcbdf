"""RMSNorm, computed in float32 like transformers does, so fp32 outputs match token for token.

`OffsetRMSNorm` is Gemma's variant: the checkpoint stores w and the scale is (1 + w), applied in
float32 before the cast back (Llama casts first, then multiplies)."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers import kernels
from llmopt.layers.kernels import Ops


@kernels.has_native
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@kernels.has_native
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the residual add fused into the norm."""
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    weight_offset = 0.0  # the effective scale is weight + weight_offset

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: Ops = Ops.EAGER):
        """With `residual`, returns (norm(x + residual), x + residual). `ops`: which implementation
        runs (`llmopt.layers.kernels`)."""
        if residual is None:
            return kernels.call(ops, rms_norm, x, self.weight, self.eps)
        return kernels.call(ops, add_rms_norm, x, residual, self.weight, self.eps)


@kernels.has_native
def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@kernels.has_native
def add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return offset_rms_norm(x, weight, eps), x


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight) (Gemma). `weight_offset` tells scale folding (AWQ, SmoothQuant)
    that the effective scale is weight + 1."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__(hidden_size, eps, dtype, device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: Ops = Ops.EAGER):
        if residual is None:
            return kernels.call(ops, offset_rms_norm, x, self.weight, self.eps)
        return kernels.call(ops, add_offset_rms_norm, x, residual, self.weight, self.eps)
