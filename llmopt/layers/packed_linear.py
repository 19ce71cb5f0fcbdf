"""Dense bf16/fp16 projections with their weight packed once for oneDNN, for engines on a CPU.

Why: torch's CPU `F.linear` in bf16 hands oneDNN a plain row-major weight on every call, and at decode
sizes (a few rows of activations) that matmul streams the weight at about two thirds of the speed of
the same oneDNN matmul over a weight reordered once into its blocked layout. Decode reads every weight
per token, so that is the decode speed. vLLM's CPU backend packs its linears the same way.

In bf16 it is the same kernel: outputs are bitwise equal to `F.linear` on decode-size batches and
within bf16 rounding on big ones (fp16: within fp16 rounding). fp32 is never packed, so greedy fp32
output stays token-identical to transformers. A tied lm_head gets a packed copy and the embedding keeps
the plain weight for its lookups, as vLLM does (one more vocab x hidden matrix in memory).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmopt.layers.linear import FusedLinear, set_submodule
from llmopt.layers.moe import SparseMoeBlock

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack_linears` will pack weights of `dtype` on `device` in this torch build."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout. The packed weight is the module's
    only copy: `weight` unpacks it (slow, for inspection) and `state_dict()` writes it unpacked."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        # the batch size is a hint for the layout; decode batches are the ones the layout is for
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pack_linears(model: nn.Module) -> int:
    """Swap every plain dense Linear of `model` (bf16/fp16, on a CPU) for a PackedLinear; returns how
    many. Quantized modules keep their own kernels, MoE experts keep theirs (the grouped path stacks
    the plain weights), and so does a linear with hooks on it."""
    experts = [name for name, mod in model.named_modules() if isinstance(mod, SparseMoeBlock)]
    swaps = [(name, mod) for name, mod in model.named_modules()
             if type(mod) in (nn.Linear, FusedLinear) and not mod._forward_hooks and not mod._forward_pre_hooks
             and not mod.weight.is_meta and packing_supported(mod.weight.dtype, mod.weight.device)
             and not any(name.startswith(p + ".") for p in experts)]
    for i, (name, mod) in enumerate(swaps):
        try:
            packed = PackedLinear(mod)
        except RuntimeError as e:  # a torch build whose oneDNN lacks the reorder for this dtype
            log.warning("weights stay unpacked (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return i
        set_submodule(model, name, packed)  # keeps a fused projection's output_splits
    return len(swaps)
