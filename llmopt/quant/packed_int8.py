"""W8A16 linears repacked once for an engine on a CPU with AVX512-BF16 or AVX2: the int8 weight in VNNI pairs, run
by the same kernel as the bf16 linears (`llmopt/layers/bf16_linear.c`).

Why: `int8_linear.c` reads `Int8WeightOnlyLinear`'s row-major weight, where each output ends in a horizontal
sum; in VNNI pairs no output needs one, and a panel is converted to bf16 once per pass instead of once per
4 rows. Per call over SmolLM2's int8 linears it is 1.2-1.8x faster at 1-256 rows (docs/BENCHMARKS.md,
"int8 weights in VNNI pairs"). The packed weight is the module's only copy, as `PackedLinear`'s is;
`state_dict()` writes the int8 weight and scales back as `Int8WeightOnlyLinear` holds them. Products
and sums are those of the int8 kernel: exact bf16 products, float32 sums, scaled and rounded once.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers.kernel_linear import KernelLinear
from llmopt.layers.linear import set_submodule
from llmopt.layers.packed_linear import Bf16LinearKernel, pack_vnni, unpack_vnni, vnni_kernel
from llmopt.quant.linear import Int8WeightOnlyLinear


class PackedInt8Linear(nn.Module):
    """An `Int8WeightOnlyLinear` (per-channel, no zero point, bf16) with its weight in VNNI pairs."""

    compute_dtype = torch.bfloat16

    def __init__(self, mod: Int8WeightOnlyLinear, kernel: Bf16LinearKernel):
        super().__init__()
        self.in_features, self.out_features = mod.in_features, mod.out_features
        self.packed = pack_vnni(mod.weight)
        self.scales = mod.scales.to(torch.bfloat16).contiguous()
        self.bias = None if mod.bias is None else mod.bias.to(torch.bfloat16).contiguous()
        self.kernel = kernel

    @staticmethod
    def takes(mod: nn.Module) -> bool:
        """Whether `mod` is an int8 linear this module can stand in for (see the module doc)."""
        return (type(mod) is Int8WeightOnlyLinear and mod.native_kernel and mod.mode == "cpu-int8"
                and mod.compute_dtype == torch.bfloat16 and mod.zero_corr is None and mod.in_features % 2 == 0
                and not mod._forward_hooks and not mod._forward_pre_hooks)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight [out, in], unpacked (slow, for inspection)."""
        return unpack_vnni(self.packed, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] this module multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = self.kernel(x2, self.packed, self.bias, self.out_features, self.scales)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def kernel_linear(self) -> KernelLinear:
        return KernelLinear("int8", self.packed, self.in_features, self.out_features, scale=self.scales,
                            bias=self.bias, amx_min_rows=self.kernel.amx_from_rows(self.in_features, torch.int8))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        destination[prefix + "scales"] = self.scales
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights in vnni pairs"


def pack_int8_linears(model: nn.Module, under: str | None = None) -> int:
    """Swap every `Int8WeightOnlyLinear` of `model` (or of its module `under`) that `PackedInt8Linear` takes,
    where the kernel runs here; returns how many."""
    kernel = vnni_kernel()
    if kernel is None:
        return 0
    swaps = [name for name, mod in model.named_modules() if PackedInt8Linear.takes(mod)
             and (under is None or name == under or name.startswith(under + "."))]
    for name in swaps:  # by name, so each int8 weight is freed once its packed copy is in
        set_submodule(model, name, PackedInt8Linear(model.get_submodule(name), kernel))  # keeps output_splits
    return len(swaps)
