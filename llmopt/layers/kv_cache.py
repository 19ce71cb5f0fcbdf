"""The paged KV cache: one preallocated pool of fixed-size blocks per layer.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], so a token's slot is
`block_id * block_size + offset` and writes are a single indexed copy. With `int8`, each token and
head also keeps a float32 scale (absmax / 127) unless a calibrated static per-head scale is given.
"""

from __future__ import annotations

import torch

KV_DTYPES = ("auto", "int8")


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {kv_cache_dtype!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype  # compute dtype the cache returns
        self.quantized = kv_cache_dtype == "int8"
        store = torch.int8 if self.quantized else dtype
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        if self.quantized:
            sshape = (num_layers, num_blocks * block_size, num_kv_heads, 1)
            self.k_scale = torch.ones(sshape, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(sshape, dtype=torch.float32, device=device)
        # Calibrated static scales [num_layers, num_kv_heads] (from `llmopt quantize --kv-cache int8`).
        self.static_k_scale: torch.Tensor | None = None
        self.static_v_scale: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        if kv_cache_dtype == "int8":
            per_token_head = head_dim * 1 + 4  # int8 values plus one fp32 scale
        else:
            per_token_head = head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    def set_static_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Use calibrated per-layer, per-head scales instead of per-token dynamic ones."""
        dev = self.k.device
        self.static_k_scale = k_scale.to(dev, torch.float32).reshape(self.num_layers, self.num_kv_heads)
        self.static_v_scale = v_scale.to(dev, torch.float32).reshape(self.num_layers, self.num_kv_heads)

    def _quant(self, x: torch.Tensor, static: torch.Tensor | None, layer: int):
        xf = x.float()
        if static is not None:
            scale = static[layer].view(1, -1, 1).expand(x.shape[0], -1, 1)
        else:
            scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the tokens at `slots` [T]."""
        if self.quantized:
            qk, sk = self._quant(k, self.static_k_scale, layer)
            qv, sv = self._quant(v, self.static_v_scale, layer)
            self.k[layer].index_copy_(0, slots, qk)
            self.v[layer].index_copy_(0, slots, qv)
            self.k_scale[layer].index_copy_(0, slots, sk.contiguous())
            self.v_scale[layer].index_copy_(0, slots, sv.contiguous())
        else:
            self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K and V for `slots` (any shape S) → [*S, num_kv_heads, head_dim] in the compute dtype."""
        k = self.k[layer][slots]
        v = self.v[layer][slots]
        if self.quantized:
            k = (k.float() * self.k_scale[layer][slots]).to(self.dtype)
            v = (v.float() * self.v_scale[layer][slots]).to(self.dtype)
        return k, v
