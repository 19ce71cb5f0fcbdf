"""Attention over the paged KV cache, behind a small backend interface.

- `backend.py`: `AttentionBackend`, what a backend owns: its KV layout, building its metadata from the
  scheduled batch, the prefill/decode forward, the choice of compiled kernels.
- `registry.py`: the backends by name, and `get_backend`, which the engine builder picks one with.
- `head_major.py` (+ `head_major_metadata.py`): the first backend, for CPU (and any device): a
  head-major pool, decode groups of similar context length, SDPA or a compiled causal kernel for
  prefill chunks.
- `paged_kv_cache.py`: that pool; `grouped_kv_cache.py`: one pool per KV group, for models that mix
  full and sliding-window layers (the sliding layers' pool is sized for the window).
- `layer.py`: `PagedAttention`, the module models hold: one layer's heads, window and scale; it hands
  the work to the backend that built the step's metadata.

A second backend (an SDPA/FlashAttention-style CUDA one, say) is one file: subclass `AttentionBackend`,
register it in `registry.BACKENDS`, and run `tests/layers/test_paged_attention_reference.py`, which
checks every registered backend against dense SDPA.
"""

from llmopt.layers.attention.backend import AttentionBackend, AttentionMetadata
from llmopt.layers.attention.grouped_kv_cache import GroupedKVCache
from llmopt.layers.attention.head_major import HeadMajorBackend
from llmopt.layers.attention.head_major_metadata import DecodeGroup, HeadMajorMetadata, PrefillChunk
from llmopt.layers.attention.layer import PagedAttention
from llmopt.layers.attention.paged_kv_cache import KV_DTYPES, PagedKVCache
from llmopt.layers.attention.registry import BACKENDS, get_backend

__all__ = ["BACKENDS", "KV_DTYPES", "AttentionBackend", "AttentionMetadata", "DecodeGroup", "GroupedKVCache",
           "HeadMajorBackend",
           "HeadMajorMetadata", "PagedAttention", "PagedKVCache", "PrefillChunk", "get_backend"]
