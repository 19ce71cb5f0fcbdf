"""An embedding table stored as int8 codes with one scale per row (`quantize --lm-head int8`).

Why: in small models the vocabulary matrix is most of the weights (21% of SmolLM2-135M, 62.6% of Gemma-3-270M)
and a tied one is also the output head, which every decoded token reads whole. The head side runs as an int8
weight-only linear (our int8 VNNI kernel on AVX512-BF16 CPUs), built from the same QuantizedWeight by the
loader; this module is the lookup side: each token's row is read as int8 and scaled, in float32, as a
dequantizing reader (transformers, compressed-tensors) computes it, then cast to the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over symmetric int8 codes [vocab, hidden] and per-row scales [vocab]."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        s = qw.scheme
        if s.kind != "int" or s.bits != 8 or not s.symmetric or qw.n_groups != 1:
            raise LlmoptError(f"a quantized embedding must be int8, symmetric, one scale per row (got {s.describe()})")
        self.num_embeddings, self.embedding_dim = qw.out_features, qw.in_features
        self.dtype = dtype
        self.register_buffer("codes", (qw.q.to(torch.int16) - s.sym_zero).to(torch.int8).to(device))
        self.register_buffer("scales", qw.scale.float().reshape(-1).to(device))

    @property
    def weight_nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """The float32 table [vocab, hidden] the lookups read."""
        return self.codes.float() * self.scales[:, None]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.codes[input_ids].float() * self.scales[input_ids].unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 codes, a scale per row"
