"""Shared helpers for eval tests: small lm-eval task folders and running `llmopt eval` in-process."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.cli_runner import run_cli

MC_DOCS = [
    {"id": f"q{i}", "context": ctx, "question": q, "choices": ch, "answer": a}
    for i, (ctx, q, ch, a) in enumerate([
        ("The quick brown fox jumps over the lazy dog.", "What jumps?", ["the fox", "the dog", "a cat", "a KV cache"], 0),
        ("A KV cache stores keys and values.", "What does it store?", ["tokens", "keys and values", "dogs", "speed"], 1),
        ("Quantization trades quality for speed.", "What is traded?", ["memory", "dogs", "quality", "foxes"], 2),
        ("Continuous batching schedules requests.", "What is scheduled?", ["dogs", "keys", "bits", "requests"], 3),
        ("def add(a, b): return a + b", "What does add return?", ["a + b", "a - b", "a * b", "b"], 0),
        ("The lazy dog sleeps.", "Who sleeps?", ["the fox", "the lazy dog", "the cache", "nobody"], 1),
    ], 1)
]
GEN_DOCS = [
    {"id": f"g{i}", "context": ctx, "question": q, "answer": a}
    for i, (ctx, q, a) in enumerate([
        ("The fox is brown.", "What color is the fox?", "brown"),
        ("The dog is lazy.", "How is the dog?", "lazy"),
        ("There are 42 values.", "How many values?", "42"),
    ], 1)
]


def write_task(folder: Path, name: str = "tiny_mc", **overrides) -> Path:
    """A multiple-choice (default) or generate_until task in lm-eval's YAML format, data beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = overrides.pop("generate", False)
    docs = GEN_DOCS if gen else MC_DOCS
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": f"{name}.jsonl"}},
        "test_split": "test",
        "output_type": "generate_until" if gen else "multiple_choice",
        "doc_to_text": "Context: {{context}}\nQuestion: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "metadata": {"version": 1.0},
    }
    if gen:
        cfg["generation_kwargs"] = {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False}
        cfg["metric_list"] = [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                               "ignore_case": True, "ignore_punctuation": True,
                               "regexes_to_ignore": ["^\\s+", "\\s+$"]}]
    else:
        cfg["doc_to_choice"] = "{{choices}}"
    cfg.update(overrides)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_eval_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`llmopt eval ARGS` in this process: (exit code, stdout, stderr)."""
    return run_cli(monkeypatch, capsys, "eval", *args)
