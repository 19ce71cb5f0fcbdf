"""The paged decode kernel on its own: against gather + SDPA over the same blocks (bf16 pools, and int8 /
fp8 codes against their dequantized values), for the head layouts, context lengths, sliding windows and
thread counts the engine sends it; its quantized K/V writer against the torch one, byte for byte; its build
cache; and the fallback to SDPA when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from llmopt.layers.attention import PagedAttention, PagedKVCache, get_backend
from llmopt.layers.attention import paged_decode_kernel as pdk
from llmopt.layers.attention.kv_codes import decode
from llmopt.native import compiler
from llmopt.step.program import OP_ATTEND
from tests.conftest import build_avx2, needs_cc

BS = 16


def _reference(q, k_pool, v_pool, blocks, lens, start_block, window, scale):
    """Gather + SDPA in float32 over the same bf16 values: what the SDPA decode path computes."""
    b, h, d = q.shape
    hkv = k_pool.shape[0]
    out = []
    for i in range(b):
        lo = start_block * BS
        hi = int(lens[i])
        pos = torch.arange(lo, hi)
        if window:
            pos = pos[pos >= hi - window]
        rel = pos - lo
        slots = blocks[i][rel // BS] * BS + rel % BS
        k, v = k_pool[:, slots].float(), v_pool[:, slots].float()  # [Hkv, n, D]
        qi = q[i].float().view(hkv, h // hkv, d)
        out.append(F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(h * d))
    return torch.stack(out)


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (8, 8, 128), (10, 2, 128), (6, 2, 40)])
@pytest.mark.parametrize("window,start_block", [(0, 0), (37, 0), (37, 2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_gather_and_sdpa(heads, kv_heads, head_dim, window, start_block, threads, dtype):
    """Head sizes 64/128/256 take the vectorized path where the CPU has AVX512-BF16 (its query heads in
    passes of 16 // (head_dim / 16) over V: 10/2 at 128 ends on a partial pass), 40 the portable one; the
    windows start mid-block, so score tiles of fewer than 16 positions are checked too. float32 (an fp32
    engine's pools; vectorized where head_dim is a multiple of 16 with AVX-512): to float32 rounding."""
    kernel = pdk.load()
    assert kernel is not None, "the kernel must build where a C compiler is"
    gen = torch.Generator().manual_seed(heads * head_dim + window)
    num_blocks = 96
    k_pool = torch.randn(kv_heads, num_blocks * BS, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks * BS, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([200, 190, 61, 40, 33], dtype=torch.long)
    n = -(-200 // BS) - start_block
    blocks = torch.stack([torch.randperm(num_blocks, generator=gen)[:n] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(q, k_pool, v_pool, blocks, lens, start_block, BS, window, scale)
    finally:
        torch.set_num_threads(before)
    ref = _reference(q, k_pool, v_pool, blocks, lens, start_block, window, scale)
    assert got.dtype == dtype and got.shape == (len(lens), heads * head_dim)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def _filled_pool(codes, kv_heads, head_dim, gen, num_blocks=96):
    """A pool of `codes` filled through PagedKVCache.write (torch), values with a spread of magnitudes per
    token: (codes pools [Hkv, S, D], scales [Hkv, S, 1], the dequantized float values)."""
    cache = PagedKVCache(1, num_blocks, BS, kv_heads, head_dim, torch.bfloat16, torch.device("cpu"), codes)
    n = num_blocks * BS
    k = (torch.randn(n, kv_heads, head_dim, generator=gen) * torch.rand(n, kv_heads, 1, generator=gen) * 4)
    v = (torch.randn(n, kv_heads, head_dim, generator=gen) * torch.rand(n, kv_heads, 1, generator=gen) * 4)
    cache.write(0, k.to(torch.bfloat16), v.to(torch.bfloat16), torch.arange(n))
    kf = decode(cache.k[0], cache.k_scale[0], codes, torch.float32)
    vf = decode(cache.v[0], cache.v_scale[0], codes, torch.float32)
    return cache, kf, vf


@needs_cc
@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 40)])
@pytest.mark.parametrize("window,start_block", [(0, 0), (37, 2)])
def test_kernel_over_quantized_codes(codes, heads, kv_heads, head_dim, window, start_block):
    """int8 / fp8 pools: the kernel turns codes into bf16 (exactly) and applies the scales to scores and
    weights; the result is SDPA's over the dequantized values, to float32 rounding."""
    kernel = pdk.load()
    gen = torch.Generator().manual_seed(head_dim + window)
    cache, kf, vf = _filled_pool(codes, kv_heads, head_dim, gen)
    lens = torch.tensor([200, 61, 33], dtype=torch.long)
    n = -(-200 // BS) - start_block
    blocks = torch.stack([torch.randperm(96, generator=gen)[:n] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    got = kernel(q, cache.k[0], cache.v[0], blocks, lens, start_block, BS, window, scale, codes, cache.k_scale[0],
                 cache.v_scale[0])
    ref = _reference(q, kf, vf, blocks, lens, start_block, window, scale)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=1e-2)
    wrong = _reference(q, kf * 1.1, vf, blocks, lens, start_block, window, scale)  # the check can fail
    assert not torch.allclose(got.float(), wrong, atol=2e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory):
    """paged_decode.c's AVX2 path (`build_avx2`)."""
    return pdk.PagedDecodeKernel(build_avx2(pdk.SOURCE, tmp_path_factory.mktemp("avx2")))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 128), (4, 1, 256), (6, 2, 40)])
@pytest.mark.parametrize("codes", [None, "int8"])
@pytest.mark.parametrize("window,start_block", [(0, 0), (37, 2)])
def test_avx2_path_equals_gather_and_sdpa(avx2_kernel, heads, kv_heads, head_dim, codes, window, start_block):
    """Head sizes 64/128/256 (q.k 8 positions at a time, score tiles of fewer than 8 where a window starts
    mid-block; p.v 64 values of one head per pass), 40 the portable loop; bf16 pools and int8 codes."""
    gen = torch.Generator().manual_seed(heads + head_dim + window)
    lens = torch.tensor([200, 190, 61, 33], dtype=torch.long)
    n = -(-200 // BS) - start_block
    blocks = torch.stack([torch.randperm(96, generator=gen)[:n] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    if codes is None:
        kf = torch.randn(kv_heads, 96 * BS, head_dim, generator=gen).to(torch.bfloat16)
        vf = torch.randn(kv_heads, 96 * BS, head_dim, generator=gen).to(torch.bfloat16)
        got = avx2_kernel(q, kf, vf, blocks, lens, start_block, BS, window, scale)
    else:
        cache, kf, vf = _filled_pool(codes, kv_heads, head_dim, gen)
        got = avx2_kernel(q, cache.k[0], cache.v[0], blocks, lens, start_block, BS, window, scale, codes,
                          cache.k_scale[0], cache.v_scale[0])
    ref = _reference(q, kf, vf, blocks, lens, start_block, window, scale)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=1e-2)
    wrong = _reference(q, kf.float() * 1.1, vf, blocks, lens, start_block, window, scale)  # the check can fail
    assert not torch.allclose(got.float(), wrong, atol=2e-2, rtol=1e-2)


@needs_cc
@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("static", [False, True])
def test_quantized_writer_stores_the_torch_bytes(codes, static):
    """paged_kv_quantize (the native step's K/V write) stores exactly what PagedKVCache.write stores: the
    same codes and scales, for rounding ties, fp8's subnormal range, zeros and the largest values."""
    kernel = pdk.load()
    gen = torch.Generator().manual_seed(7)
    hkv, d, n = 3, 64, 300
    x = torch.randn(n, hkv, d, generator=gen) * torch.logspace(-6, 2, n).view(n, 1, 1)
    x[0] = 0.0
    x[1, :, ::2] = 0.5  # ties at every scale
    x[2] = torch.linspace(-1e-3, 1e-3, d)  # fp8 subnormals after scaling
    x = x.to(torch.bfloat16)
    slots = torch.randperm(4 * n, generator=gen)[:n]
    ref = PagedKVCache(1, 4 * n // BS, BS, hkv, d, torch.bfloat16, torch.device("cpu"), codes)
    ours = PagedKVCache(1, 4 * n // BS, BS, hkv, d, torch.bfloat16, torch.device("cpu"), codes)
    if static:
        for c in (ref, ours):
            c.set_static_scales(torch.tensor([0.01, 0.2, 3.0]), torch.tensor([0.5, 0.02, 1.0]))
    ref.write(0, x, x * 2, slots)
    kernel.quantize(x, slots, codes, ours.k[0], ours.k_scale[0], ours.static_k_scale[0] if static else None)
    kernel.quantize(x * 2, slots, codes, ours.v[0], ours.v_scale[0], ours.static_v_scale[0] if static else None)
    assert torch.equal(ours.k, ref.k) and torch.equal(ours.v, ref.v)
    assert torch.equal(ours.k_scale, ref.k_scale) and torch.equal(ours.v_scale, ref.v_scale)
    assert ours.k.count_nonzero() > 0.25 * ours.k[0, :, slots].numel()  # not a pool of zeros


@needs_cc
def test_kernel_check_is_sharp():
    """A wrong block table is caught: the comparison above can fail."""
    kernel = pdk.load()
    gen = torch.Generator().manual_seed(3)
    k_pool = torch.randn(2, 32 * BS, 64, generator=gen).to(torch.bfloat16)
    v_pool = torch.randn(2, 32 * BS, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 4, 64, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([40])
    got = kernel(q, k_pool, v_pool, torch.tensor([[3, 7, 9]]), lens, 0, BS, 0, 0.125)
    ref = _reference(q, k_pool, v_pool, torch.tensor([[3, 7, 10]]), lens, 0, 0, 0.125)
    assert not torch.allclose(got.float(), ref, atol=1e-2)


@needs_cc
def test_build_is_cached_and_keeps_denormals(tmp_path):
    """A second build reuses the cached library; loading it leaves float32 denormals alone (a -ffast-math
    link would turn on flush-to-zero for the whole process)."""
    cc = compiler()
    so = pdk.build(cc, tmp_path)
    stamp = so.stat().st_mtime_ns
    assert pdk.build(cc, tmp_path) == so and so.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [so.name]  # no temp build folder left behind
    pdk.PagedDecodeKernel(so)
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 2).item() != 0.0


def test_failed_build_falls_back_to_sdpa(no_compiler, caplog):
    """No working compiler: one warning, and bf16 decode attention runs (and is right) on SDPA."""
    with caplog.at_level(logging.WARNING):
        assert pdk.load() is None
    assert "paged decode kernel unavailable" in caplog.text
    backend = get_backend(torch.device("cpu"), 4)
    cache = backend.make_cache(1, 8, 1, 16, torch.bfloat16)
    attn = PagedAttention(0, 2, 1, 16)
    gen = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(6, n, 16, generator=gen).to(torch.bfloat16) for n in (1, 1, 2))
    table = [5, 2]
    backend.forward(attn, q[:5], k[:5], v[:5], cache, backend.build_metadata(cache, [([table], 0, 5)], []))
    out = backend.forward(attn, q[5:], k[5:], v[5:], cache, backend.build_metadata(cache, [], [([table], 5)]))
    assert backend._kernel is None
    ref = F.scaled_dot_product_attention(q[5:].float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.transpose(0, 1).reshape(1, 32), atol=1e-2, rtol=1e-2)


def test_the_kernel_takes_matching_pools_and_not_enforce_eager():
    plain = PagedKVCache(1, 4, 4, 1, 16, torch.bfloat16, torch.device("cpu"))
    fp32 = PagedKVCache(1, 4, 4, 1, 16, torch.float32, torch.device("cpu"))
    attn, q = PagedAttention(0, 2, 1, 16), torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    assert get_backend(torch.device("cpu"), 4, allow_compiled=False).decode_kernel(q, plain, attn) is None
    assert get_backend(torch.device("cpu"), 4, allow_compiled=False).decode_kernel(q.float(), fp32, attn) is None
    assert get_backend(torch.device("cpu"), 4).decode_kernel(q.float(), plain, attn) is None  # mixed dtypes
    assert get_backend(torch.device("cpu"), 4).decode_kernel(q, fp32, attn) is None
    if compiler() is not None:
        assert get_backend(torch.device("cpu"), 4).decode_kernel(q.float(), fp32, attn) is not None


@needs_cc
@pytest.mark.parametrize(("dtype", "decode_step", "tol"), [("bfloat16", "eager", 0.05), ("bfloat16", "native", 0.05),
                                                         ("float32", "eager", 1e-4)])
def test_engine_decodes_through_the_kernel(tiny_llama, dtype, decode_step, tol):
    """A bf16 engine's decode steps run the kernel (from the attention backend layer by layer, or from the
    native step's program), an fp32 engine's over its float32 pool (layer by layer: fp32 has no native step),
    and agree with an enforce_eager engine (gather + SDPA) up to their rounding: the same greedy tokens,
    logprobs within a few hundredths (bf16) or 1e-4 (float32)."""
    from llmopt import LLM, SamplingParams

    fast = LLM(str(tiny_llama), dtype=dtype, decode_step=decode_step)
    eager = LLM(str(tiny_llama), dtype=dtype, enforce_eager=True)
    g = torch.Generator().manual_seed(5)
    vocab = fast.engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    for a, b in zip(fast.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            assert abs(la[t] - lb[t]) < tol
    if decode_step == "eager":
        assert isinstance(fast.engine.runner.attn_backend._kernel, pdk.PagedDecodeKernel)
    else:
        assert any(op.kind == OP_ATTEND for op in fast.engine.runner.decode_step.program.ops)
    assert eager.engine.runner.attn_backend._kernel is False  # never loaded: enforce_eager is plain torch
