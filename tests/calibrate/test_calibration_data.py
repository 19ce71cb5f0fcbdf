"""Checks for the data shipped in calibration_data/ (the Larkspur Labs knowledge-base scenario).

Plain pytest, no torch: schema of the eval sets, grounding of every context in kb_facts.md,
the lm-evaluation-harness task YAMLs, and the rule that calibration texts never contain eval items.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).resolve().parents[2] / "calibration_data"
NGRAM = 8


def load_jsonl(name: str) -> list[dict]:
    rows = []
    for lineno, line in enumerate((DATA / name).read_text(encoding="utf-8").splitlines(), 1):
        assert line.strip(), f"{name}:{lineno}: blank line"
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"{name}:{lineno}: not JSON: {exc}")
    return rows


def words(text: str) -> list[str]:
    """Lowercased words with punctuation stripped ("pg-main," -> "pg", "main")."""
    return re.findall(r"[^\W_]+", text.lower())


def ngrams(tokens: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def question_grams(question: str) -> set[tuple[str, ...]]:
    """8-grams of a question; a question shorter than 8 words counts as one whole-question gram."""
    tokens = words(question)
    return ngrams(tokens, min(NGRAM, len(tokens)))


def squash(text: str) -> str:
    return " ".join(text.lower().split())


def leaks(texts: list[str], questions: list[str], contexts: list[str]) -> list[str]:
    """Every way the calibration texts contain eval material: shared question n-grams, verbatim contexts."""
    problems = []
    by_gram: dict[tuple[str, ...], str] = {}
    for q in questions:
        for g in question_grams(q):
            by_gram[g] = q
    lengths = sorted({len(g) for g in by_gram})
    squashed_contexts = [(c, squash(c)) for c in dict.fromkeys(contexts)]
    for i, text in enumerate(texts):
        tokens = words(text)
        for n in lengths:
            for g in ngrams(tokens, n) & by_gram.keys():
                problems.append(f"calibration #{i} shares {' '.join(g)!r} with question {by_gram[g]!r}")
        flat = squash(text)
        for original, sq in squashed_contexts:
            if sq in flat:
                problems.append(f"calibration #{i} contains the context {original!r}")
    return problems


@pytest.fixture(scope="module")
def mc() -> list[dict]:
    return load_jsonl("kb_mc.jsonl")


@pytest.fixture(scope="module")
def gen() -> list[dict]:
    return load_jsonl("kb_gen.jsonl")


@pytest.fixture(scope="module")
def calibration() -> list[str]:
    rows = load_jsonl("kb_calibration.jsonl")
    for i, row in enumerate(rows):
        assert set(row) == {"text"}, f"calibration #{i}: keys {sorted(row)}"
        assert isinstance(row["text"], str) and row["text"].strip(), f"calibration #{i}: empty text"
    return [row["text"] for row in rows]


@pytest.fixture(scope="module")
def kb_text() -> str:
    return (DATA / "kb_facts.md").read_text(encoding="utf-8")


def test_expected_files_exist():
    for name in [
        "README.md",
        "kb_facts.md",
        "kb_mc.jsonl",
        "kb_mc.yaml",
        "kb_gen.jsonl",
        "kb_gen.yaml",
        "kb_calibration.jsonl",
    ]:
        assert (DATA / name).is_file(), name


def test_mc_items(mc):
    assert len(mc) == 100
    ids = [row["id"] for row in mc]
    assert len(set(ids)) == len(ids)
    for row in mc:
        rid = row["id"]
        assert re.fullmatch(r"mc-\d{3}", rid), rid
        for key in ("question", "context", "topic"):
            assert isinstance(row[key], str) and row[key].strip(), (rid, key)
        choices = row["choices"]
        assert isinstance(choices, list) and len(choices) == 4, rid
        assert all(isinstance(c, str) and c.strip() for c in choices), rid
        assert len({c.strip().lower() for c in choices}) == 4, f"{rid}: duplicate choices"
        # doc_to_choice "{{choices}}" renders the list's repr and parses it back; mixed quotes break that.
        assert not any("'" in c and '"' in c for c in choices), rid
        assert isinstance(row["answer"], int) and not isinstance(row["answer"], bool), rid
        assert 0 <= row["answer"] < 4, rid


def test_mc_answer_positions_balanced(mc):
    counts = Counter(row["answer"] for row in mc)
    for position in range(4):
        share = counts[position] / len(mc)
        assert 0.15 <= share <= 0.35, f"answer position {position}: {share:.0%} ({dict(counts)})"


def test_mc_covers_many_topics(mc):
    topics = Counter(row["topic"] for row in mc)
    assert len(topics) >= 8, topics
    assert max(topics.values()) <= 20, topics


def test_gen_items(gen):
    assert len(gen) == 40
    ids = [row["id"] for row in gen]
    assert len(set(ids)) == len(ids)
    for row in gen:
        rid = row["id"]
        assert re.fullmatch(r"gen-\d{3}", rid), rid
        for key in ("question", "context", "answer"):
            assert isinstance(row[key], str) and row[key].strip(), (rid, key)
        answer = row["answer"]
        assert answer in row["context"], f"{rid}: answer {answer!r} not in its context"
        # generate_until stops at a newline or a period, so the gold answer cannot contain either.
        assert "\n" not in answer and "." not in answer, rid
        assert len(answer.split()) <= 3, f"{rid}: answer is not short: {answer!r}"


def test_contexts_are_quoted_from_kb_facts(mc, gen, kb_text):
    for row in mc + gen:
        assert row["context"] in kb_text, f"{row['id']}: context is not a verbatim fact from kb_facts.md"


def _task(name: str) -> dict:
    config = yaml.safe_load((DATA / name).read_text(encoding="utf-8"))
    assert isinstance(config, dict), name
    data_files = config["dataset_kwargs"]["data_files"]
    split = config["test_split"]
    path = data_files[split]
    assert not Path(path).is_absolute(), f"{name}: data_files should be relative to the YAML"
    assert (DATA / path).is_file(), f"{name}: {path} does not exist next to the YAML"
    assert config["dataset_path"] == "json"
    return config


def test_mc_yaml():
    config = _task("kb_mc.yaml")
    assert config["task"] == "kb_mc"
    assert config["output_type"] == "multiple_choice"
    assert config["dataset_kwargs"]["data_files"]["test"] == "kb_mc.jsonl"
    for field in ("{{context}}", "{{question}}"):
        assert field in config["doc_to_text"]
    assert config["doc_to_text"].rstrip().endswith("Answer:")
    assert config["doc_to_choice"] == "{{choices}}"
    assert config["doc_to_target"] == "{{answer}}"
    metrics = {m["metric"]: m for m in config["metric_list"]}
    assert set(metrics) == {"acc", "acc_norm"}
    for m in metrics.values():
        assert m["aggregation"] == "mean" and m["higher_is_better"] is True


def test_gen_yaml():
    config = _task("kb_gen.yaml")
    assert config["task"] == "kb_gen"
    assert config["output_type"] == "generate_until"
    assert config["dataset_kwargs"]["data_files"]["test"] == "kb_gen.jsonl"
    assert config["doc_to_text"].rstrip().endswith("Answer:")
    assert config["doc_to_target"] == "{{answer}}"
    kwargs = config["generation_kwargs"]
    assert kwargs["until"] == ["\n", "."]
    assert kwargs["do_sample"] is False and kwargs["max_gen_toks"] == 16
    (metric,) = config["metric_list"]
    assert metric["metric"] == "exact_match"
    assert metric["ignore_case"] is True and metric["ignore_punctuation"] is True


def test_gen_yaml_example_is_not_an_eval_item(gen):
    """The fixed one-shot example in kb_gen.yaml must not give away any scored item."""
    prompt = yaml.safe_load((DATA / "kb_gen.yaml").read_text(encoding="utf-8"))["doc_to_text"]
    for row in gen:
        assert row["context"] not in prompt, row["id"]
        assert row["question"] not in prompt, row["id"]


def test_calibration_texts_shape(calibration):
    assert 250 <= len(calibration) <= 400
    assert len({squash(t) for t in calibration}) == len(calibration), "duplicate calibration texts"
    total = sum(len(t.encode("utf-8")) for t in calibration)
    assert 150_000 <= total <= 300_000, total
    lengths = [len(t.split()) for t in calibration]
    assert sum(n >= 300 for n in lengths) >= 15, "need long documents to fill a 512-token window"
    assert sum(n < 80 for n in lengths) >= 40, "need short texts too"


def test_calibration_does_not_contain_eval_items(mc, gen, calibration):
    questions = [row["question"] for row in mc + gen]
    contexts = [row["context"] for row in mc + gen]
    problems = leaks(calibration, questions, contexts)
    assert not problems, "\n".join(problems[:20])


def test_leak_check_catches_planted_overlap(mc, gen):
    """The overlap check is only worth something if it fires; plant both kinds of leak."""
    question, context = mc[0]["question"], gen[0]["context"]
    planted = [
        "Someone asked in the channel: " + question.upper() + " Nobody knew.",
        "Copied from the wiki:\n" + context.replace(" ", "  ") + "\nEnd of quote.",
        "An unrelated sentence about lunch in the canteen and bicycles.",
    ]
    problems = leaks(planted, [question], [context])
    assert any("calibration #0" in p and "question" in p for p in problems)
    assert any("calibration #1" in p and "context" in p for p in problems)
    assert not any("calibration #2" in p for p in problems)


def test_general_prose_is_varied_and_not_wikitext():
    """The general half of the default calibration mix: long original prose, no duplicates, and no
    12-word run shared with the WikiText-2 text that perplexity is scored on (when it is present)."""
    rows = load_jsonl("general_prose.jsonl")
    texts = [row["text"] for row in rows]
    assert all(set(row) == {"text"} and row["text"].strip() for row in rows)
    assert len({squash(t) for t in texts}) == len(texts) >= 80
    assert sum(len(t.split()) for t in texts) >= 30_000
    wikitext = DATA.parents[1] / "shared" / "data" / "wikitext2-valid.txt"
    if not wikitext.is_file():
        pytest.skip("../shared/data/wikitext2-valid.txt not present")
    eval_grams = ngrams(words(wikitext.read_text(encoding="utf-8")), 12)
    shared = [i for i, t in enumerate(texts) if ngrams(words(t), 12) & eval_grams]
    assert not shared, f"general_prose rows {shared} share a 12-word run with WikiText-2"
