"""Attention over the paged KV cache behind a small backend interface (the files: docs/ARCHITECTURE.md).
A new backend is one file: subclass `AttentionBackend` and register it in `registry.BACKENDS`;
`tests/layers/test_paged_attention_reference.py` checks every registered one against dense SDPA."""

from llmopt.layers.attention.backend import AttentionBackend, AttentionMetadata
from llmopt.layers.attention.grouped_kv_cache import GroupedKVCache
from llmopt.layers.attention.head_major import HeadMajorBackend
from llmopt.layers.attention.head_major_metadata import DecodeGroup, HeadMajorMetadata, PrefillChunk
from llmopt.layers.attention.layer import PagedAttention
from llmopt.layers.attention.paged_kv_cache import PagedKVCache
from llmopt.layers.attention.registry import BACKENDS, get_backend

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeGroup", "GroupedKVCache", "HeadMajorBackend",
           "HeadMajorMetadata", "PagedAttention", "PagedKVCache", "PrefillChunk", "get_backend"]
