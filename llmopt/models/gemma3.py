"""Gemma 3 (text): `Gemma3ForCausalLM`, model_type gemma3_text, registered in `llmopt.models.registry`.

Where it differs from the llama family, all from `ModelSpec` data:
* (1 + w) RMSNorm everywhere (`OffsetRMSNorm`), and four norms per layer: input and post-attention
  around attention, pre- and post-feedforward around the MLP (the post norms act on the branch output,
  before the residual add);
* q/k norm per head, attention scale `query_pre_attn_scalar**-0.5`;
* GELU-tanh GeGLU MLP;
* the embedding is multiplied by sqrt(hidden), rounded to the weight dtype as transformers does;
* sliding-window attention on the `layer_types` "sliding_attention" layers, which also use their own
  RoPE base (`rope_local_theta`); full layers use `rope_theta` (+ linear scaling, Gemma-3-27B);
* optional final-logit soft-capping (Gemma 3 sets none; attention soft-capping is rejected in the spec).

Projections are fused (qkv, gate_up) like llama's, so the quantization and checkpoint code is shared.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers.activation import gelu_tanh_and_mul, silu_and_mul
from llmopt.layers.norm import OffsetRMSNorm
from llmopt.layers.rotary import OnTheFlyRotary
from llmopt.models.base import FUSED_LINEARS, FUSED_QKV_GATE_UP, CausalLM
from llmopt.models.llama import LlamaAttention, LlamaMLP, input_norm
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
    """Llama's attention with (1 + w) q/k norms (the spec always sets qk_norm for Gemma 3) and the
    spec's query_pre_attn_scalar scale."""

    norm_class = OffsetRMSNorm


class Gemma3DecoderLayer(nn.Module):
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


class Gemma3ForCausalLM(CausalLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP
    quantizable_linears = FUSED_LINEARS
    # the MLP's input comes from pre_feedforward_layernorm (post_attention_layernorm feeds the residual)
    quant_producers = {
        "self_attn.qkv_proj": ("input_layernorm", None),
        "mlp.gate_up_proj": ("pre_feedforward_layernorm", None),
        "mlp.down_proj": ("mlp.gate_up_proj", "up_proj"),
    }

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        # sqrt(hidden) in the weight dtype (bf16 rounds sqrt(640)=25.298 to 25.25), as transformers does
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5, device="cpu").to(dtype))
        self.rotary = self.build_rotary(device)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = OffsetRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def build_rotary(self, device) -> nn.Module:
        return Gemma3Rotary(self.spec, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
