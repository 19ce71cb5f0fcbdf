"""The head-major backend's per-step metadata: prefill chunks, decode groups, and sliding-window masks (a
query sees the last `window` positions, itself included: transformers' `kv > q - window`), derived from
the causal ones on first use and cached for the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.layers.attention.backend import AttentionMetadata


@dataclass
class PrefillChunk:
    q_len: int
    ctx_len: int  # cached prefix + this chunk
    blocks: list[torch.Tensor]  # per KV group: [1, n] the context's blocks (empty: the chunk's own K/V is read)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when the chunk is the whole context


@dataclass
class DecodeGroup:
    """Decode sequences of similar context length, attended together (padding only to the group's max)."""

    size: int  # sequences (consecutive decode rows)
    blocks: list[torch.Tensor]  # per KV group: [size, max_blocks] block tables (padding -> block 0)
    mask: torch.Tensor  # [1, size, 1, max_blocks * block_size] bool, True = attend
    # per KV group: the first block its `blocks` hold (a sliding group skips what left every window)
    starts: list[int] = field(default_factory=list)
    lens: torch.Tensor | None = None  # [size] int64 context lengths (the paged decode kernel's input)


@dataclass
class HeadMajorMetadata(AttentionMetadata):
    slot_mappings: list[torch.Tensor] = field(default_factory=list)  # per KV group ([0] is slot_mapping)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the decode rows, in order
    window_masks: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # see window_*_mask

    def window_prefill_mask(self, index: int, window: int) -> torch.Tensor | None:
        """[q_len, ctx_len] bool mask of prefill chunk `index` for a `window`-token sliding window; the
        chunk's causal mask (None: plain causal) when no query reaches past the window."""
        chunk = self.prefills[index]
        if chunk.ctx_len <= window:
            return chunk.mask
        key = ("prefill", index, window)
        if key not in self.window_masks:
            dev = self.slot_mapping.device
            q_pos = torch.arange(chunk.ctx_len - chunk.q_len, chunk.ctx_len, device=dev).unsqueeze(1)
            k_pos = torch.arange(chunk.ctx_len, device=dev).unsqueeze(0)
            self.window_masks[key] = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return self.window_masks[key]

    def window_decode_mask(self, index: int, window: int) -> torch.Tensor:
        """Decode group `index`'s mask restricted to each sequence's last `window` positions."""
        key = ("decode", index, window)
        if key not in self.window_masks:
            mask = self.decode_groups[index].mask  # [1, B, 1, C]: True for positions < context length
            lens = mask.sum(dim=-1, keepdim=True)
            pos = torch.arange(mask.shape[-1], device=mask.device)
            self.window_masks[key] = mask & (pos >= lens - window)
        return self.window_masks[key]
