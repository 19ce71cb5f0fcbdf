"""The one Linear interface: any module with `in_features`, `out_features` and `forward` stands in for a
projection, so quantized modules are plain module swaps and model code never changes. A fused projection
(qkv, gate|up) records its parts' row ranges (`output_splits`) for loaders and quantizers."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """An nn.Linear whose rows are several checkpoint projections stacked (e.g. q|k|v)."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, sum(output_sizes.values()), bias=bias, dtype=dtype, device=device)
        ends = itertools.accumulate(output_sizes.values())  # each part's rows end where the next begin
        self.output_splits = {n: (e - s, e) for (n, s), e in zip(output_sizes.items(), ends, strict=True)}


def output_splits(module: nn.Module) -> dict[str, tuple[int, int]] | None:
    """Row ranges of the fused parts of a projection, or None when it is not fused."""
    return getattr(module, "output_splits", None)


def iter_linears(model: nn.Module):
    """Yield (qualified name, module) for every projection that quantization may swap."""
    for name, mod in model.named_modules():
        if hasattr(mod, "in_features") and hasattr(mod, "out_features") and name:
            yield name, mod


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace `model.<name>` with `new`, keeping fused-split metadata."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    if output_splits(old) is not None and output_splits(new) is None:
        new.output_splits = output_splits(old)
    setattr(parent, child, new)
