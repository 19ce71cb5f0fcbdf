"""Contamination check: calibration windows must not contain eval material.

The repository's rule (calibration_data/README.md): no calibration text shares an 8-word n-gram
(lowercased, punctuation stripped) with an eval question, and no eval context appears verbatim.
For JSON-lines eval sets, `context`-like fields are checked verbatim, question-like fields by
n-grams (a question shorter than n words counts as one whole-question gram) and `text`-like fields by
n-grams; answer/choice fields are not checked (short, and in-domain calibration text states the same
facts by design). Plain-text eval files (e.g. wikitext) are checked by n-grams throughout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from llmopt.calibrate.sources import TEXT_FIELDS, DataSource, load_texts
from llmopt.errors import LlmoptError

NGRAM = 8
CONTEXT_FIELDS = ("context", "passage", "document", "article")
QUESTION_FIELDS = ("question", "query", "prompt", "input")


def words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+", text.lower())


def ngrams(tokens: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def _squash(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass
class EvalIndex:
    """Everything a calibration text must not contain."""

    grams: dict[int, set[tuple[str, ...]]]
    contexts: list[str]

    def add_text(self, text: str, whole_if_short: bool = False) -> None:
        toks = words(text)
        n = min(NGRAM, len(toks)) if whole_if_short else NGRAM
        if n:
            self.grams.setdefault(n, set()).update(ngrams(toks, n))


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def build_eval_index(paths: list[str]) -> EvalIndex:
    index = EvalIndex({}, [])
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise LlmoptError(f"--eval-data {p} does not exist")
        if path.is_file() and path.suffix.lower() == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LlmoptError(f"{path}: not JSON lines ({e})") from None
                for key, value in (row.items() if isinstance(row, dict) else [("", row)]):
                    for s in _strings(value):
                        if key in CONTEXT_FIELDS:
                            index.contexts.append(_squash(s))
                        elif key in QUESTION_FIELDS or key in TEXT_FIELDS:
                            index.add_text(s, whole_if_short=key in QUESTION_FIELDS)
        else:
            for text in load_texts(DataSource(path=str(path))):
                index.add_text(text)
    return index


@dataclass
class Overlap:
    window: int
    example: str


def find_overlaps(texts: list[str], index: EvalIndex) -> list[Overlap]:
    """One Overlap per calibration text that contains eval material (with an example of it)."""
    found = []
    for i, text in enumerate(texts):
        toks = words(text)
        hit = None
        for n, grams in index.grams.items():
            hit = next((g for g in ngrams(toks, n) if g in grams), None)
            if hit:
                break
        if hit:
            found.append(Overlap(i, " ".join(hit)))
            continue
        squashed = _squash(text)
        ctx = next((c for c in index.contexts if c and c in squashed), None)
        if ctx:
            found.append(Overlap(i, ctx[:60]))
    return found
