"""A request as the engine tracks it (its n sequences, deadline, prompt logprobs), and the checks that
refuse a request the engine could never serve."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.engine.detokenizer import init_offsets
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence
from llmopt.engine.structured_output import GrammarError, StructuredOutputCompiler
from llmopt.errors import LlmoptError


class RequestError(LlmoptError):
    """A request the engine can never serve (too long, bad parameters). Servers answer 400."""


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    deadline: float | None = None
    finished: bool = False
    prompt_logprobs: list | None = None  # params.prompt_logprobs: one entry per prompt token, the first None

    @property
    def scheduled(self) -> bool:
        """Every sequence has been admitted by the scheduler at least once."""
        return all(seq.metrics.first_scheduled_time is not None for seq in self.seqs)


def check_request(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, pool: str,
                  structured_outputs: StructuredOutputCompiler) -> None:
    """Raise RequestError for what could never run: empty or too-long prompts, out-of-vocabulary ids,
    a grammar that does not compile. `pool` describes the KV pool for the too-long message."""
    if not ids:
        raise RequestError("the prompt is empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, but this engine serves at most "
                           f"{max_model_len} tokens per sequence (max_model_len, {pool})")
    if params.structured_outputs is not None:
        try:
            structured_outputs.compile(params.structured_outputs)
        except GrammarError as e:
            raise RequestError(f"structured_outputs: {e}") from None


def make_sequences(request_id: str, ids: list[int], params: SamplingParams, arrival: float, priority: int,
                   eos_token_ids: list[int], structured_outputs: StructuredOutputCompiler,
                   device: torch.device) -> list[Sequence]:
    """The request's n sequences, each with its own grammar matcher and seeded generator."""
    seqs = []
    for i in range(params.n):
        seq = Sequence(request_id, i, ids, params, arrival, priority, tuple(eos_token_ids))
        if params.structured_outputs is not None:
            seq.grammar = structured_outputs.matcher(params.structured_outputs)
        if params.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(params.seed + i)
        init_offsets(seq)
        seqs.append(seq)
    return seqs
