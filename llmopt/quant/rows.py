"""Fused weights ↔ Hugging Face parts, by output rows.

Rows of a linear are independent under every scheme here (scales and zeros are per output row, and
GPTQ rows that share an input share its Hessian), so quantizing our fused q|k|v or gate|up weight
equals quantizing the parts separately: export slices rows into HF names, loading concatenates them
back. `ConcatLinear` is the runtime fallback for parts that cannot be merged into one weight
(different schemes, or act-order checkpoints whose parts have different g_idx).
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import QuantizedWeight


def slice_rows(qw: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Output rows [lo, hi) of `qw` (shares g_idx and scheme)."""
    return QuantizedWeight(
        q=qw.q[lo:hi].contiguous(),
        scale=qw.scale[lo:hi].contiguous(),
        zero=None if qw.zero is None else qw.zero[lo:hi].contiguous(),
        g_idx=qw.g_idx.clone(),
        scheme=qw.scheme,
    )


def can_concat(parts: list[QuantizedWeight]) -> bool:
    """Same scheme, same input width and same g_idx: then stacking rows is exact."""
    first = parts[0]
    return all(p.scheme == first.scheme and p.in_features == first.in_features
               and torch.equal(p.g_idx, first.g_idx) for p in parts[1:])


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack the rows of `parts` (checked with `can_concat`)."""
    if not parts or not can_concat(parts):
        raise LlmoptError("cannot fuse quantized parts with different schemes, widths or g_idx")
    zeros = [p.zero for p in parts]
    return QuantizedWeight(
        q=torch.cat([p.q for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        zero=None if zeros[0] is None else torch.cat(zeros),  # type: ignore[arg-type]
        g_idx=parts[0].g_idx.clone(),
        scheme=parts[0].scheme,
    )


class ConcatLinear(nn.Module):
    """Runs several linears on the same input and concatenates their outputs (a fused projection
    whose parts could not be merged into one quantized weight)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        widths = {p.in_features for p in parts}
        if len(widths) != 1:
            raise LlmoptError(f"fused parts take different input widths: {sorted(widths)}")
        self.parts = nn.ModuleList(parts)
        self.in_features = widths.pop()
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() if hasattr(p, "dequantize") else p.weight.float() for p in self.parts])
