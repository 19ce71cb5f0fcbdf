"""The AMX prefill attention kernel (prefill_attention.c) against float32 SDPA, and the backend's use of it.

Where the CPU has no AMX tiles the kernel is never called (the head-major backend checks amx_bf16 first) and these
tests skip; the routing test still checks that such a CPU's chunks take SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmopt.native as native
from llmopt.layers.attention import head_major
from llmopt.layers.attention.prefill_attention_kernel import PrefillAttentionKernel, load

AMX = native.cpu_has("amx_bf16")
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles (amx_bf16): the kernel never runs here")


@pytest.fixture(scope="module")
def kernel() -> PrefillAttentionKernel:
    k = load()
    if k is None:
        pytest.skip("no C compiler here")
    return k


def _qkv(length: int, h: int, hkv: int, d: int, seed: int = 0):
    """Views of one fused [L, (H + 2 Hkv) D] projection, strided as the engine hands them over."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(length, (h + 2 * hkv) * d, generator=gen) * 2).to(torch.bfloat16)
    return (qkv[:, :h * d].view(length, h, d), qkv[:, h * d:(h + hkv) * d].view(length, hkv, d),
            qkv[:, (h + hkv) * d:].view(length, hkv, d))


def _sdpa(q, k, v, scale: float, window: int, dtype: torch.dtype) -> torch.Tensor:
    n = q.shape[0]
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= pos[None, :] > pos[:, None] - window
    qt, kt, vt = (x.to(dtype).transpose(0, 1)[None] for x in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).reshape(n, -1).float()


@needs_amx
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


@needs_amx
def test_peaked_scores_stay_finite_and_close(kernel):
    """Scores in the hundreds (softmax nearly one-hot, exponents far below float32's range for most keys)."""
    q, k, v = _qkv(150, 4, 2, 64, seed=3)
    q = (q.float() * 40).to(torch.bfloat16)
    out = kernel(q, k, v, 0.125)
    exact = _sdpa(q, k, v, 0.125, 0, torch.float32)
    assert torch.isfinite(out).all()
    assert (out.float() - exact).abs().max().item() <= 1.5 * (_sdpa(q, k, v, 0.125, 0, torch.bfloat16) - exact).abs().max().item() + 1e-2


@needs_amx
def test_contiguous_and_strided_inputs_give_the_same_bits(kernel):
    q, k, v = _qkv(70, 9, 3, 64, seed=1)
    a = kernel(q, k, v, 0.125)
    b = kernel(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(a, b)


@needs_amx
def test_a_head_size_it_does_not_take_is_an_error_not_a_wrong_answer(kernel):
    q, k, v = _qkv(8, 2, 1, 48)
    assert not PrefillAttentionKernel.supports(q, k, 2, 1)
    with pytest.raises(RuntimeError, match="shape it does not take"):
        kernel(q, k, v, 0.1)


@pytest.mark.parametrize("window", [None, 24])
def test_the_backend_runs_fresh_chunks_on_the_kernel_only_with_amx(monkeypatch, window):
    """Two prefill chunks without cached context in one step: the kernel's outputs on an AMX CPU, SDPA's elsewhere
    and under enforce_eager; each close to float32 SDPA over its own sequence."""
    from llmopt.layers.attention import PagedAttention, get_backend

    calls = []
    real = PrefillAttentionKernel.__call__

    def counted(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(PrefillAttentionKernel, "__call__", counted)
    h, hkv, d, lengths = 4, 2, 64, (40, 29)
    seqs = [_qkv(n, h, hkv, d, seed=2 + i) for i, n in enumerate(lengths)]
    for eager in (False, True):
        calls.clear()
        backend = get_backend(torch.device("cpu"), 16, allow_compiled=not eager, name="head_major")
        cache = backend.make_cache(1, 16, hkv, d, torch.bfloat16)
        attn = PagedAttention(0, h, hkv, d, window=window)
        meta = backend.build_metadata(cache, [([[0, 1, 2]], 0, lengths[0]), ([[3, 4]], 0, lengths[1])], [])
        q, k, v = (torch.cat([s[j] for s in seqs]) for j in range(3))
        out = attn(q, k, v, cache, meta)
        assert len(calls) == (2 if AMX and not eager else 0)
        for (sq, sk, sv), part in zip(seqs, out.split(list(lengths)), strict=True):
            err = (part.float() - _sdpa(sq, sk, sv, d ** -0.5, window or 0, torch.float32)).abs().max().item()
            assert err < 0.05
    assert head_major.AMX_PREFILL == AMX
