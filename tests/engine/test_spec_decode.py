"""Speculative decoding: prompt lookup, greedy identity, unchanged sampling distribution, KV rollback."""

from __future__ import annotations

import collections

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import iter_logits
from llmopt.engine.spec_decode import SpeculativeConfig
from llmopt.engine.spec_decode.ngram import ngram_propose
from llmopt.errors import LlmoptError
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.testing.tiny_model import write_tiny_llama
from tests.engine_utils import token_ids

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 512, "disable_below_acceptance": 0.0}


def test_ngram_propose_finds_the_latest_longest_match():
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # suffix [2, 3] occurs at 1 and 5; the latest (5) is followed by 5, 6, 7, 2
    assert ngram_propose(toks, 4, 1, 3) == [5, 6, 7, 2]
    # a longer suffix wins over a more recent shorter one
    toks = [7, 8, 9, 1, 2, 0, 9, 5, 8, 9]
    assert ngram_propose(toks, 2, 1, 3) == [1, 2]
    assert ngram_propose([1, 2, 3], 4, 2, 3) == []
    # a match near the end keeps copying its own continuation: a periodic tail yields k tokens
    assert ngram_propose([5, 5], 3, 1, 2) == [5, 5, 5]
    assert ngram_propose([1, 7, 8, 7, 8], 5, 1, 2) == [7, 8, 7, 8, 7]


def test_config_validation():
    with pytest.raises(ValueError):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=0)


def _repetitive_prompts(n: int) -> list[list[int]]:
    base = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(n)]
    return [b * 6 for b in base]


def test_greedy_output_identical_and_kv_rolled_back(tiny_llama):
    plain = LLM(str(tiny_llama), dtype="float32")
    spec = LLM(str(tiny_llama), dtype="float32", speculative=SPEC)
    prompts = _repetitive_prompts(6) + [[3, 4, 5, 6, 7, 8, 9, 11, 13, 17]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = token_ids(plain, prompts, params)
    b = token_ids(spec, prompts, params)
    assert a == b
    c = spec.engine.spec_counters
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0
    assert c.num_accepted_tokens < c.num_draft_tokens  # some drafts were rejected and rolled back
    bm = spec.engine.block_manager
    assert all(blk.ref_count == 0 for blk in bm.blocks) and bm.num_free_blocks == bm.num_blocks
    # the rolled-back KV slots never poisoned the prefix cache: a rerun is still identical
    assert token_ids(spec, prompts, params) == a
    # and the text streamed equals the tokens
    out = spec.generate(prompts[:1], params)[0].outputs[0]
    assert out.text == spec.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_stop_conditions_inside_an_accepted_run(tiny_llama):
    plain = LLM(str(tiny_llama), dtype="float32")
    spec = LLM(str(tiny_llama), dtype="float32", speculative=SPEC)
    prompts = _repetitive_prompts(3)
    for max_tokens in (1, 2, 5, 9):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert token_ids(spec, prompts, p) == token_ids(plain, prompts, p)
    ref = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_tok = ref.outputs[0].token_ids[6]
    p = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    assert spec.generate(prompts[:1], p)[0].outputs[0].token_ids == plain.generate(prompts[:1], p)[0].outputs[0].token_ids


def _chi2_pvalue(a: collections.Counter, b: collections.Counter, min_count: int = 10) -> float:
    """Two-sample chi-square homogeneity test over categories (rare ones pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rows = [[a[k] for k in keys] + [sum(a.values()) - sum(a[k] for k in keys)],
            [b[k] for k in keys] + [sum(b.values()) - sum(b[k] for k in keys)]]
    t = torch.tensor(rows, dtype=torch.float64)
    if t[:, -1].sum() == 0:
        t = t[:, :-1]
    exp = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - exp) ** 2 / exp).sum()
    df = t.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def test_sampling_distribution_is_unchanged(tiny_llama):
    """Rejection sampling keeps the target's distribution: the 2nd and 3rd generated tokens (the ones
    speculation verifies) have the same distribution with and without it."""
    n = 1200
    # every vocabulary token occurs in the prompt, so prompt lookup always finds a match to propose
    vocab = list(range(3, 440))
    prompt = vocab[::2] + vocab[1::2]
    params = [SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    plain = LLM(str(tiny_llama), dtype="float32", max_num_seqs=256)
    spec = LLM(str(tiny_llama), dtype="float32", max_num_seqs=256, speculative=SPEC)
    a = [tuple(o.outputs[0].token_ids[1:]) for o in plain.generate([prompt] * n, params)]
    b_params = [p.model_copy(update={"seed": p.seed + 10_000}) for p in params]
    b = [tuple(o.outputs[0].token_ids[1:]) for o in spec.generate([prompt] * n, b_params)]
    c = spec.engine.spec_counters
    assert c.num_draft_tokens > n  # speculation really ran for these requests
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    for pos in (0, 1, 2):
        pv = _chi2_pvalue(collections.Counter(x[pos] for x in a), collections.Counter(x[pos] for x in b))
        assert pv > 1e-3, f"token {pos + 2} distribution differs (p={pv:.2e})"


def test_dynamic_disable_on_low_acceptance(tiny_llama):
    cfg = dict(SPEC, disable_below_acceptance=0.99, disable_min_drafts=4)
    spec = LLM(str(tiny_llama), dtype="float32", speculative=cfg)
    vocab = list(range(3, 440))
    spec.generate([vocab[::2] + vocab[1::2]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    c = spec.engine.spec_counters
    assert c.disabled_requests == 1
    assert c.num_draft_tokens < 40  # it stopped drafting once the acceptance rate was known to be low


def test_large_batches_skip_speculation(tiny_llama):
    cfg = dict(SPEC, max_batch_size=2)
    spec = LLM(str(tiny_llama), dtype="float32", speculative=cfg)
    spec.generate(_repetitive_prompts(6), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert spec.engine.spec_counters.skipped_steps > 0


def test_layer_skip_self_draft_greedy_identity(tiny_llama):
    plain = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _repetitive_prompts(4) + [[3, 4, 5, 6, 7, 8, 9, 11, 13, 17]]
    ref = token_ids(plain, prompts, params)
    half = LLM(str(tiny_llama), dtype="float32", speculative={"method": "layer_skip", "draft_layers": 1,
                                                             "max_batch_size": 64})
    assert token_ids(half, prompts, params) == ref
    assert half.engine.spec_counters.num_draft_tokens > 0
    bm = half.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # a "draft" made of every layer is the target itself: nearly every draft must be accepted, which
    # checks that draft positions, slots and the verification offsets line up
    full = LLM(str(tiny_llama), dtype="float32", speculative={"method": "layer_skip", "draft_layers": 2,
                                                             "max_batch_size": 64})
    assert token_ids(full, prompts, params) == ref
    assert full.engine.spec_counters.acceptance_rate > 0.95


def _draft_spec(draft, **kw) -> dict:
    return {"method": "draft", "draft_model": str(draft), "draft_dtype": "float32", "num_speculative_tokens": 4,
            "max_batch_size": 64, "disable_below_acceptance": 0.0, **kw}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tiny_llama):
    """A W4A16 (RTN, group 32) copy of the target: it agrees with the target often, not always."""
    out = tmp_path_factory.mktemp("draft") / "w4"
    quantize_model(QuantizeConfig(model=str(tiny_llama), scheme="w4a16", group_size=32, output=out, device="cpu"))
    return out


def test_draft_model_that_is_the_target_is_always_accepted(tiny_llama):
    """The target as its own draft: every draft must be accepted, which checks the draft pool's
    catch-up prefill, its mirrored block tables and the positions of the single-token steps."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _repetitive_prompts(4) + [[3, 4, 5, 6, 7, 8, 9, 11, 13, 17]]
    ref = token_ids(LLM(str(tiny_llama), dtype="float32"), prompts, params)
    spec = LLM(str(tiny_llama), dtype="float32", speculative=_draft_spec(tiny_llama))
    assert token_ids(spec, prompts, params) == ref
    c = spec.engine.spec_counters
    assert c.num_draft_tokens > 0 and c.acceptance_rate > 0.95


def test_draft_model_rejections_roll_back_and_preemption_recomputes(tiny_llama, other_draft):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _repetitive_prompts(6) + [[3, 4, 5, 6, 7, 8, 9, 11, 13, 17]]
    ref = token_ids(LLM(str(tiny_llama), dtype="float32"), prompts, params)
    spec = LLM(str(tiny_llama), dtype="float32", speculative=_draft_spec(other_draft))
    assert token_ids(spec, prompts, params) == ref
    c = spec.engine.spec_counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens < c.num_draft_tokens
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # a pool of 12 blocks for 7 sequences of up to 70 tokens forces preemption and recompute
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=12, speculative=_draft_spec(tiny_llama))
    assert token_ids(tight, prompts, params) == ref
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.spec_counters.acceptance_rate > 0.95  # the draft's cache was rebuilt, not stale


def _reference_counts(target: LLM, draft: LLM, prompt: list[int], max_tokens: int, k: int) -> tuple[int, int]:
    """Speculation without any cache reuse: each round the draft generates from the full context and
    the target scores context + drafts from scratch. Returns (draft tokens, accepted tokens)."""
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # the first token comes from the prefill step, which never speculates
    toks, drafted, accepted = list(prompt) + target.generate([prompt], greedy)[0].outputs[0].token_ids, 0, 0
    while len(toks) - len(prompt) < max_tokens:
        kk = min(k, max_tokens - (len(toks) - len(prompt)) - 1)
        if kk <= 0:
            toks += target.generate([toks], greedy)[0].outputs[0].token_ids
            continue
        drafts = draft.generate([toks], greedy.model_copy(update={"max_tokens": kk}))[0].outputs[0].token_ids
        logits = dict(iter_logits(target.engine, [toks + drafts]))[0]
        want = logits[len(toks) - 1:].argmax(dim=-1).tolist()
        n = next((i for i, d in enumerate(drafts) if d != want[i]), len(drafts))
        drafted, accepted = drafted + len(drafts), accepted + n
        toks += drafts[:n] + [want[n]]
    return drafted, accepted


def test_draft_model_cache_matches_a_from_scratch_reference(tiny_llama, other_draft):
    """The draft's own pool after rejections must hold exactly what a fresh draft would compute:
    the engine's draft and acceptance counts equal those of a cache-free reference, request after
    request on one engine. Several prompts, so that some drafts are rejected whatever the draft's
    quantization grid (one prompt alone was accepted in full once RTN's grid got finer)."""
    prompts = _repetitive_prompts(3) + [[3, 4, 5, 6, 7, 8, 9, 11, 13, 17]]
    spec = LLM(str(tiny_llama), dtype="float32", speculative=_draft_spec(other_draft))
    target, draft = LLM(str(tiny_llama), dtype="float32"), LLM(str(other_draft), dtype="float32")
    drafted = accepted = 0
    for prompt in prompts:
        spec.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        d, a = _reference_counts(target, draft, prompt, 24, 4)
        drafted, accepted = drafted + d, accepted + a
        c = spec.engine.spec_counters
        assert (c.num_draft_tokens, c.num_accepted_tokens) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_draft_model_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="only used by method 'draft'"):
        SpeculativeConfig(method="ngram", draft_model="x")
    big_vocab = write_tiny_llama(tmp_path / "v", tokenizer_vocab_size=300)
    with pytest.raises(LlmoptError, match="same tokenizer"):
        LLM(str(tiny_llama), dtype="float32", speculative=_draft_spec(big_vocab))


def test_bench_speculation_scenario_reports_acceptance(tiny_llama, tmp_path):
    import json
    import subprocess
    import sys

    data = tmp_path / "grounded.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "the KV cache stores keys and values " * 8, "max_tokens": 24})
                              for _ in range(4)) + "\n")
    r = subprocess.run([sys.executable, "-m", "llmopt", "bench", "--model", str(tiny_llama), "--dtype", "float32",
                        "--kv-cache-memory", "16MiB", "--scenario", "speculation", "--workload", "jsonl",
                        "--dataset", str(data), "--concurrency", "1", "--json", str(tmp_path / "s.json"),
                        "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "s.json").read_text())
    off, on = (v["report"]["runs"][0]["server_metrics"] for v in rep["variants"])
    assert off["spec_decode_draft_tokens"] is None
    assert on["spec_decode_draft_tokens"] > 0 and 0 <= on["spec_decode_acceptance_rate"] <= 1


def test_draft_models_stop_speculating_sooner_by_default():
    """A draft model costs a forward per draft token, so its default bar for acceptance is higher."""
    assert SpeculativeConfig(method="ngram").min_acceptance == 0.3
    assert SpeculativeConfig(method="draft", draft_model="x").min_acceptance == 0.7
    assert SpeculativeConfig(method="draft", draft_model="x", disable_below_acceptance=0.2).min_acceptance == 0.2


def test_adaptive_draft_length_grows_on_full_acceptance_and_keeps_outputs(tiny_llama):
    """max_speculative_tokens > k: each request's k moves like transformers' heuristic schedule."""
    with pytest.raises(ValueError, match="at least num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=4, max_speculative_tokens=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _repetitive_prompts(4)
    ref = token_ids(LLM(str(tiny_llama), dtype="float32"), prompts, params)
    spec = LLM(str(tiny_llama), dtype="float32",
               speculative=dict(SPEC, num_speculative_tokens=2, max_speculative_tokens=8))
    assert token_ids(spec, prompts, params) == ref
    c = spec.engine.spec_counters
    assert len(c.accepted_per_pos) == 8
    assert sum(c.accepted_per_pos[2:]) > 0  # some rounds drafted more than the starting k = 2
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
