"""ModelInput: what one forward pass consumes, read by name by the step, the draft proposers and scoring."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.engine.sequence import Sequence
from llmopt.layers.attention import AttentionMetadata


@dataclass
class ModelInput:
    """Flat tensors over the batch: prefill chunks first, then single-token decodes."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata  # slot mapping, prefill chunks, decode groups
    logits_indices: list[int]  # rows whose logits are sampled (or argmaxed by a draft)
    sample_seqs: list[Sequence] = field(default_factory=list)  # the sequence of each sampled row
    # speculating sequences: the rows of the last real token and of each draft token they verify
    spec_rows: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # (sequence, first row, first position, count): rows whose logits score the next prompt token
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # the scheduled index of each run of rows, in row order
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The KV-cache slot each token's K/V is written to."""
        return self.attn_metadata.slot_mapping
