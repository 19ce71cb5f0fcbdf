"""Perplexity through the engine equals the HF perplexity guide's loop over transformers' forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmopt.engine.scoring import iter_logits
from llmopt.errors import LlmoptError
from llmopt.eval.divergence import BaselineTopK
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
    score = score_text(llm.engine, ids, seq_len=64, stride=stride, max_batch_tokens=128)
    ref_ppl, ref_tokens = hf_guide_ppl(tiny_llama, ids, 64, stride or 64)
    assert score.nll[0].tokens == ref_tokens
    assert score.nll[0].ppl == pytest.approx(ref_ppl, rel=1e-4)
    # batching windows together does not change the result
    one = score_text(llm.engine, ids, seq_len=64, stride=stride, max_batch_tokens=64)
    assert one.nll[0].ppl == pytest.approx(score.nll[0].ppl, rel=1e-5)


def test_same_model_twice_has_zero_kl(tiny_llama):
    a = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128))
    b = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128, kv_cache_dtype="int8"))
    ids = a.engine.tokenizer.encode(TEXT)
    ref = BaselineTopK(16)
    base = score_text(a.engine, ids, seq_len=64, record=ref)
    same = score_text(a.engine, ids, seq_len=64, compare_to=ref)
    assert same.divergence.kl_div == pytest.approx(0.0, abs=1e-6)
    assert same.divergence.top1_agreement == 1.0
    assert same.divergence.tokens == same.nll[0].tokens == base.nll[0].tokens
    diff = score_text(b.engine, ids, seq_len=64, compare_to=ref)
    assert diff.divergence.kl_div > 0  # int8 KV moves the distribution a little
    assert diff.divergence.top1_agreement > 0.8


def _exact_kl(base_engine, cand_engine, ids: list[int], seq_len: int) -> tuple[float, float]:
    """Mean KL(base || cand) and top-1 agreement over every scored token, from whole-vocabulary logits."""
    kl, match, n = 0.0, 0, 0
    for w in make_windows(len(ids), seq_len):
        seq = ids[w.begin:w.end]
        lb = dict(iter_logits(base_engine, [seq]))[0][w.score_from - 1:w.length - 1].double().log_softmax(-1)
        lc = dict(iter_logits(cand_engine, [seq]))[0][w.score_from - 1:w.length - 1].double().log_softmax(-1)
        kl += float((lb.exp() * (lb - lc)).sum())
        match += int((lb.argmax(-1) == lc.argmax(-1)).sum())
        n += lb.shape[0]
    return kl / n, match / n


def test_topk_kl_is_exact_over_the_vocabulary_and_a_lower_bound_below_it(tiny_llama, tiny_qwen2):
    """KL against the baseline's saved top-k: the exact KL once k covers the vocabulary (512 here), and a
    lower bound, close when the baseline's mass outside its top-k is small, below it. The candidate is
    another random model with the same tokenizer, so the KL is large against float32 rounding."""
    base = build_llm(str(tiny_llama), EngineOptions(max_batch_tokens=128))
    cand = build_llm(str(tiny_qwen2), EngineOptions(max_batch_tokens=128))
    ids = base.engine.tokenizer.encode(TEXT)
    assert cand.engine.tokenizer.encode(TEXT) == ids
    exact_kl, exact_top1 = _exact_kl(base.engine, cand.engine, ids, 64)
    assert exact_kl > 1e-3
    results = {}
    for k in (512, 256, 8):
        ref = BaselineTopK(k)
        score_text(base.engine, ids, seq_len=64, record=ref)
        results[k] = (score_text(cand.engine, ids, seq_len=64, compare_to=ref).divergence, ref)
    full, ref = results[512]
    assert ref.exact and ref.mean_rest_mass == pytest.approx(0.0, abs=1e-5)
    assert full.kl_div == pytest.approx(exact_kl, rel=1e-4, abs=1e-7)
    assert full.top1_agreement == pytest.approx(exact_top1, abs=1.5 / full.tokens)  # a tie may break either way
    for k in (256, 8):
        div, ref = results[k]
        assert not ref.exact and ref.mean_rest_mass > 0
        assert 0 < div.kl_div <= exact_kl * (1 + 1e-4)
    assert results[256][0].kl_div >= results[8][0].kl_div * (1 - 1e-4)  # a finer partition: at least as much KL


def test_load_text_formats(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld")
    assert load_text(tmp_path / "a.txt") == "hello\nworld"
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_text(tmp_path / "b.jsonl") == "one\n\ntwo"
    (tmp_path / "c.json").write_text(json.dumps([{"text": "x"}, "y"]))
    assert load_text(tmp_path / "c.json") == "x\n\ny"
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "folder").mkdir()
    for bad, msg in [("missing.txt", "does not exist"), ("empty.txt", "is empty"), ("folder", "is a folder")]:
        with pytest.raises(LlmoptError, match=msg):
            load_text(tmp_path / bad)
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(LlmoptError, match="no string 'text' field"):
        load_text(tmp_path / "d.jsonl")
