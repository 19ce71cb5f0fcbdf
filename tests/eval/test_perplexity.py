"""Perplexity through the engine equals the HF perplexity guide's loop over transformers' forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmopt.errors import LlmoptError
from llmopt.eval.engines import EngineOptions, build_llm
from llmopt.eval.perplexity import make_windows, score_text
from llmopt.eval.textdata import load_text

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 12


def hf_guide_ppl(model_dir, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """The loop from the transformers perplexity guide, verbatim in spirit, summing token NLLs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    enc = torch.tensor([ids])
    seq_len = enc.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = enc[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        n_valid = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(loss) * n_valid
        n_tokens += n_valid
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_tokens), n_tokens


def test_windows_follow_the_guide():
    w = make_windows(10, 4)
    assert [(x.begin, x.end, x.score_from) for x in w] == [(0, 4, 1), (4, 8, 1), (8, 10, 1)]
    assert sum(x.num_scored for x in w) == 10 - 3
    w = make_windows(10, 4, stride=2)
    # first window scores all but its first token, later ones only their last `stride` tokens
    assert [(x.begin, x.end, x.score_from) for x in w] == [(0, 4, 1), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert sum(x.num_scored for x in w) == 9
    assert make_windows(9, 4)[-1].end == 8  # a 1-token tail has nothing to score
    with pytest.raises(LlmoptError):
        make_windows(10, 4, stride=5)


@pytest.mark.parametrize("stride", [None, 24])
def test_ppl_matches_hf_guide(tiny_llama, stride):
    llm = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128))
    ids = llm.engine.tokenizer.encode(TEXT)
    assert len(ids) > 200
    score = score_text([llm.engine], ids, seq_len=64, stride=stride, max_batch_tokens=128)
    ref_ppl, ref_tokens = hf_guide_ppl(tiny_llama, ids, 64, stride or 64)
    assert score.nll[0].tokens == ref_tokens
    assert score.nll[0].ppl == pytest.approx(ref_ppl, rel=1e-4)
    # batching windows together does not change the result
    one = score_text([llm.engine], ids, seq_len=64, stride=stride, max_batch_tokens=64)
    assert one.nll[0].ppl == pytest.approx(score.nll[0].ppl, rel=1e-5)


def test_same_model_twice_has_zero_kl(tiny_llama):
    a = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128))
    b = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128, kv_cache_dtype="int8"))
    ids = a.engine.tokenizer.encode(TEXT)
    same = score_text([a.engine, a.engine], ids, seq_len=64)
    assert same.divergence.kl_div == pytest.approx(0.0, abs=1e-6)
    assert same.divergence.top1_agreement == 1.0
    assert same.divergence.tokens == same.nll[0].tokens
    diff = score_text([a.engine, b.engine], ids, seq_len=64)
    assert diff.divergence.kl_div > 0  # int8 KV moves the distribution a little
    assert diff.nll[0].ppl == pytest.approx(same.nll[0].ppl, rel=1e-6)


def test_load_text_formats(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld")
    assert load_text(tmp_path / "a.txt") == "hello\nworld"
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_text(tmp_path / "b.jsonl") == "one\n\ntwo"
    (tmp_path / "c.json").write_text(json.dumps([{"text": "x"}, "y"]))
    assert load_text(tmp_path / "c.json") == "x\n\ny"
    (tmp_path / "empty.txt").write_text(" \n")
    for bad, msg in [("missing.txt", "does not exist"), ("empty.txt", "is empty")]:
        with pytest.raises(LlmoptError, match=msg):
            load_text(tmp_path / bad)
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(LlmoptError, match="no string 'text' field"):
        load_text(tmp_path / "d.jsonl")
