"""Our llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 dense). The family's differences
are `ModelSpec` data: q/k/v bias (Qwen2), per-head q/k norms (Qwen3), head_dim, sliding windows (Mistral).

Projections are fused (qkv, gate_up) and each is a swappable Linear (`llmopt.layers.linear`), so
quantized modules drop in without touching this file.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.layers import kernels
from llmopt.layers.activation import silu_and_mul
from llmopt.layers.attention import AttentionMetadata, PagedAttention
from llmopt.layers.kernels import Ops
from llmopt.layers.linear import FusedLinear
from llmopt.layers.norm import RMSNorm
from llmopt.layers.rotary import apply_rotary
from llmopt.models.base import FUSED_LINEARS, FUSED_QKV_GATE_UP, CausalLM
from llmopt.models.spec import ModelSpec


def input_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, ops: Ops):
    """A decoder layer's first norm: the first layer starts the residual stream with its input, the
    others add the previous layer's branch output into it (one fused add + norm). Returns (normed, residual)."""
    if residual is None:
        return norm(hidden, ops=ops), hidden
    return norm(hidden, residual, ops=ops)


class LlamaAttention(nn.Module):
    norm_class: type[nn.Module] = RMSNorm  # of the q/k norms (Gemma 3: the (1+w) OffsetRMSNorm)

    def __init__(self, spec: ModelSpec, layer_idx: int, dtype, device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        sizes = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        self.qkv_proj = FusedLinear(spec.hidden_size, sizes, bias=spec.attention_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False, dtype=dtype, device=device)
        if spec.qk_norm:
            self.q_norm = self.norm_class(self.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = self.norm_class(self.head_dim, spec.rms_norm_eps, dtype, device)
        self.qk_norm = spec.qk_norm
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                                   window=spec.attention_window(layer_idx), scale=spec.attention_scale)

    def forward(self, rope, hidden, cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        t = hidden.shape[0]
        # q and k heads are adjacent in the fused output: rotate them in one go
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            # per head as [rows, head_dim] (a view for one token), so the native norm takes it
            q, k = (x.reshape(-1, self.head_dim) for x in qk.split([self.num_heads, self.num_kv_heads], dim=1))
            qk = torch.cat([self.q_norm(q, ops=meta.ops).view(t, self.num_heads, self.head_dim),
                            self.k_norm(k, ops=meta.ops).view(t, self.num_kv_heads, self.head_dim)], dim=1)
        qk = kernels.call(meta.ops, apply_rotary, qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, cache, meta))


class LlamaMLP(nn.Module):
    """Gated MLP: act(gate) * up, then down. `act` is SiLU for llama, GELU-tanh for Gemma 3's GeGLU."""

    decode_lowering = "gated_mlp"  # how llmopt.step lowers it (read off this class only, not subclasses)

    def __init__(self, spec: ModelSpec, dtype, device, act=silu_and_mul):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.intermediate_size, self.act = i, act
        self.gate_up_proj = FusedLinear(h, {"gate_proj": i, "up_proj": i}, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype, device=device)

    def forward(self, x, ops: Ops = Ops.EAGER):
        return self.down_proj(kernels.call(ops, self.act, self.gate_up_proj(x), self.intermediate_size))


class LlamaDecoderLayer(nn.Module):
    decode_lowering = "llama"  # how llmopt.step lowers it (read off this class only, not subclasses)

    def __init__(self, spec: ModelSpec, layer_idx: int, dtype, device):
        super().__init__()
        self.self_attn = LlamaAttention(spec, layer_idx, dtype, device)
        self.mlp = self.make_mlp(spec, layer_idx, dtype, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def make_mlp(self, spec: ModelSpec, layer_idx: int, dtype, device) -> nn.Module:
        """The layer's MLP (`mlp(x, ops=...)`); MoE families return their sparse block here."""
        return LlamaMLP(spec, dtype, device)

    def forward(self, rope, hidden, residual, cache, meta):
        """`rope` is the (cos, sin) pair for this step's positions, see `CausalLM.build_rotary`."""
        ops = meta.ops
        hidden, residual = input_norm(self.input_layernorm, hidden, residual, ops)
        hidden = self.self_attn(rope, hidden, cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, ops=ops)
        return self.mlp(hidden, ops=ops), residual


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP
    quantizable_linears = FUSED_LINEARS
    quant_producers = {
        "self_attn.qkv_proj": ("input_layernorm", None),
        "mlp.gate_up_proj": ("post_attention_layernorm", None),
        "mlp.down_proj": ("mlp.gate_up_proj", "up_proj"),
    }
    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    norm_class: type[nn.Module] = RMSNorm  # of the final norm (Gemma 3: OffsetRMSNorm)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.rotary = self.build_rotary(device)
        self.layers = nn.ModuleList(self.decoder_layer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
