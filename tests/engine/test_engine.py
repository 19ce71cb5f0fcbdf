"""Engine behaviour on tiny random-weight models: exactness, batch invariance, memory hygiene, sampling."""

from __future__ import annotations

import random

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.llm_engine import RequestError
from tests.engine_utils import hf_greedy, token_ids
from tests.models.families import tiny_mistral_sw, tiny_qwen3, tiny_qwen3_mixed  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _assert_pool_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral_sw", "tiny_qwen3_mixed"])
def test_greedy_matches_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), dtype="float32")
    prompts = _prompts(llm.engine.spec.vocab_size, 6)
    outs = llm.generate(prompts, GREEDY)
    ref = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_mistral_sw"])
def test_batch_invariance_chunking_prefix_cache_and_preemption(family, request):
    tiny_llama = request.getfixturevalue(family)
    base = LLM(str(tiny_llama), dtype="float32")
    prompts = _prompts(base.engine.spec.vocab_size, 12, seed=1, lo=20, hi=90)
    alone = [base.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    batched = token_ids(base, prompts, GREEDY)
    assert batched == alone
    # the second run over the same prompts is served from the prefix cache
    hits_before = base.engine.block_manager.prefix_hits
    cached = token_ids(base, prompts, GREEDY)
    assert base.engine.block_manager.prefix_hits > hits_before
    assert cached == alone
    _assert_pool_clean(base)
    chunked = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16)
    assert token_ids(chunked, prompts, GREEDY) == alone
    # 12 blocks of 16 tokens cannot hold 12 sequences of up to 114 tokens: forces preemption. The
    # sliding-window Mistral gives back blocks that left its 16-token window, so preemption comes only in
    # a pool of 29 blocks of 4 tokens with prompts admitted whole (30 blocks, or 64-token chunks: none)
    pool = ({"block_size": 4, "num_kv_blocks": 29, "max_num_batched_tokens": 256} if family == "tiny_mistral_sw"
            else {"num_kv_blocks": 12})
    tiny_pool = LLM(str(tiny_llama), dtype="float32", **pool)
    outs = tiny_pool.generate(prompts, GREEDY)
    assert tiny_pool.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    _assert_pool_clean(tiny_pool)


def test_decode_groups_split_by_context_length_and_keep_results(tiny_llama):
    """Decodes are attended in groups of similar context length; a batch spanning 4-400-token prompts
    runs several groups per step and still gives every request the tokens it gets alone."""
    base = LLM(str(tiny_llama), dtype="float32")
    runner = base.engine.runner
    lens = [400] * 9 + [150] * 9 + [60] * 3
    groups = runner.attn_backend.decode_groups([[[0] * 25]] * len(lens), lens)
    assert [g.size for g in groups] == [9, 12]  # the 3 shortest are too few for a group of their own
    assert groups[1].blocks[0].shape == (12, 10) and groups[1].mask.sum() == 9 * 150 + 3 * 60
    seen: list[int] = []
    base.engine.stat_listeners.append(lambda s: seen.append(s.batch_size))
    prompts = (_prompts(base.engine.spec.vocab_size, 10, seed=3, lo=300, hi=400)
               + _prompts(base.engine.spec.vocab_size, 10, seed=4, lo=4, hi=40))
    alone = [base.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    seen.clear()
    assert token_ids(base, prompts, GREEDY) == alone
    assert max(seen) == 20


def test_prefix_cache_off_gives_same_tokens_and_no_hits(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False)
    prompts = _prompts(llm.engine.spec.vocab_size, 4, seed=2, lo=40, hi=50)
    a = token_ids(llm, prompts, GREEDY)
    b = token_ids(llm, prompts, GREEDY)
    assert a == b
    assert llm.engine.block_manager.prefix_hits == 0


def test_abort_frees_blocks(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    eng = llm.engine
    rid = eng.add_request(prompt_token_ids=list(range(5, 70)), params=SamplingParams(max_tokens=200,
                                                                                     ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.block_manager.usage > 0
    assert eng.abort_request(rid)
    outs = eng.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
    assert eng.block_manager.usage == 0.0
    assert not eng.abort_request(rid)


def test_too_long_request_is_refused_not_deadlocked(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=4)  # 64 tokens in the whole pool
    with pytest.raises(RequestError, match="at most 64 tokens"):
        llm.engine.add_request(prompt_token_ids=list(range(3, 80)))
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request(prompt_token_ids=[])
    with pytest.raises(RequestError, match="token ids"):
        llm.engine.add_request(prompt_token_ids=[10**9])
    # a request that fits its prompt but would outgrow the pool stops with "length"
    out = llm.generate([list(range(3, 50))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64


def test_stop_conditions(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = list(range(10, 30))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    # stop token id: the 5th generated token
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0]
    assert o.outputs[0].token_ids == free.token_ids[:first + 1]
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(o.token_ids) >= first + 2
    # stop strings truncate the text
    text = free.text
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    if stop_str.strip():
        o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop=[stop_str]))[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop_str
        assert o.text == text[: text.index(stop_str)]
    # max_tokens
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) == 3 and o.finish_reason == "length"


def test_streaming_deltas_add_up_to_text(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    eng = llm.engine
    eng.add_request("r", prompt="The quick brown fox", params=SamplingParams(temperature=0, max_tokens=30,
                                                                            ignore_eos=True))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].text == eng.tokenizer.decode(final.outputs[0].token_ids, skip_special_tokens=True)
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 30


def test_seeded_sampling_is_reproducible_and_varies(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=123, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    c = llm.generate([[5, 6, 7]], p.model_copy(update={"seed": 7}))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_sampling_filters(tiny_llama):
    """top_k=1 and a tiny top_p both reduce sampling to greedy; min_p=1 does too."""
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = [[9, 10, 11, 12]]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        p = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1, **extra)
        assert llm.generate(prompt, p)[0].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_penalties_change_distribution(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = [[20, 21, 22, 20, 21, 22]]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              frequency_penalty=2.0, presence_penalty=2.0,
                                              repetition_penalty=1.5))[0]
    t_plain, t_pen = plain.outputs[0].token_ids, pen.outputs[0].token_ids
    assert t_plain != t_pen
    assert len(set(t_pen)) >= len(set(t_plain))


def test_logprobs_and_n(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the top logprob
        assert sum(torch.tensor(list(lp.values())).exp()) <= 1.0 + 1e-5
    multi = llm.generate([[3, 4, 5]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                     ignore_eos=True))[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1


def test_priority_policy_runs_high_priority_first(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", scheduling_policy="priority", max_num_seqs=1)
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("low", prompt_token_ids=[5, 6, 7], params=p, priority=5)
    eng.add_request("high", prompt_token_ids=[5, 6, 8], params=p, priority=0)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "low"]


@pytest.mark.parametrize("kv, stored", [("int8", torch.int8), ("fp8", torch.uint8)])
def test_quantized_kv_cache_close_to_fp32(tiny_llama, kv, stored):
    ref = LLM(str(tiny_llama), dtype="float32")
    q = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=kv)
    prompts = _prompts(ref.engine.spec.vocab_size, 4, seed=3)
    a = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    b = q.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    same = sum(x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, b, strict=True))
    assert same >= 3
    assert q.engine.kv_cache.k.dtype == stored and q.engine.kv_cache.codes == kv


def test_chat_applies_template(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    expected = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}],
                                                       add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    with pytest.raises(RequestError):
        llm.chat([], SamplingParams())
