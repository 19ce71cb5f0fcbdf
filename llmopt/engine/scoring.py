"""Teacher-forced scoring (perplexity, KL, log-likelihood tasks) through the engine's own model runner
and paged KV cache, so a quantized checkpoint or INT8 KV cache is measured exactly as it is served.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmopt.engine.llm_engine import LLMEngine
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence
from llmopt.errors import LlmoptError

_PARAMS = SamplingParams(max_tokens=1)


@torch.inference_mode()
def iter_logits(engine: LLMEngine, sequences: list[list[int]],
                max_batch_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (index, float32 logits [len, vocab]) for each sequence; several sequences share a forward
    pass while their total length stays within `max_batch_tokens` (default: the engine's token budget)."""
    for idx, hidden in iter_hidden(engine, sequences, max_batch_tokens):
        yield idx, engine.model.compute_logits(hidden)


@torch.inference_mode()
def iter_hidden(engine: LLMEngine, sequences: list[list[int]],
                max_batch_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (index, final hidden states [len, hidden]) for each sequence, batched as `iter_logits`. Why:
    a caller that needs the logits of a few rows (perplexity scores only a window's new tokens) computes
    them in row chunks, and never holds a whole [len, vocab] block (1 GB for 2k tokens of a 128k vocab)."""
    if engine.has_unfinished_requests():
        raise LlmoptError("scoring needs an idle engine (requests are still running)")
    budget = max_batch_tokens or max(engine.config.max_num_batched_tokens, max(map(len, sequences), default=1))
    bm = engine.block_manager
    i = 0
    while i < len(sequences):
        batch: list[tuple[int, Sequence]] = []
        total = 0
        while i < len(sequences) and (not batch or total + len(sequences[i]) <= budget):
            ids = sequences[i]
            if not ids:
                raise LlmoptError("cannot score an empty sequence")
            if len(ids) > engine.max_model_len:
                raise LlmoptError(f"sequence of {len(ids)} tokens exceeds max_model_len {engine.max_model_len}")
            seq = Sequence(f"score-{i}", 0, ids, _PARAMS, 0.0)
            if not bm.can_allocate([], len(ids)):
                if batch:
                    break
                raise LlmoptError(f"the KV pool ({bm.num_blocks} blocks) cannot hold {len(ids)} tokens")
            bm.allocate(seq, [], len(ids))
            batch.append((i, seq))
            total += len(ids)
            i += 1
        try:
            inp = engine.runner.prepare([(seq, seq.num_tokens) for _, seq in batch])
            hidden = engine.runner.forward(inp)
            start = 0
            for idx, seq in (batch[j] for j in inp.order):  # in row order
                n = seq.num_tokens
                yield idx, hidden[start:start + n]
                start += n
        finally:
            for _, seq in batch:
                bm.free(seq)


def token_logprobs(engine: LLMEngine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Log-probability of each token given its prefix: [len - 1] per sequence (the first has no context)."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for idx, logits in iter_logits(engine, sequences):
        ids = torch.tensor(sequences[idx][1:], device=logits.device)
        lp = torch.log_softmax(logits[:-1], dim=-1)
        out[idx] = lp.gather(1, ids.unsqueeze(1)).squeeze(1).cpu()
    return out  # type: ignore[return-value]
