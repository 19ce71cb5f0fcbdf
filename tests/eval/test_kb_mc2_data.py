"""calibration_data/kb_mc2 (100 more questions) and kb_mc200 (kb_mc + kb_mc2): grounded in kb_facts.md,
no question repeated from kb_mc, balanced gold positions, and nothing of them in the calibration texts."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from llmopt.eval.tasks import load_task
from tests.calibrate.test_calibration_data import leaks  # the calibration data's own leak check

DATA = Path(__file__).resolve().parents[2] / "calibration_data"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]


def test_kb_mc2_is_grounded_new_and_balanced():
    facts = dict(re.findall(r"^- `([A-Z]+-\d+)` (.*)$", (DATA / "kb_facts.md").read_text(encoding="utf-8"), re.M))
    rows = _rows("kb_mc2.jsonl")
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    old = {r["question"] for r in _rows("kb_mc.jsonl")}
    for r in rows:
        assert r["context"] == facts[r["fact"]], r["id"]  # quoted word for word from its fact
        assert r["question"] not in old and len(set(r["choices"])) == 4 and 0 <= r["answer"] < 4, r["id"]
    assert len({r["question"] for r in rows}) == 100
    assert Counter(r["answer"] for r in rows) == {0: 25, 1: 25, 2: 25, 3: 25}


def test_calibration_texts_hold_none_of_it():
    texts = [r["text"] for name in ("kb_calibration.jsonl", "general_prose.jsonl") for r in _rows(name)]
    rows = _rows("kb_mc2.jsonl")
    assert leaks(texts, [r["question"] for r in rows], [r["context"] for r in rows]) == []


def test_task_configs():
    mc2, both = load_task(DATA / "kb_mc2.yaml"), load_task(DATA / "kb_mc200.yaml")
    assert (mc2.name, len(mc2.docs)) == ("kb_mc2", 100)
    assert (both.name, len(both.docs)) == ("kb_mc200", 200)
    assert [m.metric for m in both.metrics] == ["acc", "acc_norm"]
    assert both.docs[100]["id"] == "mc2-001"
