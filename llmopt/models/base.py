"""`CausalLM`: what every model implementation provides; engine, calibration and quantization code is
typed against it, never a concrete model. A model class declares its checkpoint-name mapping
(`packed_modules_mapping`, nano-vllm style) and what quantization may swap; the loader, the
quantized-checkpoint reader and the exporters all go through `hf_to_ours` / `hf_parts`.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from llmopt.layers.linear import output_splits
from llmopt.models.spec import ModelSpec

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.([A-Za-z_]+)$")

# The decoder layout llama, Qwen, Mistral and Gemma 3 share: q|k|v and gate|up each fused into one linear.
FUSED_QKV_GATE_UP: dict[str, tuple[str, str]] = {
    **{f"self_attn.{p}": ("self_attn.qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")},
    **{f"mlp.{p}": ("mlp.gate_up_proj", p) for p in ("gate_proj", "up_proj")},
}
FUSED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class CausalLM(nn.Module):
    """A decoder-only LM over a flat token batch and the paged KV cache. Each of `layers` is called as
    `layer(rope, hidden, residual, cache, meta) -> (hidden, residual)`."""

    # HF module path inside a decoder layer -> (our fused module, shard name in its output_splits)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {}
    # our per-layer linears that quantization may swap (module paths inside a decoder layer)
    quantizable_linears: ClassVar[tuple[str, ...]] = ()
    # AWQ / SmoothQuant mappings: our linear (inside a layer) -> the module that produces its input and,
    # for a fused producer, the part whose rows produce it (None: a norm, whose weight takes the 1/s)
    quant_producers: ClassVar[dict[str, tuple[str, str | None]]] = {}
    # linears (regexes over module paths inside a decoder layer) that quantization keeps in float:
    # MoE routers, whose few weights decide which experts run
    float_linears: ClassVar[tuple[str, ...]] = ()

    spec: ModelSpec
    embed_tokens: nn.Embedding
    rotary: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. `num_layers`: only the first layers
        (the layer_skip self-draft). Families change `embed`, `build_rotary` and their layers, not this."""
        hidden = self.embed(input_ids)
        rope = self.rotary(positions)
        residual = None
        for layer in self.layers[:num_layers]:
            hidden, residual = layer(rope, hidden, residual, cache, meta)
        hidden, _ = self.norm(hidden, residual, ops=meta.ops)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden state entering layer 0 (Gemma scales it); calibration embeds through this too."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish_logits(self.lm_head(hidden).float())

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the head's float32 output (Gemma: a soft cap), element-wise; apart from the
        head's product, so code that computes that product its own way (the auto search's, by vocabulary blocks,
        whose Fisher trace takes this function's derivative element by element) finishes alike."""
        return logits

    def build_rotary(self, device) -> nn.Module:
        """The RoPE module (buffers only, rebuilt on the real device after meta construction): by default
        one cos/sin table for all layers."""
        from llmopt.layers.rotary import RotaryEmbedding

        s = self.spec
        return RotaryEmbedding(s.head_dim, s.max_position_embeddings, s.rope_theta, s.rope_scaling, device=device)

    @classmethod
    def hf_to_ours(cls, name: str) -> tuple[str, str | None]:
        """A checkpoint tensor name -> (our parameter name, fused shard or None)."""
        m = _LAYER_RE.match(name)
        if not m:
            return name.removeprefix("model."), None
        idx, mod, kind = m.groups()
        ours, shard = cls.packed_modules_mapping.get(mod, (mod, None))
        return f"layers.{idx}.{ours}.{kind}", shard

    @classmethod
    def hf_module_name(cls, ours: str) -> str:
        """Our unfused module (or parameter) name -> its checkpoint name (`model.` prefix but lm_head)."""
        return ours if ours.startswith("lm_head") else f"model.{ours}"

    @classmethod
    def hf_parts(cls, name: str, module: nn.Module) -> dict[str, tuple[int, int]]:
        """Checkpoint names of the projections inside our module `name` and their output row ranges
        (one entry, all rows, for an unfused linear)."""
        splits = output_splits(module)
        if not splits:
            return {cls.hf_module_name(name): (0, module.out_features)}
        m = re.match(r"^(layers\.\d+)\.(.+)$", name)
        if not m:
            raise ValueError(f"fused module {name!r} is not inside a decoder layer")
        layer, local = m.groups()
        by_shard = {shard: hf for hf, (ours, shard) in cls.packed_modules_mapping.items() if ours == local}
        missing = set(splits) - set(by_shard)
        if missing:
            raise ValueError(f"{cls.__name__}.packed_modules_mapping lacks {local}:{sorted(missing)[0]}")
        return {cls.hf_module_name(f"{layer}.{by_shard[shard]}"): rows for shard, rows in splits.items()}

