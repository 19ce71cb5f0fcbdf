"""Loading the tokenizer that travels with a model directory (also for GGUF-converted caches)."""

from __future__ import annotations

from pathlib import Path

from llmopt.errors import LlmoptError


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise LlmoptError(f"cannot load the tokenizer from {directory}: {str(e).splitlines()[0]}") from None
