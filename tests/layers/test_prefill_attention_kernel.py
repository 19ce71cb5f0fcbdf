"""The prefill attention kernel (prefill_attention.c) against float32 SDPA, on AMX tiles and in float32 FMAs, and
the backend's use of it.

Each test runs once per way the kernel computes: on AMX tiles (skipped where the CPU has none) and in AVX-512
float32 FMAs (skipped where the build has no AVX512-BF16), whichever CPU the backend would send chunks to it on;
the routing test checks which chunks take it here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmopt.native as native
from llmopt.layers.attention import head_major
from llmopt.layers.attention.prefill_attention_kernel import PrefillAttentionKernel, load

AMX = native.cpu_has("amx_bf16")


@pytest.fixture(scope="module", params=["amx", "float32"])
def kernel(request) -> PrefillAttentionKernel:
    """A kernel of its own (not the backend's shared one) computing one way."""
    loaded = load()
    if loaded is None:
        pytest.skip("no C compiler here")
    if request.param == "amx" and not AMX:
        pytest.skip("this CPU has no AMX tiles (amx_bf16)")
    k = PrefillAttentionKernel(loaded.path)
    k.amx = request.param == "amx"
    x = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    if k(x, x, x, 1.0) is None:
        pytest.skip("this build has no AVX512-BF16 for the float32 kernel")
    if request.param == "amx" and not k.amx:
        pytest.skip("this OS lends no AMX tile state to the process (the float32 kernel then runs)")
    return k


def _qkv(length: int, h: int, hkv: int, d: int, seed: int = 0):
    """Views of one fused [L, (H + 2 Hkv) D] projection, strided as the engine hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(length, (h + 2 * hkv) * d, generator=gen) * 2).to(torch.bfloat16)
    return (qkv[:, :h * d].view(length, h, d), qkv[:, h * d:(h + hkv) * d].view(length, hkv, d),
            qkv[:, (h + hkv) * d:].view(length, hkv, d))


def _sdpa(q, k, v, scale: float, window: int, dtype: torch.dtype) -> torch.Tensor:
    """q [L, H, D] at positions C-L..C-1 against k, v [C, Hkv, D]."""
    n, c = q.shape[0], k.shape[0]
    q_pos, k_pos = torch.arange(c - n, c)[:, None], torch.arange(c)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    qt, kt, vt = (x.to(dtype).transpose(0, 1)[None] for x in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).reshape(n, -1).float()


@pytest.mark.parametrize(("length", "h", "hkv", "d", "window"), [
    (1, 9, 3, 64, 0), (2, 9, 3, 64, 0), (31, 9, 3, 64, 0), (32, 9, 3, 64, 0), (33, 9, 3, 64, 0), (129, 9, 3, 64, 0),
    (257, 9, 3, 64, 0), (600, 3, 3, 64, 0), (600, 3, 1, 64, 200),
    (100, 4, 1, 256, 0), (300, 4, 1, 256, 64), (77, 8, 8, 128, 20), (65, 2, 1, 32, 33), (200, 6, 2, 96, 0)])
def test_the_kernel_agrees_with_sdpa_as_closely_as_bf16_sdpa_does(kernel, length, h, hkv, d, window):
    q, k, v = _qkv(length, h, hkv, d)
    scale = d ** -0.5
    out = kernel(q, k, v, scale, window)
    assert out is not None and out.shape == (length, h * d) and out.dtype == torch.bfloat16
    exact = _sdpa(q, k, v, scale, window, torch.float32)
    ours = (out.float() - exact).abs().max().item()
    theirs = (_sdpa(q, k, v, scale, window, torch.bfloat16) - exact).abs().max().item()
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize(("length", "context", "window"), [(1, 40, 0), (17, 100, 0), (64, 64 + 300, 0),
                                                           (50, 333, 64), (130, 700, 200)])
def test_a_chunk_over_a_cached_context(kernel, length, context, window):
    """Queries at the end of a longer context whose K/V come gathered per head ([Hkv, C, D], as the pool reads
    them), against float32 SDPA with the offset causal (and windowed) mask."""
    h, hkv, d = 9, 3, 64
    q = _qkv(length, h, hkv, d, seed=4)[0]
    _, k, v = _qkv(context, h, hkv, d, seed=5)
    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [Hkv, C, D]
    out = kernel(q, kh.transpose(0, 1), vh.transpose(0, 1), d ** -0.5, window)
    exact = _sdpa(q, k, v, d ** -0.5, window, torch.float32)
    ours = (out.float() - exact).abs().max().item()
    theirs = (_sdpa(q, k, v, d ** -0.5, window, torch.bfloat16) - exact).abs().max().item()
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_peaked_scores_stay_finite_and_close(kernel):
    """Scores in the hundreds (softmax nearly one-hot, exponents far below float32's range for most keys)."""
    q, k, v = _qkv(150, 4, 2, 64, seed=3)
    q = (q.float() * 40).to(torch.bfloat16)
    out = kernel(q, k, v, 0.125)
    exact = _sdpa(q, k, v, 0.125, 0, torch.float32)
    assert torch.isfinite(out).all()
    assert (out.float() - exact).abs().max().item() <= 1.5 * (_sdpa(q, k, v, 0.125, 0, torch.bfloat16) - exact).abs().max().item() + 1e-2


def test_contiguous_and_strided_inputs_give_the_same_bits(kernel):
    q, k, v = _qkv(70, 9, 3, 64, seed=1)
    a = kernel(q, k, v, 0.125)
    b = kernel(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(a, b)


def test_a_head_size_it_does_not_take_is_an_error_not_a_wrong_answer(kernel):
    q, k, v = _qkv(8, 2, 1, 48)
    assert not PrefillAttentionKernel.supports(q, k, 2, 1)
    with pytest.raises(RuntimeError, match="shape it does not take"):
        kernel(q, k, v, 0.1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("window", [None, 24])
def test_the_backend_runs_prefill_chunks_on_the_kernel_where_it_runs(monkeypatch, window, kv_cache_dtype):
    """Two sequences' first chunks in one step, then their second chunks over the cached context: the kernel's
    outputs on an AMX CPU or an Intel core with AVX512-BF16 (over a bf16 pool or the int8 one dequantized), the
    backend's own path elsewhere and under enforce_eager; each close to float32 SDPA over the whole sequence and
    to enforce_eager's."""
    from llmopt.layers.attention import PagedAttention, get_backend

    calls = []
    real = PrefillAttentionKernel.__call__

    def counted(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(PrefillAttentionKernel, "__call__", counted)
    h, hkv, d, lengths, split = 4, 2, 64, (70, 45), (40, 16)
    seqs = [_qkv(n, h, hkv, d, seed=2 + i) for i, n in enumerate(lengths)]
    tables = [[0, 1, 2, 3, 4], [5, 6, 7]]
    results: dict[bool, list[torch.Tensor]] = {}
    for eager in (True, False):
        calls.clear()
        backend = get_backend(torch.device("cpu"), 16, allow_compiled=not eager, name="head_major")
        cache = backend.make_cache(1, 16, hkv, d, torch.bfloat16, kv_cache_dtype)
        attn = PagedAttention(0, h, hkv, d, window=window)
        got = []
        for lo, hi in (((0, 0), split), (split, lengths)):
            meta = backend.build_metadata(cache, [([t], a, b) for t, a, b in zip(tables, lo, hi, strict=True)], [])
            q, k, v = (torch.cat([s[j][a:b] for s, a, b in zip(seqs, lo, hi, strict=True)]) for j in range(3))
            got.append(attn(q, k, v, cache, meta).split([b - a for a, b in zip(lo, hi, strict=True)]))
        assert len(calls) == (4 if head_major.KERNEL_PREFILL and not eager else 0)
        results[eager] = [torch.cat([got[0][i], got[1][i]]).float() for i in range(len(seqs))]
    for i, (sq, sk, sv) in enumerate(seqs):
        exact = _sdpa(sq, sk, sv, d ** -0.5, window or 0, torch.float32)
        # an int8 pool's own rounding is most of its distance from float32, the same under SDPA
        assert (results[True][i] - exact).abs().max().item() < (0.05 if kv_cache_dtype == "auto" else 0.25)
        assert (results[False][i] - results[True][i]).abs().max().item() < 0.05
    assert head_major.AMX_PREFILL == AMX
    intel_bf16 = native.cpu_has("avx512_bf16") and native.cpu_vendor() == "GenuineIntel"
    assert head_major.KERNEL_PREFILL == (AMX or intel_bf16)
