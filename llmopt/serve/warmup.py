"""Warm-up: run a few representative requests before /health says 200.

The first forward passes pay for lazy initialisation (allocator pools, kernel selection, CUDA context,
tokenizer caches); a load balancer that routes on /health would otherwise hand those seconds to real
users. The requests cover a long prefill, a prefill over a cached prefix, a batch of decodes, and the
sampler's non-greedy paths (temperature, top-p/k, seeds, logprobs).
"""

from __future__ import annotations

import logging
import time

from llmopt.engine.llm_engine import LLMEngine
from llmopt.engine.sampling_params import SamplingParams

log = logging.getLogger("llmopt.serve")

WARMUP_BATCH = 4
WARMUP_DECODE_TOKENS = 8


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to completion on the calling (engine) thread; returns seconds spent."""
    t0 = time.perf_counter()
    vocab = engine.spec.vocab_size
    long_len = max(2, min(engine.config.max_num_batched_tokens, engine.max_model_len // 2, 1024))
    prompts = [[(7 * i + 3) % vocab for i in range(long_len)]]
    short_len = max(1, min(16, engine.max_model_len - 2))
    prompts += [[(13 * i + j + 5) % vocab for i in range(short_len)] for j in range(WARMUP_BATCH - 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, logprobs=1,
                             max_tokens=WARMUP_DECODE_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        max_new = min(WARMUP_DECODE_TOKENS, engine.max_model_len - len(ids))
        params = greedy if i == 0 else sampled.model_copy(update={"max_tokens": max(1, max_new)})
        engine.add_request(f"warmup-{i}", params=params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        engine.step()
    # a prompt that extends a cached prefix: its prefill attends over cached context, which is its own
    # compiled kernel on bf16 CPU engines (llmopt.layers.kernels)
    share = long_len // 2
    if engine.config.enable_prefix_caching and share >= engine.config.block_size:
        extra = min(64, engine.max_model_len - share - 1)
        if extra > 0:
            ids = prompts[0][:share] + [(11 * i + 1) % vocab for i in range(extra)]
            engine.add_request("warmup-prefix", params=greedy.model_copy(update={"max_tokens": 1}),
                               prompt_token_ids=ids)
            while engine.has_unfinished_requests():
                engine.step()
    took = time.perf_counter() - t0
    log.info("warm-up done in %.2f s", took)
    return took
