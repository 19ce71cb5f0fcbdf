"""Sliding-window attention (Mistral `sliding_window`, per-layer `layer_types`) against transformers:
token-identical greedy fp32 output with prompts longer than the window, decoding past it, chunked
prefill and prefix-cache hits; and the attention kernels' window masks against SDPA."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from llmopt import LLM, SamplingParams
from llmopt.layers import kernels
from llmopt.layers.attention.head_major import causal_attention
from llmopt.layers.kernels import Ops
from llmopt.models import ModelSpec, resolve_model
from llmopt.models.llama import LlamaForCausalLM
from tests.engine_utils import hf_greedy, token_ids
from tests.models.families import WINDOW, tiny_mistral_sw, tiny_qwen3_mixed  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts(vocab: int, n: int, seed: int = 0, lo: int = 40, hi: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_spec_reads_windows_per_layer(tiny_mistral_sw, tiny_qwen3_mixed):  # noqa: F811
    m = resolve_model(str(tiny_mistral_sw)).spec
    assert m.sliding_window == WINDOW and [m.attention_window(i) for i in range(m.num_layers)] == [WINDOW] * 2
    q = resolve_model(str(tiny_qwen3_mixed)).spec
    assert [q.attention_window(i) for i in range(q.num_layers)] == [WINDOW, None, WINDOW]
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "max_position_embeddings": 4096}
    # no window set, a window as long as the context, Qwen2 with use_sliding_window off: full attention
    for cfg in ({"model_type": "mistral", "sliding_window": None},
                {"model_type": "mistral", "sliding_window": 4096},
                {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}):
        assert ModelSpec.from_hf_config({**base, **cfg}).layer_types == ()
    q2 = ModelSpec.from_hf_config({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                                   "max_window_layers": 1})
    assert [q2.attention_window(i) for i in range(2)] == [None, 32]


@pytest.mark.parametrize("fixture", ["tiny_mistral_sw", "tiny_qwen3_mixed"])
def test_greedy_past_the_window_matches_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), dtype="float32")
    prompts = _prompts(llm.engine.spec.vocab_size, 6)
    ref = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert token_ids(llm, prompts, GREEDY) == ref
    assert type(llm.engine.model) is LlamaForCausalLM
    assert any(layer.self_attn.attn.window == WINDOW for layer in llm.engine.model.layers)
    chunked = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16)
    assert token_ids(chunked, prompts, GREEDY) == ref
    hits = chunked.engine.block_manager.prefix_hits
    assert token_ids(chunked, prompts, GREEDY) == ref
    assert chunked.engine.block_manager.prefix_hits > hits


def test_transformers_applies_the_window(tiny_mistral_sw):  # noqa: F811
    """Guard for the reference: transformers' Mistral output changes when the window is dropped."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_mistral_sw), dtype=torch.float32)
    x = torch.tensor([list(range(3, 63))])
    with torch.no_grad():
        windowed = hf(x).logits
        hf.config.sliding_window = None
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = None
        full = hf(x).logits
    assert torch.allclose(windowed[:, :WINDOW], full[:, :WINDOW], atol=1e-5)
    assert not torch.allclose(windowed[:, WINDOW:], full[:, WINDOW:], atol=1e-3)


def _sdpa_window(q, k, v, scale, offset, window):
    length, h, _ = q.shape
    rep = h // k.shape[0]
    kk, vv = k.repeat_interleave(rep, 0).float(), v.repeat_interleave(rep, 0).float()
    qp = torch.arange(length)[:, None] + offset
    kp = torch.arange(k.shape[1])[None, :]
    allowed = (kp <= qp) & (kp > qp - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), kk, vv, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).reshape(length, -1)


@pytest.mark.parametrize("offset", [0, 37])
def test_causal_attention_honours_the_window(offset):
    g = torch.Generator().manual_seed(offset)
    length, h, hkv, d, window = 70, 6, 2, 16, 16
    q = torch.randn(length, h, d, generator=g)
    k, v = torch.randn(hkv, offset + length, d, generator=g), torch.randn(hkv, offset + length, d, generator=g)
    ref = _sdpa_window(q, k, v, d**-0.5, offset, window)
    assert torch.allclose(causal_attention(q, k, v, d**-0.5, offset, window), ref, atol=1e-5)
    out = kernels.call(Ops.COMPILED, causal_attention, q.bfloat16(), k.bfloat16(), v.bfloat16(), d**-0.5, offset, window)
    assert torch.allclose(out.float(), ref, atol=3e-2)


def _held_blocks(seq, group: int = 0) -> int:
    t = seq.kv_table(group)
    return len(t.blocks) - t.num_released


def _decode_one(llm, prompt, n_out):
    """Decode one request step by step: its output and, after each step, its blocks held per KV group."""
    eng = llm.engine
    rid = eng.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=n_out,
                                                                          ignore_eos=True))
    seq = eng.get_request(rid).seqs[0]
    held, out, released = [], [], 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o.outputs[0].token_ids
        if not seq.is_finished:
            held.append([_held_blocks(seq, g) for g in range(len(seq.kv_tables))])
            released = max(t.num_released for t in seq.kv_tables)
    return out, held, released


def _assert_pools_clean(bm) -> None:
    for m in getattr(bm, "sliding", []) + [getattr(bm, "full", bm)]:
        assert all(b.ref_count == 0 for b in m.blocks) and m.num_free_blocks == m.num_blocks


@pytest.mark.parametrize("spec_method", [None, "ngram"])
def test_sliding_window_blocks_stay_bounded_while_decoding(tiny_mistral_sw, spec_method):  # noqa: F811
    """Every layer of the tiny Mistral slides over 16 positions: with 4-token blocks a sequence holds at
    most 16/4 + 2 blocks (the window, the block it writes into, the one its first visible position
    straddles; speculation's drafts may take one more), however long it decodes; the output stays
    transformers'."""
    from llmopt.engine.spec_decode import SpeculativeConfig

    prompt = _prompts(100, 1, seed=5, lo=60, hi=60)[0]
    n_out = 120
    ref = hf_greedy(tiny_mistral_sw, [prompt], n_out)[0]
    spec = None if spec_method is None else SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    llm = LLM(str(tiny_mistral_sw), dtype="float32", block_size=4, max_num_batched_tokens=16, speculative=spec)
    out, held, released = _decode_one(llm, prompt, n_out)
    assert out == ref
    assert len(prompt) + n_out > 40 * 4 and max(h[0] for h in held) <= WINDOW // 4 + 2 + (spec is not None)
    assert released > 30
    _assert_pools_clean(llm.engine.block_manager)


def test_mixed_full_and_sliding_layers_get_two_pools(tiny_qwen3_mixed):  # noqa: F811
    """Layers 0 and 2 of the tiny Qwen3 slide over 16 positions, layer 1 attends to everything: the
    sliding layers get their own pool and give back what left the window, the full layer keeps every
    block; output, prefix-cache hits and a second request stay transformers'."""
    prompt = _prompts(100, 1, seed=7, lo=60, hi=60)[0]
    n_out = 120
    ref = hf_greedy(tiny_qwen3_mixed, [prompt], n_out)[0]
    llm = LLM(str(tiny_qwen3_mixed), dtype="float32", block_size=4, max_num_batched_tokens=16)
    cache = llm.engine.kv_cache
    assert cache.num_groups == 2 and cache.layer_groups == [[1], [0, 2]]
    out, held, released = _decode_one(llm, prompt, n_out)
    assert out == ref
    assert max(h[1] for h in held) <= WINDOW // 4 + 2 and released > 30
    assert held[-1][0] == -(-(len(prompt) + n_out - 1) // 4)  # group 0: every block of the context
    _assert_pools_clean(llm.engine.block_manager)
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    assert token_ids(llm, [prompt], SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)) == [ref]
    assert bm.prefix_hits > hits  # the sliding pool still had the window's blocks of the cached prefix
    _assert_pools_clean(bm)


def test_released_blocks_still_serve_prefix_hits(tiny_mistral_sw):  # noqa: F811
    """A released full block stays in the prefix cache (evictable): the same prompts again hit it and
    still give transformers' tokens, as does a batch whose blocks come and go together."""
    prompts = _prompts(100, 4, seed=6, lo=50, hi=70)
    ref = hf_greedy(tiny_mistral_sw, prompts, 40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(tiny_mistral_sw), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert token_ids(llm, prompts[:1], params) == ref[:1]
    hits = llm.engine.block_manager.prefix_hits
    assert token_ids(llm, prompts[:1], params) == ref[:1] and llm.engine.block_manager.prefix_hits > hits
    assert token_ids(llm, prompts, params) == ref
