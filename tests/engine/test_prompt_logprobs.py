"""Prompt logprobs and logit bias inside the engine: per request, in the same batch as other requests.

Prompt logprobs come from the engine's own prefill, so they must equal teacher-forced scoring
(`llmopt.engine.scoring.token_logprobs`, what `llmopt eval` uses) on the same tokens, whatever the
chunking, the batch around them, or an earlier request that left the prompt in the prefix cache.
"""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from llmopt import LLM, SamplingParams
from llmopt.engine.llm_engine import RequestError
from llmopt.engine.scoring import token_logprobs
from tests.engine_utils import token_ids


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    # a small token budget: a 90-token prompt runs as several chunked-prefill steps
    return LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1,
               max_num_batched_tokens=32, block_size=16)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (90, 17, 2, 40)]


def _check_against_scoring(llm: LLM, prompt: list[int], got: list, top_n: int) -> None:
    ref = token_logprobs(llm.engine, [prompt])[0]
    assert got[0] is None and len(got) == len(prompt)
    for i, entry in enumerate(got[1:], start=1):
        tok = prompt[i]
        lp, rank = entry[tok]
        assert lp == pytest.approx(float(ref[i - 1]), abs=1e-5), i
        assert sorted(r for _, r in entry.values() if r <= top_n) == list(range(1, top_n + 1))
        assert len(entry) == top_n + (rank > top_n)  # the top n, plus the token itself when it is not among them
        by_rank = [v for v, _ in sorted(entry.values(), key=lambda vr: vr[1])]
        assert by_rank == sorted(by_rank, reverse=True) and all(v <= 0 for v in by_rank)


def test_prompt_logprobs_equal_teacher_forced_scoring_across_chunks_and_batch(llm):
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),  # no prompt logprobs
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=5, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert outs[1].prompt_logprobs is None
    for out, p, prompt in zip(outs, params, prompts, strict=True):
        if p.prompt_logprobs is not None:
            _check_against_scoring(llm, prompt, out.prompt_logprobs, p.prompt_logprobs)
    # the generated tokens are unchanged by asking for prompt logprobs
    plain = token_ids(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == plain[0]


def test_prompt_logprobs_after_a_prefix_cache_hit_still_cover_every_position(llm):
    prompt = _prompts()[0]
    bm = llm.engine.block_manager
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # leaves the prompt's blocks cached
    hits = bm.prefix_hits
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert bm.prefix_hits > hits  # a plain request does reuse them
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, n=2))[0]
    assert out.num_cached_tokens == 0
    _check_against_scoring(llm, prompt, out.prompt_logprobs, 1)
    assert bm.num_free_blocks == bm.num_blocks


def test_one_token_chunks_and_preemption_keep_every_position(tiny_llama):
    """A token budget of 1 runs prompts as one-token chunks (the decode path); a pool too small for all
    three requests preempts and recomputes some of them."""
    prompts = [p[:40] for p in _prompts() if len(p) >= 40]
    tiny = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=8, block_size=16, num_threads=1,
               max_num_batched_tokens=1)
    outs = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for out, prompt in zip(outs, prompts, strict=True):
        _check_against_scoring(tiny, prompt, out.prompt_logprobs, 1)
    small = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=8, block_size=16, num_threads=1)
    three = [prompts[0], prompts[1], prompts[0][::-1]]
    outs = small.generate(three, SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1, ignore_eos=True))
    assert small.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, three, strict=True):
        _check_against_scoring(small, prompt, out.prompt_logprobs, 1)


def test_a_one_token_prompt_has_only_the_null_entry(llm):
    out = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None]


def _greedy_first(llm: LLM, prompt: list[int], **kw) -> int:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, **kw))[0] \
        .outputs[0].token_ids[0]


def test_logit_bias_forces_and_bans_tokens_without_touching_the_rest_of_the_batch(llm):
    prompts = _prompts()
    base = token_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    forced = 123 if base[0][0] != 123 else 124
    banned = base[1][0]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={forced: 100.0}),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={banned: -100.0}),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)]
    got = token_ids(llm, prompts, params)
    assert got[0] == [forced] * 4
    assert banned not in got[1] and got[1][0] != base[1][0]
    assert got[2] == base[2] and got[3] == base[3]  # unbiased neighbours in the same batch are unaffected
    # sampling draws the forced token too
    sampled = llm.generate([prompts[2]], SamplingParams(temperature=1.0, seed=5, max_tokens=3, ignore_eos=True,
                                                        logit_bias={forced: 100.0}))[0].outputs[0].token_ids
    assert sampled == [forced] * 3


def test_logit_bias_reports_the_model_logprobs_not_the_biased_ones(llm):
    prompt = _prompts()[2]
    tok = 200
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0, ignore_eos=True,
                                                logit_bias={tok: 100.0}))[0].outputs[0]
    assert out.token_ids == [tok]
    ref = token_logprobs(llm.engine, [prompt + [tok]])[0][-1]
    assert out.logprobs[0][tok] == pytest.approx(float(ref), abs=1e-5)


def test_logit_bias_is_validated():
    with pytest.raises(ValidationError, match="between -100 and 100"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValidationError, match="between -100 and 100"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(ValidationError, match="negative"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValidationError):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_logit_bias_outside_the_vocabulary_is_a_request_error(llm):
    vocab = llm.engine.spec.vocab_size
    with pytest.raises(RequestError, match=str(vocab)):
        llm.engine.add_request(prompt_token_ids=[5, 6], params=SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_biased_requests_are_not_speculated(tiny_llama):
    """Verification draws from the unbiased distribution, so biased requests stay on the plain path."""
    spec = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1,
               speculative={"method": "ngram"})
    prompt = [5, 6, 7, 8] * 8
    out = token_ids(spec, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={9: 100.0}))
    assert out[0] == [9] * 6
    assert spec.engine.spec_counters.num_drafts == 0
