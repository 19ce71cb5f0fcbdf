"""Teacher-forced scoring through the engine agrees with transformers' forward pass."""

from __future__ import annotations

import random

import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import iter_logits, token_logprobs


def test_logits_match_transformers_and_pool_is_released(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=128)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 400) for _ in range(n)] for n in (50, 1, 90, 30, 70)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    got = dict(iter_logits(llm.engine, seqs))
    assert sorted(got) == list(range(len(seqs)))
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            ref = hf(torch.tensor([ids])).logits[0].float()
            torch.testing.assert_close(got[i], ref, atol=2e-4, rtol=1e-4)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    lps = token_logprobs(llm.engine, seqs[:1])
    assert lps[0].shape == (49,)
    assert torch.all(lps[0] <= 0)
    # the engine still generates normally afterwards
    out = llm.generate([seqs[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
