"""DequantizedLinear: a quantized weight materialized as (q − zero)·scale in float32.

Used when a quantized checkpoint runs with float32 activations on CPU, e.g. for quality measurements
in fp32: torch's CPU int4/int8 weight-only kernels are 10–60x slower than a dense fp32 matmul with
fp32 activations at prefill sizes (measured at M=512: int4 2.7 s vs 0.26 s for dequantize+matmul),
so the weights the checkpoint holds are applied exactly, just without the memory saving. bf16/fp16
activations (the default for quantized checkpoints) use the low-bit kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.quant.qtensor import QuantizedWeight


class DequantizedLinear(nn.Module):
    """`F.linear` with the exact float32 value of a QuantizedWeight (and its scheme kept for reports)."""

    mode = "dequantized-fp32"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device | str) -> None:
        super().__init__()
        self.in_features = qw.in_features
        self.out_features = qw.out_features
        self.scheme = qw.scheme
        self.register_buffer("weight", qw.dequantize(torch.float32).to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().float().to(device))

    def dequantize(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.describe()}"
