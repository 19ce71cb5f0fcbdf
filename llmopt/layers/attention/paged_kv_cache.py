"""The head-major paged KV cache (`HeadMajorBackend`'s layout): per layer [num_kv_heads, slots, head_dim]
with slot = block_id * block_size + offset, so a write is one indexed copy and a gather of whole blocks
lands in the [heads, batch, context, head_dim] layout attention multiplies with. With `int8` or `fp8`
(`kv_codes`), each token and head also keeps a float32 scale (absmax / 127 or / 448), unless calibrated
static per-head scales are set."""

from __future__ import annotations

import torch

from llmopt.layers.attention.kv_codes import KV_CODE_DTYPES, LARGEST, decode, encode, storage_dtype


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto"):
        """`kv_cache_dtype`: "auto" (the compute dtype), "int8" or "fp8" (validated by EngineConfig)."""
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype  # compute dtype the cache returns
        self.quantized = kv_cache_dtype in KV_CODE_DTYPES
        self.codes = kv_cache_dtype if self.quantized else None
        store = storage_dtype(kv_cache_dtype) if self.quantized else dtype
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        if self.quantized:
            sshape = (num_layers, num_kv_heads, num_blocks * block_size, 1)
            self.k_scale = torch.ones(sshape, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(sshape, dtype=torch.float32, device=device)
        # Calibrated static scales [num_layers, num_kv_heads] (from `llmopt quantize --kv-cache int8|fp8`).
        self.static_k_scale: torch.Tensor | None = None
        self.static_v_scale: torch.Tensor | None = None

    num_groups = 1  # one KV group: every layer's K/V in this pool (see GroupedKVCache for several)
    windows: list[int | None] = [None]  # the window all its layers slide over, if they do (set by the engine)

    def locate(self, layer: int) -> tuple[int, PagedKVCache, int]:
        """(KV group, pool, layer index in that pool) of model layer `layer`."""
        return 0, self, layer

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        # int8 / fp8: one byte per value plus one fp32 scale
        per_token_head = head_dim + 4 if kv_cache_dtype in KV_CODE_DTYPES else head_dim * dtype.itemsize
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    def set_static_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Use calibrated per-layer, per-head scales instead of per-token dynamic ones."""
        dev = self.k.device
        self.static_k_scale = k_scale.to(dev, torch.float32).reshape(self.num_layers, self.num_kv_heads)
        self.static_v_scale = v_scale.to(dev, torch.float32).reshape(self.num_layers, self.num_kv_heads)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Layer `layer`'s per-slot K and V scales [Hkv, slots, 1] of an int8 / fp8 pool; (None, None) for bf16."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def _quant(self, x: torch.Tensor, static: torch.Tensor | None, layer: int):
        """x: [Hkv, T, D] → codes and scales [Hkv, T, 1]."""
        assert self.codes is not None
        if static is not None:
            scale = static[layer].view(-1, 1, 1).expand(-1, x.shape[1], 1)
        else:
            scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / LARGEST[self.codes]
        return encode(x, scale, self.codes), scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the tokens at `slots` [T]."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if self.quantized:
            qk, sk = self._quant(k, self.static_k_scale, layer)
            qv, sv = self._quant(v, self.static_v_scale, layer)
            self.k[layer].index_copy_(1, slots, qk)
            self.v[layer].index_copy_(1, slots, qv)
            self.k_scale[layer].index_copy_(1, slots, sk.contiguous())
            self.v_scale[layer].index_copy_(1, slots, sv.contiguous())
        else:
            self.k[layer].index_copy_(1, slots, k.to(self.k.dtype))
            self.v[layer].index_copy_(1, slots, v.to(self.v.dtype))

    def _dequant(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        assert self.codes is not None
        return decode(q, scale, self.codes, self.dtype)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks `blocks` [B, n] → [num_kv_heads, B, n * block_size, head_dim], one
        index_select of block-sized rows per tensor."""
        b, n = blocks.shape
        flat = blocks.reshape(-1)

        def gather(pool: torch.Tensor) -> torch.Tensor:
            h, _, d = pool.shape
            rows = pool.view(h, self.num_blocks, self.block_size * d).index_select(1, flat)
            return rows.view(h, b, n * self.block_size, d)

        k, v = gather(self.k[layer]), gather(self.v[layer])
        if self.quantized:
            k = self._dequant(k, gather(self.k_scale[layer]))
            v = self._dequant(v, gather(self.v_scale[layer]))
        return k, v
