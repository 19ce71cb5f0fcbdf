"""Sequence: one stream of tokens being generated, with its KV block table and bookkeeping."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from llmopt.engine.outputs import RequestMetrics
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.spec_decode.state import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_counter = itertools.count()


@dataclass(slots=True, eq=False)
class BlockTable:
    """A sequence's blocks in one KV group (see block_manager.py): the table, how many leading entries
    are in the prefix cache, and how many were given back after leaving a sliding window."""

    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0
    num_released: int = 0


class Sequence:
    """Tokens = prompt + generated. `num_computed_tokens` of them have their K/V in the cache."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, priority: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # one BlockTable per KV group: group 0 (full attention, or every layer), then any sliding groups
        self.kv_tables: list[BlockTable] = [BlockTable()]
        self.block_hashes: list[int] = []  # chained hashes of full blocks, computed lazily
        self.status = SequenceStatus.WAITING
        self.params = params
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        self.grammar = None  # structured outputs: this sequence's GrammarMatcher, advanced as tokens append
        self.spec = SpecState()  # speculative decoding: this step's drafts, the request's acceptance
        self.output_text = ""  # incremental detokenization state (detokenizer.py), and what was streamed
        self.prefix_offset = self.read_offset = self.sent_text_len = 0

    def kv_table(self, group: int) -> BlockTable:
        while len(self.kv_tables) <= group:
            self.kv_tables.append(BlockTable())
        return self.kv_tables[group]

    @property
    def block_table(self) -> list[int]:
        """KV group 0's blocks (the only group of most models)."""
        return self.kv_tables[0].blocks

    @property
    def block_tables(self) -> list[list[int]]:
        """Every KV group's blocks, group 0 first: what attention metadata is built from."""
        return [t.blocks for t in self.kv_tables]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def stop_ids_for_min_tokens(self) -> tuple[int, ...]:
        """Token ids that must not be sampled before `min_tokens` outputs exist."""
        return tuple(self.eos_token_ids) + tuple(self.params.stop_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")
