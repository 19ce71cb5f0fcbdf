"""Workloads with a real Hugging Face tokenizer: reproducibility, lengths, shared prefixes, JSONL errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmopt.bench.workloads import (
    JsonlWorkload,
    PrefixWorkload,
    RandomWorkload,
    build_requests,
    load_jsonl,
    parse_length,
)
from llmopt.errors import LlmoptError


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_parse_length():
    assert parse_length("128").kind == "fixed"
    u = parse_length("64:256")
    assert (u.kind, u.lo, u.hi) == ("uniform", 64, 256)
    n = parse_length("normal:100,10")
    assert (n.kind, n.mean, n.std) == ("normal", 100, 10)
    for bad in ("0", "10:5", "abc", "normal:1", "-3"):
        with pytest.raises(LlmoptError, match="length"):
            parse_length(bad)
    with pytest.raises(LlmoptError, match="cannot parse token length"):
        RandomWorkload(input_len="lots")


def test_random_is_reproducible_by_seed(tiny_tokenizer):
    w = RandomWorkload(num_requests=8, input_len="10:40", output_len="5:9", seed=3)
    a, b = w.build(tiny_tokenizer), w.build(tiny_tokenizer)
    assert [r.model_dump() for r in a] == [r.model_dump() for r in b]
    c = w.model_copy(update={"seed": 4}).build(tiny_tokenizer)
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(r.ignore_eos for r in a)


def test_random_text_lengths_follow_the_distribution(tiny_tokenizer):
    reqs = RandomWorkload(num_requests=60, input_len="20:60", output_len="normal:50,5", seed=0).build(tiny_tokenizer)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.expected_prompt_tokens == len(_enc(tiny_tokenizer, r.prompt))  # what is sent is what we count
        assert 20 <= r.expected_prompt_tokens <= 60
    lens = [r.expected_prompt_tokens for r in reqs]
    assert max(lens) - min(lens) > 20  # actually spread over the range
    outs = np.array([r.max_tokens for r in reqs])
    assert abs(outs.mean() - 50) < 3 and 2 < outs.std() < 8


def test_random_token_ids_are_exact_and_not_special(tiny_tokenizer):
    reqs = RandomWorkload(num_requests=20, input_len="32", output_len="4", token_ids=True).build(tiny_tokenizer)
    special = set(tiny_tokenizer.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == 32 == r.expected_prompt_tokens
        assert not special & set(r.prompt)
        assert r.max_tokens == 4


def test_prefix_workload_shares_prefixes(tiny_tokenizer):
    w = PrefixWorkload(num_requests=6, num_prefixes=2, prefix_len=24, suffix_len="8", output_len="3", seed=1)
    reqs = w.build(tiny_tokenizer)
    ids = [_enc(tiny_tokenizer, r.prompt) for r in reqs]
    assert ids[0][:24] == ids[2][:24] == ids[4][:24]  # round-robin over the prefixes
    assert ids[1][:24] == ids[3][:24]
    assert ids[0][:24] != ids[1][:24]
    assert ids[0] != ids[2]  # unique suffixes
    assert all(r.expected_prompt_tokens == len(i) for r, i in zip(reqs, ids, strict=True))

    tok_reqs = w.model_copy(update={"token_ids": True}).build(tiny_tokenizer)
    assert all(len(r.prompt) == 32 for r in tok_reqs)
    assert tok_reqs[0].prompt[:24] == tok_reqs[2].prompt[:24]


def test_build_requests_needs_a_tokenizer_for_synthetic_workloads():
    with pytest.raises(LlmoptError, match="needs a tokenizer"):
        build_requests(RandomWorkload(), None)


def test_jsonl_workload(tmp_path, tiny_tokenizer):
    p = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "The quick brown fox", "max_tokens": 8},
        {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": False},
        {"messages": [{"role": "user", "content": "hello"}]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_jsonl(p, tokenizer=tiny_tokenizer, default_max_tokens=16)
    assert [r.max_tokens for r in reqs] == [8, 2, 16]
    assert reqs[0].expected_prompt_tokens == len(_enc(tiny_tokenizer, "The quick brown fox"))
    assert reqs[1].expected_prompt_tokens == 3 and reqs[1].ignore_eos is False
    assert reqs[2].is_chat and reqs[2].expected_prompt_tokens  # counted through the chat template
    cycled = JsonlWorkload(path=str(p), num_requests=7, default_max_tokens=4).build()
    assert len(cycled) == 7 and cycled[3].prompt == cycled[0].prompt


@pytest.mark.parametrize("content,line,needle", [
    ('{"prompt": "a", "max_tokens": 1}\n{"prompt": "b", "max_tokens": 1}\n{oops\n', 3, "invalid JSON"),
    ('{"prompt": "a"}\n', 1, "missing \"max_tokens\""),
    ('\n["a"]\n', 2, "expected a JSON object"),
    ('{"prompt": "a", "messages": [], "max_tokens": 1}\n', 1, "exactly one of"),
    ('{"prompt": "a", "max_tokens": 0}\n', 1, "positive integer"),
    ('{"prompt": [1, "x"], "max_tokens": 3}\n', 1, "list of token ids"),
    ('{"messages": [{"content": "hi"}], "max_tokens": 3}\n', 1, "role, content"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(LlmoptError) as e:
        load_jsonl(p)
    assert str(e.value).startswith(f"{p}:{line}: ")
    assert needle in str(e.value)


def test_jsonl_missing_and_empty_files(tmp_path):
    with pytest.raises(LlmoptError, match="cannot read workload file"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LlmoptError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl")
