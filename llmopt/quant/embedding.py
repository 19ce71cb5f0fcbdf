"""An embedding table stored as symmetric integer codes (`quantize --lm-head int8|int4`): int8 with one scale
per row, or int4 with one scale per group of 32 columns, two codes per byte.

Why: in small models the vocabulary matrix is most of the weights (21% of SmolLM2-135M, 62.6% of Gemma-3-270M)
and a tied one is also the output head, which every decoded token reads whole. The head side runs as a
weight-only linear (our int8 / int4 VNNI kernels on AVX512-BF16 or AVX2 CPUs), built from the same QuantizedWeight by
the loader; this module is the lookup side: each token's row is read as codes and scaled, in float32, as a
dequantizing reader (transformers, compressed-tensors) computes it, then cast to the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over symmetric int8 codes [vocab, hidden] with per-row scales [vocab, 1], or int4 codes
    packed two per byte [vocab, hidden / 2] with per-group scales [vocab, hidden / group]."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        s = qw.scheme
        int8_rows = s.bits == 8 and qw.n_groups == 1
        int4_groups = s.bits == 4 and qw.in_features % 2 == 0
        if s.kind != "int" or not s.symmetric or not (int8_rows or int4_groups) or qw.is_act_order:
            raise LlmoptError("a quantized embedding must be symmetric int8 with one scale per row, or int4 in "
                              f"contiguous groups (got {s.describe()})")
        self.num_embeddings, self.embedding_dim = qw.out_features, qw.in_features
        self.dtype, self.bits, self.group = dtype, s.bits, qw.group_size
        codes = (qw.q.to(torch.int16) - s.sym_zero).to(torch.int8)  # [-8, 7] or [-128, 127]
        if self.bits == 4:  # low nibble: even column
            nib = (codes & 0xF).to(torch.uint8)
            codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scales", qw.scale.float().to(device))

    @property
    def weight_nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def _rows(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Rows' codes and scales -> float32 rows [..., hidden]."""
        if self.bits == 4:
            lo = (codes & 0xF).to(torch.int8)
            hi = (codes >> 4).to(torch.int8)
            codes = torch.stack((lo, hi), dim=-1).flatten(-2)
            codes = torch.where(codes > 7, codes - 16, codes)
        per_col = scales.repeat_interleave(self.group, dim=-1)
        return codes.float() * per_col

    def dequantize(self) -> torch.Tensor:
        """The float32 table [vocab, hidden] the lookups read."""
        return self._rows(self.codes, self.scales)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(self.codes[input_ids], self.scales[input_ids]).to(self.dtype)

    def extra_repr(self) -> str:
        how = "int8 codes, a scale per row" if self.bits == 8 else f"int4 codes, a scale per {self.group} columns"
        return f"{self.num_embeddings}, {self.embedding_dim}, {how}"
