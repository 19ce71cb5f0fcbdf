"""Loading the tokenizer that travels with a model directory (also for GGUF-converted caches)."""

from __future__ import annotations

from pathlib import Path

from llmopt.errors import LlmoptError


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, directory)


def load_text_tokenizer(directory: str | Path):
    """The tokenizer for encoding and decoding text only (benchmark prompts), without torch where the
    directory has a `tokenizer.json`: `AutoTokenizer` imports transformers' model configs, and with them
    torch, which cost `llmopt bench --url` over a second of a core before every run (docs/BENCHMARKS.md, "The
    benchmark client's start"). `PreTrainedTokenizerFast` over the same file encodes and decodes as
    `AutoTokenizer`'s does (SmolLM2's tested, Gemma 3's measured once); without the file, `load_tokenizer`."""
    if not (Path(directory) / "tokenizer.json").is_file():
        return load_tokenizer(directory)
    from transformers import PreTrainedTokenizerFast

    return _from_pretrained(PreTrainedTokenizerFast, directory)


def _from_pretrained(cls, directory: str | Path):
    try:
        return cls.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise LlmoptError(f"cannot load the tokenizer from {directory}: {str(e).splitlines()[0]}") from None
