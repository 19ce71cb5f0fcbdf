"""Read the evaluation text for perplexity: one string, tokenized once by the caller.

Perplexity is defined over one token stream, so documents are concatenated before tokenizing
(a `.txt` file as is; `.jsonl`/`.json` documents' `text` fields joined with a blank line, the
convention of the HF perplexity guide and of lm-eval's wikitext task). Problems are reported as one
line naming the file, so the CLI can exit 2 without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmopt.errors import LlmoptError

DOC_SEPARATOR = "\n\n"
TEXT_FIELD = "text"


def _docs_from_records(records: list, path: Path) -> list[str]:
    docs = []
    for i, rec in enumerate(records):
        if isinstance(rec, str):
            docs.append(rec)
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get(TEXT_FIELD), str):
            raise LlmoptError(f"{path}: record {i + 1} has no string {TEXT_FIELD!r} field")
        docs.append(rec[TEXT_FIELD])
    return docs


def load_text(path: str | Path) -> str:
    """The text of `path` (.txt, .jsonl or .json with `text` fields); never empty."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise LlmoptError(f"perplexity data {p} " + ("is a folder; give a .txt, .jsonl or .json file" if p.is_dir()
                                                     else "does not exist"))
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LlmoptError(f"cannot read perplexity data {p}: {e}") from None
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise LlmoptError(f"{p}:{n}: invalid JSON ({e.msg})") from None
        text = DOC_SEPARATOR.join(_docs_from_records(records, p))
    elif suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise LlmoptError(f"{p}: invalid JSON ({e.msg})") from None
        if isinstance(data, dict) and isinstance(data.get(TEXT_FIELD), list):
            data = data[TEXT_FIELD]
        if not isinstance(data, list):
            raise LlmoptError(f"{p}: expected a list of documents or {{\"text\": [...]}}")
        text = DOC_SEPARATOR.join(_docs_from_records(data, p))
    else:
        text = raw
    if not text.strip():
        raise LlmoptError(f"perplexity data {p} is empty")
    return text
