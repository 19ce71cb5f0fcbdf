"""KV-cache codes (llmopt/layers/attention/kv_codes.py): int8 and fp8 e4m3 round trips, and the paged cache
storing them."""

from __future__ import annotations

import pytest
import torch

from llmopt.layers.attention.kv_codes import FP8_MAX, decode, encode
from llmopt.layers.attention.paged_kv_cache import PagedKVCache


def test_fp8_codes_keep_three_mantissa_bits():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32) * 3
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    q = encode(x, scale, "fp8")
    assert q.dtype == torch.uint8
    back = decode(q, scale, "fp8", torch.float32)
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 of each normal value (and of the
    # smallest normal's spacing, 2^-9 · scale, below it)
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9 + 1e-12).all()
    assert torch.equal(decode(encode(x * 1e6, scale, "fp8"), scale, "fp8", torch.float32).abs().amax(-1, True),
                       scale * FP8_MAX)  # saturates at the largest value instead of overflowing


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_paged_cache_returns_what_was_written(kind):
    torch.manual_seed(1)
    cache = PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype=kind)
    k, v = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    cache.write(1, k, v, torch.arange(4, 12))  # blocks 1 and 2
    rk, rv = cache.read_blocks(1, torch.tensor([[1, 2]]))
    tol = 2**-4 if kind == "fp8" else 1 / 127
    for got, want in ((rk, k), (rv, v)):
        want = want.transpose(0, 1)  # [heads, tokens, dim]
        assert torch.allclose(got[:, 0], want, atol=tol * want.abs().amax().item())
    assert PagedKVCache.bytes_per_block(2, 4, 2, 8, torch.bfloat16, kind) == 2 * 2 * 4 * 2 * (8 + 4)
