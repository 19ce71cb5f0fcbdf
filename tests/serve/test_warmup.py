"""Warm-up runs every path a first real request could otherwise pay for, and leaves nothing behind."""

from __future__ import annotations

from llmopt.engine.llm_engine import LLMEngine
from llmopt.serve.warmup import warm_up


def test_warm_up_covers_a_cached_prefix_and_frees_everything(tiny_llama):
    engine = LLMEngine(model=str(tiny_llama), dtype="bfloat16")
    seen = []
    engine.stat_listeners.append(seen.append)
    assert warm_up(engine) > 0
    assert engine.block_manager.prefix_hits > 0  # the prefix-extending prompt reused cached blocks
    assert max(s.num_prefill_tokens for s in seen) >= 64  # a prefill big enough for the compiled kernels
    assert not engine.has_unfinished_requests()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_warm_up_without_prefix_caching_skips_the_shared_prompt(tiny_llama):
    engine = LLMEngine(model=str(tiny_llama), dtype="float32", enable_prefix_caching=False)
    warm_up(engine)
    assert engine.block_manager.prefix_hits == 0
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
