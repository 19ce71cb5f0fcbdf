"""RMSNorm in float32 like transformers, so fp32 outputs match token for token. Gemma's `OffsetRMSNorm`
scales by (1 + w) in float32 before the cast back (Llama casts first, then multiplies)."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers import kernels
from llmopt.layers.kernels import Ops


@kernels.native_below(kernels.NATIVE_PREFILL_ROWS)
@kernels.has_native
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@kernels.native_below(kernels.NATIVE_PREFILL_ROWS)
@kernels.has_native
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the residual add fused into the norm."""
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    weight_offset = 0.0  # the effective scale is weight + weight_offset (scale folding reads it)
    norm_fn, add_norm_fn = staticmethod(rms_norm), staticmethod(add_rms_norm)

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - self.weight_offset, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: Ops = Ops.EAGER):
        """With `residual`, returns (norm(x + residual), x + residual); `ops`: see `llmopt.layers.kernels`."""
        # detached: a compiled function treats a Parameter's shape as static, and would recompile for the
        # q/k norms' head_dim after the hidden size (a plain tensor's shape stays dynamic)
        weight = self.weight.detach() if ops is Ops.COMPILED else self.weight
        if residual is None:
            return kernels.call(ops, self.norm_fn, x, weight, self.eps)
        return kernels.call(ops, self.add_norm_fn, x, residual, weight, self.eps)


@kernels.native_below(kernels.NATIVE_PREFILL_ROWS)
@kernels.has_native
def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@kernels.native_below(kernels.NATIVE_PREFILL_ROWS)
@kernels.has_native
def add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return offset_rms_norm(x, weight, eps), x


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight) (Gemma)."""

    weight_offset = 1.0
    norm_fn, add_norm_fn = staticmethod(offset_rms_norm), staticmethod(add_offset_rms_norm)
