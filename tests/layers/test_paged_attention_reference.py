"""Paged attention on its own, against dense SDPA over the same sequence.

Each sequence's K/V live in scattered blocks of the pool (a random block table); its tokens arrive as
the engine sends them: a first prefill chunk, a second chunk over the cached prefix, then one decode
token per step, batched with other sequences in decode groups. Every output row must equal
`scaled_dot_product_attention` over the dense, in-order tensors with a causal (and, for a sliding
layer, windowed) mask. Any attention backend can be checked this way, a CUDA one included the day a
GPU is lent (the device is a parameter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.layers.attention import BACKENDS, PagedAttention, get_backend

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 16, 4, 64


def _dense_reference(q, k, v, window: int | None) -> torch.Tensor:
    """q [L, H, D], k/v [L, Hkv, D] -> [L, H*D] with a causal (windowed) mask."""
    n = q.shape[0]
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= pos[None, :] > pos[:, None] - window
    q, k, v = q.float(), k.float(), v.float()
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=allowed, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, H * D)


class _Seq:
    def __init__(self, length: int, blocks: list[int], gen: torch.Generator, device, dtype=torch.float32):
        self.q, self.k, self.v = (torch.randn(length, h, D, generator=gen).to(device, dtype) for h in (H, HKV, HKV))
        self.table = blocks


def _run_step(backend, attn, cache, prefills, decodes) -> list[torch.Tensor]:
    """prefills: [(seq, start, end)]; decodes: [(seq, position)]. The backend builds the step's metadata
    from the block tables, as the engine's model runner has it do. Returns per-item outputs."""
    q, k, v = [], [], []
    for s, a, b in prefills:
        q.append(s.q[a:b]), k.append(s.k[a:b]), v.append(s.v[a:b])
    for s, p in decodes:
        q.append(s.q[p:p + 1]), k.append(s.k[p:p + 1]), v.append(s.v[p:p + 1])
    meta = backend.build_metadata(cache, [([s.table], a, b) for s, a, b in prefills], [([s.table], p) for s, p in decodes])
    out = attn(torch.cat(q), torch.cat(k), torch.cat(v), cache, meta)
    sizes = [b - a for _, a, b in prefills] + [1] * len(decodes)
    return list(out.split(sizes))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_dense_sdpa(backend_name, device, window, kv_cache_dtype, dtype):
    """In bf16 on a CPU the decodes go through the paged decode kernel (int8 KV: gather + SDPA)."""
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    lengths = [23, 17, 14]  # blocks for each, taken from a shuffled pool
    seqs, used = [], 0
    for n in lengths:
        nb = -(-n // BS)
        seqs.append(_Seq(n, perm[used:used + nb], gen, device, dtype))
        used += nb
    backend = get_backend(torch.device(device), BS, name=backend_name)
    if not backend.supports(torch.device(device)):
        pytest.skip(f"{backend_name} does not run on {device}")
    cache = backend.make_cache(1, NUM_BLOCKS, HKV, D, dtype, kv_cache_dtype)
    cache.windows = [window]  # a sliding pool: decodes gather only the blocks still in a window
    attn = PagedAttention(0, H, HKV, D, window=window)
    got = {i: [] for i in range(len(seqs))}
    # step 1: whole first chunks; step 2: chunks over the cached prefix; then one decode per step
    first = {0: 8, 1: 5, 2: 9}
    second = {0: 15, 1: 11}
    for i, out in zip(first, _run_step(backend, attn, cache, [(seqs[i], 0, first[i]) for i in first], []), strict=True):
        got[i].append(out)
    step2 = _run_step(backend, attn, cache, [(seqs[i], first[i], second[i]) for i in second], [(seqs[2], 9)])
    for i, out in zip([0, 1, 2], step2, strict=True):
        got[i].append(out)
    done = {0: 15, 1: 11, 2: 10}
    while any(done[i] < lengths[i] for i in done):
        live = [i for i in done if done[i] < lengths[i]]
        for i, out in zip(live, _run_step(backend, attn, cache, [], [(seqs[i], done[i]) for i in live]), strict=True):
            got[i].append(out)
            done[i] += 1
    tol = dict(atol=2e-2, rtol=0) if kv_cache_dtype == "int8" else dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.bfloat16:
        tol = dict(atol=3e-2, rtol=2e-2)
    for i, s in enumerate(seqs):
        paged = torch.cat(got[i])
        assert paged.shape == (lengths[i], H * D)
        torch.testing.assert_close(paged.float(), _dense_reference(s.q, s.k, s.v, window), **tol)


def test_reference_check_catches_a_wrong_block_table():
    """The comparison is sharp: reading one sequence through another's block table is caught."""
    gen = torch.Generator().manual_seed(1)
    a, b = _Seq(12, [5, 9, 2], gen, "cpu"), _Seq(12, [7, 1, 3], gen, "cpu")
    backend = get_backend(torch.device("cpu"), BS)
    cache = backend.make_cache(1, NUM_BLOCKS, HKV, D, torch.float32)
    attn = PagedAttention(0, H, HKV, D)
    _run_step(backend, attn, cache, [(a, 0, 11), (b, 0, 11)], [])
    b.table = a.table  # b's last token now attends to a's cached context
    (out,) = _run_step(backend, attn, cache, [], [(b, 11)])
    ref = _dense_reference(b.q, b.k, b.v, None)[11:]
    assert not torch.allclose(out, ref, atol=1e-3)


def test_get_backend_picks_by_device_and_refuses_unknown_names():
    assert type(get_backend(torch.device("cpu"), BS)).name == "head_major"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; known: head_major"):
        get_backend(torch.device("cpu"), BS, name="flash")
