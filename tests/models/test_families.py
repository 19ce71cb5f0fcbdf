"""Every registered family against transformers on tiny random checkpoints: fp32 logits (sliding-window
ones too, on sequences longer than the window), and the checkpoint -> our fused modules mapping (Qwen3's q/k norms, a head_dim that is not hidden / heads)."""

from __future__ import annotations

import pytest
import torch

from llmopt import LLM
from llmopt.engine.scoring import iter_logits
from llmopt.models import resolve_model
from tests.models.families import tiny_mistral_sw, tiny_qwen3, tiny_qwen3_mixed  # noqa: F401

SEQS = [[5, 9, 17, 33, 65, 129, 200], list(range(3, 300, 7)), [1] * 3 + list(range(300, 340))]
FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral_sw", "tiny_qwen3_mixed"]


def hf_logits(model_dir, seqs) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def our_logits(model_dir, seqs, **kw) -> list[torch.Tensor]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, **kw)
    got = dict(iter_logits(llm.engine, seqs))
    return [got[i] for i in range(len(seqs))]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(family, request):
    model_dir = request.getfixturevalue(family)
    for ours, ref in zip(our_logits(model_dir, SEQS), hf_logits(model_dir, SEQS), strict=True):
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


def test_qwen3_spec_and_modules(tiny_qwen3):  # noqa: F811
    spec = resolve_model(str(tiny_qwen3)).spec
    assert (spec.architecture, spec.qk_norm, spec.attention_bias, spec.head_dim) == ("Qwen3ForCausalLM", True,
                                                                                    False, 32)
    assert spec.head_dim != spec.hidden_size // spec.num_heads
    model = LLM(str(tiny_qwen3), dtype="float32", device="cpu", num_kv_blocks=8).engine.model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert spec.num_params() == sum(p.numel() for p in hf.parameters())
    attn = model.layers[1].self_attn
    assert torch.equal(attn.q_norm.weight, hf.model.layers[1].self_attn.q_norm.weight)
    assert attn.qkv_proj.bias is None
