"""PagedAttention: the attention module a model holds, one per layer. The backend that built the step's
metadata does the work, so a model never depends on a backend."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers.attention.backend import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None = None, scale: float | None = None):
        """`scale`: the softmax scale (default head_dim**-0.5; Gemma's query_pre_attn_scalar**-0.5)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.window = window  # sliding window (tokens), None = full causal attention
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H*D]."""
        return meta.backend.forward(self, q, k, v, cache, meta)
