"""GroupedKVCache: one PagedKVCache per KV group, for models that mix full and sliding-window layers, so
the sliding layers' pool is sized for the window, not the context."""

from __future__ import annotations

import torch

from llmopt.layers.attention.paged_kv_cache import PagedKVCache


class GroupedKVCache:
    def __init__(self, pools: list[PagedKVCache], layer_groups: list[list[int]],
                 windows: list[int | None] | None = None):
        """`layer_groups[g]`: the layers in `pools[g]`, in order; `windows[g]`: their window (None: full)."""
        self.windows = windows or [None] * len(pools)
        self.pools, self.layer_groups, self.num_groups = pools, layer_groups, len(pools)
        self._where = {layer: (g, i) for g, layers in enumerate(layer_groups) for i, layer in enumerate(layers)}
        self.quantized, self.dtype = pools[0].quantized, pools[0].dtype

    def locate(self, layer: int) -> tuple[int, PagedKVCache, int]:
        g, i = self._where[layer]
        return g, self.pools[g], i

    def set_static_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Calibrated [num_layers, num_kv_heads] scales, split by group."""
        for pool, layers in zip(self.pools, self.layer_groups, strict=True):
            pool.set_static_scales(k_scale[layers], v_scale[layers])
