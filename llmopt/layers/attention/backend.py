"""AttentionBackend: the runner schedules positions over block tables; the KV layout, the per-step metadata
(built once, shared by every layer) and the kernels are the backend's business. Models only read
`AttentionMetadata.ops` and pass the metadata through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from llmopt.layers import kernels
from llmopt.layers.attention.grouped_kv_cache import GroupedKVCache
from llmopt.layers.kernels import Ops

if TYPE_CHECKING:
    from llmopt.layers.attention.layer import PagedAttention

# one prefill chunk: (block table per KV group, first, end): tokens first..end-1, attending to 0..end-1
PrefillItem = tuple[list[list[int]], int, int]
# one decode token: (block table per KV group, its position)
DecodeItem = tuple[list[list[int]], int]


@dataclass
class AttentionMetadata:
    """What every backend's metadata has; subclasses add their kernels' inputs."""

    backend: AttentionBackend  # the backend that built it, and runs the layers over it
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_prefill_tokens: int = 0  # rows 0..num_prefill_tokens-1 are prefill chunks, the rest decodes
    ops: Ops = Ops.EAGER  # how this step runs the element-wise functions (llmopt.layers.kernels)


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, block_size: int, device: torch.device, allow_compiled: bool = True):
        self.block_size = block_size
        self.device = torch.device(device)
        self.allow_compiled = allow_compiled  # False: enforce_eager (eager torch only, no kernels of ours)

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """Whether this backend runs on `device` (`get_backend` takes the first that does)."""
        return True

    @abstractmethod
    def make_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_cache_dtype: str = "auto"):
        """The KV pool in this backend's layout."""

    def make_grouped_cache(self, layer_groups: list[list[int]], num_blocks: list[int], num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                           windows: list[int | None] | None = None) -> GroupedKVCache:
        """A `make_cache` pool per KV group g: `num_blocks[g]` blocks for `layer_groups[g]`, sliding over
        `windows[g]` (models that mix full and sliding layers)."""
        pools = [self.make_cache(len(layers), n, num_kv_heads, head_dim, dtype, kv_cache_dtype)
                 for layers, n in zip(layer_groups, num_blocks, strict=True)]
        return GroupedKVCache(pools, layer_groups, windows)

    @abstractmethod
    def bytes_per_block(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto") -> int:
        """Bytes of one block of that pool, over all layers (the engine sizes its pool with this)."""

    @abstractmethod
    def build_metadata(self, cache, prefills: list[PrefillItem], decodes: list[DecodeItem]) -> AttentionMetadata:
        """One step's metadata, tokens laid out as the runner feeds them: prefill chunks, then decodes."""

    @abstractmethod
    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write the step's K/V for `layer` and attend: q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]."""

    def choose_ops(self, dtype: torch.dtype, num_tokens: int) -> Ops:
        """How a step of `num_tokens` runs the element-wise functions (llmopt.layers.kernels)."""
        return kernels.choose(dtype, self.device, num_tokens) if self.allow_compiled else Ops.EAGER
