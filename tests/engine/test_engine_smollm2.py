"""The engine on the real SmolLM2-135M: exact greedy agreement with transformers, and batch invariance."""

from __future__ import annotations

import random

import pytest
import torch

from llmopt import LLM, SamplingParams
from tests.conftest import requires_smollm2

pytestmark = [pytest.mark.slow, requires_smollm2]

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village,",
    "Explain the difference between a process and a thread.",
    "1, 2, 3, 4, 5,",
    "The mitochondria is",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n\nx = np.",
    "A KV cache stores",
    "Q: What is 12 times 12?\nA:",
    "The best way to learn a new language is",
    "<html>\n<head>\n<title>",
    "In 1969, Neil Armstrong",
    "Photosynthesis converts",
    "SELECT name, age FROM users WHERE",
    "Dear hiring manager,",
    "The three laws of thermodynamics are",
    "Roses are red, violets are blue,",
    "To install the package, run",
    "Why is the sky blue? Because",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def hf(llm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.engine.weights_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def test_greedy_identical_to_transformers_generate(llm, hf):
    """Our 64 greedy tokens per prompt are, position by position, transformers' greedy choice after the
    same prefix: what its `generate` would pick, checked with one teacher-forced forward per prompt
    instead of 64 decode steps (the suite's slowest part when it ran `generate`). A divergence is allowed
    only at a tie (top-2 gap < 1e-4), where the two forwards' rounding may pick either; checking stops
    there, as the paths part."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    diverged = []
    with torch.no_grad():
        for ids, out in zip(prompts, outs, strict=True):
            ours = out.outputs[0].token_ids
            assert len(ours) == 64
            seq = torch.tensor([ids + ours[:-1]])
            lp = torch.log_softmax(hf(seq, attention_mask=torch.ones_like(seq)).logits[0, len(ids) - 1:].float(), -1)
            choice = lp.argmax(-1).tolist()
            if choice != ours:
                i = next(j for j, (a, b) in enumerate(zip(ours, choice, strict=True)) if a != b)
                top = lp[i].topk(2).values
                gap = float(top[0] - top[1])
                assert gap < 1e-4 and float(lp[i, ours[i]]) >= float(top[1]) - 1e-6, (
                    f"divergence at token {i} of {tok.decode(ids)!r} is not a tie (gap {gap})")
                diverged.append((tok.decode(ids), i, gap))
    assert len(diverged) <= 2, diverged


def test_batch_invariance_32_mixed_requests(llm):
    rng = random.Random(0)
    tok = llm.get_tokenizer()
    base = [tok.encode(p) for p in PROMPTS]
    reqs = []
    for i in range(32):
        ids = list(base[i % len(base)])
        ids += [rng.randrange(200, 40000) for _ in range(rng.randint(0, 120))]
        reqs.append(ids)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
    for i in (0, 7, 19, 31):  # alone, spot-checked (every request alone would take minutes)
        assert llm.generate([reqs[i]], params)[0].outputs[0].token_ids == batched[i]
    again = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]  # prefix cache hits
    assert again == batched
    chunked = LLM("smollm2-135m", dtype="float32", max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in chunked.generate(reqs, params)] == batched
    small = LLM("smollm2-135m", dtype="float32", num_kv_blocks=40)  # 640 tokens for 32 requests
    outs = small.generate(reqs, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == batched
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
