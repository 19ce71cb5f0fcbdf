"""Log-likelihood of a continuation given a context, tokenized and truncated as lm-eval's HFLM does.

Tokenization decides the answer on multiple-choice tasks, so it follows lm-eval exactly
(`TemplateLM._encode_pair`): trailing whitespace of the context moves to the continuation; the
context and context+continuation are encoded separately (with the tokenizer's default special
tokens, unless the text already starts with BOS) and the continuation's tokens are what follows the
context's length in the joint encoding. An empty context is replaced by the prefix token (BOS, else
EOS). Over-long inputs keep their last max_length+1 tokens, the last one dropped, as HFLM does.

The score is the sum of the continuation tokens' log-probabilities, and `is_greedy` says whether each
of them was the argmax, both from teacher-forced logits of `iter_logits` (one forward per pair, many
pairs per batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.engine.llm_engine import LLMEngine
from llmopt.engine.scoring import iter_logits
from llmopt.errors import LlmoptError


@dataclass(frozen=True)
class Scored:
    logprob: float
    is_greedy: bool
    num_tokens: int


def _prefix_token_id(tokenizer) -> int:
    tid = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tid is None:
        raise LlmoptError("the tokenizer has neither a BOS nor an EOS token to condition an empty context on")
    return int(tid)


def tok_encode(tokenizer, text: str) -> list[int]:
    """HFLM.tok_encode: default special tokens, except none when the text already starts with BOS."""
    prefix = tokenizer.decode(_prefix_token_id(tokenizer))
    if prefix and text.startswith(prefix):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) exactly as lm-eval's loglikelihood() builds them."""
    if context == "":
        cont = list(tokenizer.encode(continuation, add_special_tokens=False))
        prefix = _prefix_token_id(tokenizer)
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok_encode(tokenizer, context + continuation)
    ctx = tok_encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def score_continuations(engine: LLMEngine, pairs: list[tuple[str, str]],
                        max_batch_tokens: int | None = None) -> list[Scored]:
    """Sum log p(continuation | context) and greediness for every (context, continuation) pair."""
    tok = engine.tokenizer
    max_len = engine.max_model_len
    inputs: list[list[int]] = []
    targets: list[list[int]] = []
    for ctx_text, cont_text in pairs:
        ctx, cont = encode_pair(tok, ctx_text, cont_text)
        if not cont:
            raise LlmoptError(f"the continuation {cont_text!r} encodes to no tokens")
        if len(cont) > max_len:
            raise LlmoptError(f"a continuation of {len(cont)} tokens exceeds max_model_len {max_len}")
        inputs.append((ctx + cont)[-(max_len + 1):][:-1])
        targets.append(cont)
    out: list[Scored | None] = [None] * len(pairs)
    for i, logits in iter_logits(engine, inputs, max_batch_tokens=max_batch_tokens):
        n = len(targets[i])
        rows = logits[len(inputs[i]) - n:]
        target = torch.tensor(targets[i], device=rows.device)
        lp = torch.log_softmax(rows, dim=-1)
        picked = lp.gather(1, target.unsqueeze(1)).squeeze(1)
        greedy = bool((rows.argmax(dim=-1) == target).all())
        out[i] = Scored(float(picked.double().sum()), greedy, n)
    return out  # type: ignore[return-value]

