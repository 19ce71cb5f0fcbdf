"""QuantScheme: what a weight is quantized to (bits, grouping, symmetry, int or fp8).

One scheme describes one tensor-level recipe; the algorithms (RTN, GPTQ, AWQ), the checkpoint
formats and the runtime modules all read it, so their conventions cannot drift apart.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from llmopt.group_size import check_group_size

_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class QuantScheme(BaseModel):
    """A weight quantization recipe.

    `group_size=-1` means one scale per output channel. `scale_dtype` is the precision scales are
    rounded to *while quantizing*, so that the dtype a checkpoint stores them in (fp16 for GPTQ)
    loses nothing and every reader dequantizes bit-for-bit what the algorithm optimized.
    """

    model_config = ConfigDict(frozen=True)

    bits: Literal[4, 8] = 4
    group_size: int = 128
    symmetric: bool = True
    kind: Literal["int", "fp8"] = "int"
    scale_dtype: Literal["float32", "float16", "bfloat16"] = "float16"

    @model_validator(mode="after")
    def _check(self) -> QuantScheme:
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")
        if self.kind == "fp8" and (self.bits != 8 or self.group_size != -1 or not self.symmetric):
            raise ValueError("fp8 weights are 8-bit, symmetric and per output channel (group_size=-1)")
        return self

    @property
    def maxq(self) -> int:
        """Largest unsigned integer code (codes are in [0, maxq])."""
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        """The fixed zero point of symmetric int schemes: 2^(bits-1) (8 for int4, 128 for int8)."""
        return 1 << (self.bits - 1)

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @property
    def per_channel(self) -> bool:
        return self.group_size == -1

    def effective_group_size(self, in_features: int) -> int:
        """Columns per group for a weight with `in_features` inputs (validated)."""
        self.check_in_features(in_features)
        return in_features if self.group_size == -1 else self.group_size

    def n_groups(self, in_features: int) -> int:
        return in_features // self.effective_group_size(in_features)

    def check_in_features(self, in_features: int, name: str | None = None) -> None:
        """Raise a one-line LlmoptError when the group size is not valid for `in_features` (the rule
        and its reasons: `llmopt.group_size`)."""
        check_group_size({name or "this weight": in_features}, self.group_size)

    def describe(self) -> str:
        """Short human label, e.g. `int4 g128 sym` or `fp8 channel`."""
        if self.kind == "fp8":
            return "fp8 channel"
        grouping = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"int{self.bits} {grouping} {'sym' if self.symmetric else 'asym'}"
