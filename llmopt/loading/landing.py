"""How a module lands in memory: a quantized linear as its runtime module, a float one packed for the CPU
kernels, one module at a time so the plain copy is freed before the next is read."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers.packed_linear import pack_linears
from llmopt.loading.formats import LinearPart
from llmopt.quant.dequantized import DequantizedLinear
from llmopt.quant.dynamic_int8 import Int8DynamicActivationLinear
from llmopt.quant.linear import quantized_linear
from llmopt.quant.packed_int8 import pack_int8_linears
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.rows import ConcatLinear, can_concat, concat_rows


def _runtime(qw: QuantizedWeight, bias: torch.Tensor | None, int8_act: bool, dtype: torch.dtype,
             device: torch.device) -> nn.Module:
    if int8_act:
        return Int8DynamicActivationLinear.from_quantized(qw, bias, dtype, device)
    if dtype == torch.float32 and device.type == "cpu":
        return DequantizedLinear(qw, bias, device)  # see dequantized.py: fp32 CPU kernels are far slower
    return quantized_linear(qw, bias, dtype, device)


def land_linear(parts: list[LinearPart], dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """The runtime module for one of our linears from its checkpoint parts (the q|k|v or gate|up of a fused
    projection, concatenated by rows when their schemes allow, else side by side in a ConcatLinear). None:
    every part is float, and the float fill loads it as a plain parameter."""
    if all(p.qw is None for p in parts):
        return None
    qws = [p.qw for p in parts]
    biases = [p.bias for p in parts]
    same_act = len({p.int8_activations for p in parts}) == 1
    if all(q is not None for q in qws) and same_act and can_concat(qws):  # type: ignore[arg-type]
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return _runtime(concat_rows(qws), bias, parts[0].int8_activations, dtype, device)  # type: ignore[arg-type]
    mods: list[nn.Module] = []
    for p in parts:
        if p.qw is not None:
            mods.append(_runtime(p.qw, p.bias, p.int8_activations, dtype, device))
        else:
            assert p.weight is not None
            lin = nn.Linear(p.weight.shape[1], p.weight.shape[0], bias=p.bias is not None, dtype=dtype, device=device)
            with torch.no_grad():
                lin.weight.copy_(p.weight)
                if p.bias is not None:
                    lin.bias.copy_(p.bias)
            mods.append(lin)
    return ConcatLinear(mods)


def pack_module(model: nn.Module, prefix: str) -> None:
    """Pack the bf16/fp16 linears and W8A16 int8 ones of the filled module `prefix` for our CPU kernels (no-ops
    elsewhere)."""
    pack_linears(model, prefix)
    pack_int8_linears(model, prefix)
