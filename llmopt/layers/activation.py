"""act(gate) · up over a fused gate|up projection output: SiLU (llama MLP), GELU-tanh (Gemma's GeGLU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmopt.layers import kernels


@kernels.native_below(kernels.NATIVE_PREFILL_ROWS)
@kernels.has_native
def silu_and_mul(x: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    gate, up = x.split(intermediate_size, dim=-1)
    return F.silu(gate) * up


@kernels.native_below(math.inf)
@kernels.has_native
def gelu_tanh_and_mul(x: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    gate, up = x.split(intermediate_size, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
