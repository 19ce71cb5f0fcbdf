"""Structured outputs in the engine: llguidance masks in the sampler, per request, in a shared batch;
the grammar ends the request; compiled once; speculative decoding stays exact under a mask."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.llm_engine import RequestError
from llmopt.engine.spec_decode.verifier import verify
from llmopt.engine.structured_output import (
    GrammarError,
    StructuredOutputCompiler,
    StructuredOutputsParams,
    apply_bitmask,
    draft_masks,
)
from tests.engine_utils import token_ids

SO = StructuredOutputsParams
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 18, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "owner"],
          "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                  "minItems": 1, "maxItems": 3},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                   "properties": {"ok": {"type": "boolean"}}}}}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 512, "disable_below_acceptance": 0.0}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")


def _texts(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("schema", [PERSON, NESTED], ids=["flat", "nested"])
def test_json_schema_outputs_validate_with_sampling(llm, schema):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=SO(json=schema))
              for s in range(6)]
    for out in _texts(llm, ["The quick brown fox"] * 6, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_schema_as_json_text_and_json_object(llm):
    out = _texts(llm, ["A KV cache"], SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                                     structured_outputs=SO(json=json.dumps(PERSON))))[0]
    jsonschema.validate(json.loads(out.text), PERSON)
    outs = _texts(llm, ["A KV cache"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=200,
                                                           structured_outputs=SO(json_object=True))
                                            for s in range(4)])
    for out in outs:
        if out.finish_reason == "stop":  # an unbounded object can run to max_tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")


def test_regex_choice_and_grammars(llm):
    cases = [
        (SO(regex=r"[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        (SO(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (SO(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'), lambda t: re.fullmatch(r"x=[0-9]{1,3};", t)),
        (SO(grammar='root ::= "ab" ("c" | "d")'), lambda t: t in ("abc", "abd")),  # GBNF, vLLM's EBNF
    ]
    for spec, ok in cases:
        outs = _texts(llm, ["Hello"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=30,
                                                          structured_outputs=spec) for s in range(3)])
        for out in outs:
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)


def test_constrained_and_unconstrained_share_a_batch(llm):
    prompts = ["The quick brown fox", "Continuous batching", "A KV cache stores", "def add(a, b):"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = token_ids(llm, prompts, plain)
    eng = llm.engine
    batch_sizes = []
    eng.stat_listeners.append(lambda s: batch_sizes.append(s.batch_size))
    try:
        params = [plain, SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured_outputs=SO(json=PERSON)),
                  plain, SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=NESTED))]
        outs = _texts(llm, prompts, params)
    finally:
        eng.stat_listeners.pop()
    assert max(batch_sizes) == 4  # one step held all four
    assert outs[0].token_ids == ref[0] and outs[2].token_ids == ref[2]  # unconstrained: token-identical
    jsonschema.validate(json.loads(outs[1].text), PERSON)
    jsonschema.validate(json.loads(outs[3].text), NESTED)


def test_n_completions_have_their_own_grammar_state(llm):
    out = llm.generate(["Hello"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                                                 structured_outputs=SO(json=PERSON)))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)


def test_logprobs_are_of_the_masked_distribution(llm):
    out = _texts(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=10, logprobs=3,
                                                structured_outputs=SO(choice=["yes", "no"])))[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    allowed = {t for t, v in first.items() if v > float("-inf")}
    assert out.token_ids[0] in allowed
    assert sum(torch.tensor([v for v in first.values() if v > float("-inf")]).exp().tolist()) == pytest.approx(1.0, abs=1e-4)


def test_grammar_end_beats_min_tokens_and_max_tokens(llm):
    # min_tokens does not keep a complete value going; a value that completes on the last allowed
    # token finishes "stop", not "length"
    out = _texts(llm, ["Hi"], SamplingParams(temperature=0, max_tokens=20, min_tokens=15,
                                             structured_outputs=SO(choice=["yes"])))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    n = len(out.token_ids)
    out = _texts(llm, ["Hi"], SamplingParams(temperature=0, max_tokens=n, structured_outputs=SO(choice=["yes"])))[0]
    assert out.text == "yes" and out.finish_reason == "stop"


def test_bad_constraints_are_request_errors_naming_the_problem(llm):
    bad = [
        (SO(json={"type": "foo"}), "Invalid type: foo"),
        (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum (5) is greater than maximum (1)"),
        (SO(json={"not": {"type": "string"}}), "not"),
        (SO(json={"type": "string", "format": "weird"}), "Unknown format: weird"),
        (SO(json={"$ref": "#/$defs/missing"}), "does not exist"),
        (SO(json="{not json"), "not valid JSON"),
        (SO(json="[1, 2]"), "must be a JSON object"),
        (SO(regex="(ab"), "unclosed group"),
        (SO(grammar="start: foo"), "foo"),
        (SO(grammar="root ::= foo"), "Rule 'foo' not found"),  # GBNF
    ]
    for spec, needle in bad:
        with pytest.raises(RequestError, match=re.escape(needle)) as ei:
            llm.engine.add_request(prompt="Hi", params=SamplingParams(structured_outputs=spec))
        assert "\n" not in str(ei.value) and str(ei.value).startswith("structured_outputs: ")
    assert not llm.engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    for kw in ({}, {"json": {}, "regex": "a"}, {"json_object": False}, {"choice": []}, {"regex": ""}):
        with pytest.raises(ValueError):
            SO(**kw)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")


def test_each_constraint_is_compiled_once(llm):
    comp = llm.engine.structured_outputs
    spec = SO(json={"type": "object", "properties": {"unique_key_for_cache_test": {"type": "integer"}}})
    before = comp.num_compiled, comp.num_cache_hits
    llm.generate(["Hi", "Ho"], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=5, structured_outputs=spec))
    assert comp.num_compiled == before[0] + 1  # two requests of two sequences each: one compile
    assert comp.num_cache_hits >= before[1] + 3
    assert SO(json=spec.json).key == spec.key != SO(regex=spec.key[1]).key  # keyed by kind and text


def test_compile_cache_is_bounded(tiny_llama):
    from llmopt.models.tokenizer import load_tokenizer

    comp = StructuredOutputCompiler(load_tokenizer(tiny_llama), 512, [2], cache_size=2)
    for r in ("a", "b", "c", "a"):
        comp.compile(SO(regex=r))
    assert comp.num_compiled == 4 and comp.num_cache_hits == 0  # "a" was evicted by "c"
    comp.compile(SO(regex="a"))
    assert comp.num_cache_hits == 1


def test_missing_llguidance_or_slow_tokenizer_is_a_grammar_error(tiny_llama, monkeypatch):
    from llmopt.models.tokenizer import load_tokenizer

    comp = StructuredOutputCompiler(object(), 512, [2])
    with pytest.raises(GrammarError, match="not available for this tokenizer"):
        comp.compile(SO(regex="a"))
    monkeypatch.setitem(sys.modules, "llguidance.hf", None)  # as if the package were not installed
    comp = StructuredOutputCompiler(load_tokenizer(tiny_llama), 512, [2])
    with pytest.raises(GrammarError, match="need the llguidance package"):
        comp.compile(SO(regex="a"))


def test_preempted_constrained_request_keeps_its_grammar_state(tiny_llama):
    small = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=40, block_size=4, max_num_seqs=4)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=SO(json=NESTED))
              for s in range(4)]
    outs = _texts(small, ["The quick brown fox jumps"] * 4, params)
    assert all(o.finish_reason == "stop" for o in outs)
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), NESTED)


# ---- speculative decoding ----------------------------------------------------------------------------------
def test_draft_masks_stop_at_a_refused_draft_and_roll_back(llm):
    comp = llm.engine.structured_outputs
    tok = llm.get_tokenizer()
    m = comp.matcher(SO(choice=["abab"]))
    good = tok.encode("abab", add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    vocab = llm.engine.spec.vocab_size
    logits = torch.zeros(len(good) + 2, vocab)
    draft_masks(m, good[:1] + bad + good[1:], logits)
    allowed = [(row > float("-inf")).nonzero().flatten().tolist() for row in logits]
    assert good[0] in allowed[0] and bad[0] not in allowed[1]
    assert all(len(a) == vocab for a in allowed[2:])  # past the refused draft: untouched, never used
    assert m.validate(good) == len(good)  # rolled back: the matcher is where it started
    # drafts that complete the grammar and go on (an end token): the walk stops at the completion, so the
    # rollback restores exactly what it consumed
    eos = llm.engine.eos_token_ids[0]
    draft_masks(m, good + [eos, eos], torch.zeros(len(good) + 3, vocab))
    assert m.validate(good) == len(good) and not m.is_terminated
    # a refused draft is rejected, greedy or sampled; accepted drafts are the grammar's
    assert verify(torch.zeros(3, vocab), bad + bad, SamplingParams(temperature=0), None, m)[0] != bad[0]
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        out = verify(torch.randn(3, vocab), bad + bad, SamplingParams(temperature=1.0), g, m)
        assert len(out) == 1 and m.validate(out) == 1


def test_apply_bitmask_matches_bits():
    logits = torch.zeros(2, 70)
    bm = torch.zeros(2, 3, dtype=torch.int32)
    bm[0, 0] = 1 << 5
    bm[0, 2] = 1 << 3  # token 67
    bm[1, 0] = -2**31  # bit 31: token 31
    apply_bitmask(logits, bm)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [5, 67]
    assert (logits[1] == 0).nonzero().flatten().tolist() == [31]


def test_spec_decode_with_a_schema_is_exact_and_valid(tiny_llama):
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    spec = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", speculative=SPEC)
    example = '{"name":"ab","age":42,"color":"red"} {"name":"cd","age":43,"color":"blue"} '
    prompts = [example * 3, "The quick brown fox " + example, example + "A KV cache"]
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON))
    a = token_ids(plain, prompts, greedy)
    b = token_ids(spec, prompts, greedy)
    assert a == b  # greedy: token-identical with and without speculation
    c = spec.engine.spec_counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=SO(json=PERSON))
               for s in range(6)]
    drafts_before = c.num_draft_tokens
    for out in _texts(spec, [example * 3] * 6, sampled):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert c.num_draft_tokens > drafts_before
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
