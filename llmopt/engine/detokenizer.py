"""Incremental detokenization for streaming. Decoding new tokens alone breaks multi-byte characters and
leading spaces, so (as vLLM) each step decodes a short window before the read offset and emits what it
gained, holding back text that ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from llmopt.engine.sequence import Sequence

_CONTEXT_TOKENS = 5


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)
    seq.read_offset = seq.num_prompt_tokens


def detokenize_step(tokenizer, seq: Sequence, skip_special_tokens: bool = True, final: bool = False) -> str:
    """Return the text added by the tokens appended since the last call (may be empty). With `final`,
    nothing is held back: an incomplete character at the very end comes out as U+FFFD, as in vLLM."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
        delta = full[len(prefix):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return delta
    return ""
