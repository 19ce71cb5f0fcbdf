"""A projection as our CPU matmul kernels (`bf16_linear.c`) take it: what the decode step's program and the
native MoE block (`moe_native.py`) read off a module. Each module class that runs on one of the kernels says
so with a `kernel_linear()` method of its own (PackedLinear, PackedInt8Linear, Int4WeightOnlyLinear), so
callers need not know the quantized classes, which live above this package."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STORAGE = {"bf16": 0, "int8": 1, "int4": 2}  # the kernels' storage codes (decode_step.c, moe_block.c)


@dataclass
class KernelLinear:
    """One projection as the kernels take it."""

    storage: str  # bf16 | int8 | int4
    packed: torch.Tensor
    in_features: int
    out_features: int
    scale: torch.Tensor | None = None  # int8: per output; int4: per group and output
    bias: torch.Tensor | None = None
    group: int = 0  # int4
    perm: torch.Tensor | None = None  # int4 act-order: x's columns in the kernel's order (int32)
    amx_min_rows: int = -1  # rows from which the AMX kernel runs the call (-1: never)

    @property
    def code(self) -> int:
        return STORAGE[self.storage]


def kernel_linear(mod: nn.Module) -> KernelLinear | str:
    """`mod`'s kernel inputs, or why it has none: a method of its own class only (a subclass may change what
    `forward` does, so it inherits none), no hooks, and the method's own verdict (None: not on a kernel here)."""
    if mod._forward_hooks or mod._forward_pre_hooks:
        return "a projection has hooks"
    fn = type(mod).__dict__.get("kernel_linear")
    k = fn(mod) if fn is not None else None
    return k if k is not None else f"{type(mod).__name__} has no decode-step kernel"
