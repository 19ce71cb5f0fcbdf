"""Gemma 3 (text, `Gemma3ForCausalLM`): llama's attention and MLP with (1 + w) norms, four norms per
layer (the post norms act on the branch output), per-head q/k norms, GeGLU, an embedding scaled by
sqrt(hidden), sliding layers with their own RoPE base, and optional final-logit soft-capping.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers.activation import gelu_tanh_and_mul, silu_and_mul
from llmopt.layers.norm import OffsetRMSNorm
from llmopt.layers.rotary import OnTheFlyRotary
from llmopt.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, input_norm
from llmopt.models.spec import ModelSpec

_ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh_and_mul, "silu": silu_and_mul}


class Gemma3Rotary(nn.Module):
    """RoPE for both layer types: `forward` returns ((cos, sin) of full layers, (cos, sin) of sliding
    layers), each computed once per step; a layer picks its pair by `rope_index`."""

    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        self.full = OnTheFlyRotary(spec.head_dim, spec.rope_theta, spec.rope_scaling, device=device)
        local = spec.rope_local_theta
        self.local = None if local is None else OnTheFlyRotary(spec.head_dim, local, None, device=device)

    def forward(self, positions: torch.Tensor):
        full = self.full(positions)
        return full, (full if self.local is None else self.local(positions))


class Gemma3Attention(LlamaAttention):
    """Llama's attention with (1 + w) q/k norms (the scale is the spec's query_pre_attn_scalar**-0.5)."""

    norm_class = OffsetRMSNorm


class Gemma3DecoderLayer(nn.Module):
    decode_lowering = "gemma3"  # how llmopt.step lowers it (read off this class only, not subclasses)

    def __init__(self, spec: ModelSpec, layer_idx: int, dtype, device):
        super().__init__()
        self.self_attn = Gemma3Attention(spec, layer_idx, dtype, device)
        self.mlp = LlamaMLP(spec, dtype, device, act=_ACTIVATIONS[spec.hidden_activation])
        eps, h = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        sliding = bool(spec.layer_types) and spec.layer_types[layer_idx] == "sliding_attention"
        self.rope_index = 1 if sliding else 0  # which pair of `Gemma3Rotary`'s output

    def forward(self, rope, hidden, residual, cache, meta):
        """Returns (branch output, residual): the caller's next norm adds them (as llama's layers do)."""
        ops = meta.ops
        hidden, residual = input_norm(self.input_layernorm, hidden, residual, ops)
        hidden = self.self_attn(rope[self.rope_index], hidden, cache, meta)
        hidden = self.post_attention_layernorm(hidden, ops=ops)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual, ops=ops)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden, ops=ops), ops=ops)
        return hidden, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    norm_class = OffsetRMSNorm
    # the MLP's input comes from pre_feedforward_layernorm (post_attention_layernorm feeds the residual)
    quant_producers = {
        "self_attn.qkv_proj": ("input_layernorm", None),
        "mlp.gate_up_proj": ("pre_feedforward_layernorm", None),
        "mlp.down_proj": ("mlp.gate_up_proj", "up_proj"),
    }

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__(spec, dtype, device)
        # sqrt(hidden) in the weight dtype (bf16 rounds sqrt(640)=25.298 to 25.25), as transformers does
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5, device="cpu").to(dtype))

    def build_rotary(self, device) -> nn.Module:
        return Gemma3Rotary(self.spec, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
