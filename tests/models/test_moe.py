"""Mixture-of-Experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers on tiny random
checkpoints written by transformers itself: fp32 logits, greedy tokens (batched, chunked prefill,
prefix-cache hits, preemption), batches where experts get no tokens, and the spec's MoE layout."""

from __future__ import annotations

import random

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import iter_logits
from llmopt.errors import LlmoptError
from llmopt.layers.moe import SparseMoeBlock
from llmopt.models import ModelSpec, resolve_model
from tests.engine_utils import hf_greedy, token_ids
from tests.models.families import tiny_mixtral, tiny_qwen2_moe, tiny_qwen3_moe  # noqa: F401

MOE = ["tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEQS = [[5, 9, 17, 33, 65, 129, 200], list(range(3, 300, 7)), [1] * 3 + list(range(300, 340))]


def _prompts(vocab: int, n: int, seed: int = 0, lo: int = 20, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.mark.parametrize("family", MOE)
def test_fp32_logits_and_param_count_match_transformers(family, request):
    model_dir = request.getfixturevalue(family)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    got = dict(iter_logits(llm.engine, SEQS))
    hf = _hf(model_dir)
    with torch.no_grad():
        for i, s in enumerate(SEQS):
            torch.testing.assert_close(got[i], hf(torch.tensor([s])).logits[0], atol=2e-5, rtol=1e-5)
    spec = llm.engine.spec
    assert spec.num_params() == hf.num_parameters() == sum(p.numel() for p in llm.engine.model.parameters())


@pytest.mark.parametrize("family", MOE)
def test_greedy_chunked_prefix_cache_and_preemption_match_transformers(family, request):
    model_dir = request.getfixturevalue(family)
    base = LLM(str(model_dir), dtype="float32")
    prompts = _prompts(base.engine.spec.vocab_size, 8)
    ref = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert token_ids(base, prompts, GREEDY) == ref  # one batch, mixed lengths
    hits = base.engine.block_manager.prefix_hits
    assert token_ids(base, prompts, GREEDY) == ref
    assert base.engine.block_manager.prefix_hits > hits
    chunked = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16)
    assert token_ids(chunked, prompts, GREEDY) == ref
    tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=10)  # 10 x 16 slots for 8 x <=114 tokens
    assert token_ids(tight, prompts, GREEDY) == ref
    assert tight.engine.scheduler.num_preemptions > 0


def _naive_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, straight from the definition (the reference for the grouped matmuls)."""
    out = []
    for t in x:
        probs = torch.softmax(block.gate(t).float(), -1)
        w, idx = probs.topk(block.top_k)
        if block.norm_topk_prob:
            w = w / w.sum()
        y = sum(wi * block.experts[int(e)](t[None])[0] for wi, e in zip(w, idx, strict=True))
        if block.shared_expert is not None:
            y = y + torch.sigmoid(block.shared_expert_gate(t)) * block.shared_expert(t[None])[0]
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("tokens", [1, 2, 5, 64])
@pytest.mark.parametrize("shared", [0, 24])
def test_grouped_experts_equal_the_per_token_definition_with_idle_experts(tokens, shared):
    torch.manual_seed(tokens + shared)
    block = SparseMoeBlock(32, 8, 2, 16, norm_topk_prob=tokens % 2 == 0, shared_expert_intermediate_size=shared,
                           dtype=torch.float32, device="cpu")
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        ref = _naive_moe(block, x)
        got = block(x)  # the grouped_mm path over the packed expert weights
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm"):
            gate_up, down = block._stacked
            assert block.experts[5].down_proj.weight.data_ptr() == down[5].data_ptr()  # views, not copies
        if tokens <= 2:  # at most 4 of 8 experts can be chosen: several get no tokens
            assert [int(c) for c in block.last_counts].count(0) >= 4
        # the per-expert loop (quantized experts, hooks) gives the same output
        calls = []
        hook = block.experts[0].gate_up_proj.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
        torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)
        assert calls == ([] if int(block.last_counts[0]) == 0 else [int(block.last_counts[0])])
        hook.remove()
        # calibration mode: every expert sees every token, the output is unchanged
        block.calibrate_all = frozenset(range(8))
        torch.testing.assert_close(block(x), got, atol=1e-6, rtol=1e-6)
        block.calibrate_all = frozenset()
        # weights changed behind the packed views' back (.data reassigned) are noticed
        block.experts[3].down_proj.weight.data = torch.zeros_like(block.experts[3].down_proj.weight)
        torch.testing.assert_close(block(x), _naive_moe(block, x), atol=1e-5, rtol=1e-5)


def test_decode_steps_leave_experts_idle(tiny_qwen3_moe):  # noqa: F811
    """A batch-1 decode routes one token to 2 of 8 experts: the other 6 are skipped, output still
    equals transformers (checked by the greedy test); here the counts prove the idle experts."""
    llm = LLM(str(tiny_qwen3_moe), dtype="float32")
    block = llm.engine.model.layers[0].mlp
    seen: list[list[int]] = []
    hook = block.register_forward_hook(lambda m, a, o: seen.append([int(v) for v in m.last_counts]))
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finally:
        hook.remove()
    decode = [c for c in seen if sum(c) == 2]
    assert decode and all(c.count(0) == 6 for c in decode)


def test_spec_reads_the_moe_layout(tiny_qwen3_moe, tiny_mixtral, tiny_qwen2_moe):  # noqa: F811
    q3 = resolve_model(str(tiny_qwen3_moe)).spec
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_layers, q3.norm_topk_prob, q3.qk_norm) == (
        8, 2, (0, 2), True, True)
    mx = resolve_model(str(tiny_mixtral)).spec
    assert (mx.num_experts, mx.moe_intermediate_size, mx.moe_layers, mx.norm_topk_prob) == (8, 32, (0, 1), True)
    q2 = resolve_model(str(tiny_qwen2_moe)).spec
    assert (q2.moe_layers, q2.shared_expert_intermediate_size, q2.attention_bias, q2.norm_topk_prob) == (
        (1, 3), 64, True, False)
    model = LLM(str(tiny_qwen2_moe), dtype="float32", num_kv_blocks=8).engine.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, False, True]
    assert q2.active_params() < q2.num_params()
    per_expert = 3 * 64 * 32
    assert q2.num_params() - q2.active_params() == 2 * (8 - 3) * per_expert


def test_bad_moe_config_is_one_line_error():
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100, "num_experts": 4, "moe_intermediate_size": 32}
    with pytest.raises(LlmoptError, match="num_experts_per_tok=5 must be between 1 and the number of experts"):
        ModelSpec.from_hf_config({**base, "num_experts_per_tok": 5})
    # keys a config leaves out take transformers' defaults (Qwen3-MoE: 128 experts of 768, top-8)
    d = ModelSpec.from_hf_config({k: v for k, v in base.items() if k not in ("num_experts", "moe_intermediate_size")})
    assert (d.num_experts, d.moe_intermediate_size, d.num_experts_per_tok) == (128, 768, 8)


def test_mixtral_names_map_both_ways(tiny_mixtral):  # noqa: F811
    from llmopt.models.moe import MixtralForCausalLM

    assert MixtralForCausalLM.hf_to_ours("model.layers.1.block_sparse_moe.experts.7.w3.weight") == (
        "layers.1.mlp.experts.7.gate_up_proj.weight", "up_proj")
    assert MixtralForCausalLM.hf_to_ours("model.layers.0.block_sparse_moe.gate.weight") == (
        "layers.0.mlp.gate.weight", None)
    model = LLM(str(tiny_mixtral), dtype="float32", num_kv_blocks=8).engine.model
    parts = MixtralForCausalLM.hf_parts("layers.1.mlp.experts.7.gate_up_proj", model.layers[1].mlp.experts[7].gate_up_proj)
    assert list(parts) == ["model.layers.1.block_sparse_moe.experts.7.w1", "model.layers.1.block_sparse_moe.experts.7.w3"]
    assert MixtralForCausalLM.hf_module_name("layers.1.mlp.experts.7.down_proj.weight") == (
        "model.layers.1.block_sparse_moe.experts.7.w2.weight")
