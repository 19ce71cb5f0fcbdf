"""Mixture-of-Experts decoders: Qwen3-MoE and Qwen2-MoE (`QwenMoeForCausalLM`) and Mixtral.

They are the llama decoder (attention with Qwen3's q/k norms or Qwen2's qkv bias, as spec data) whose
MLP is a `SparseMoeBlock` on the layers `ModelSpec.moe_layers` lists, and the dense llama MLP on the
others (Qwen's `mlp_only_layers` / `decoder_sparse_step`). Our module names are one scheme for all
three: `mlp.gate` (router), `mlp.experts.N.{gate_up_proj,down_proj}`, `mlp.shared_expert.*` and
`mlp.shared_expert_gate`. Checkpoints use the per-expert names the hub and transformers'
`save_pretrained` write; Mixtral's (`block_sparse_moe.experts.N.w1|w3|w2`, `block_sparse_moe.gate`) are
renamed onto ours by `hf_renames`, both ways, so loading and export share one mapping.
"""

from __future__ import annotations

import re
from typing import ClassVar

from torch import nn

from llmopt.layers.linear import output_splits
from llmopt.layers.moe import SparseMoeBlock
from llmopt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from llmopt.models.spec import ModelSpec

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.([A-Za-z_]+)$")
# unfused projection -> (our fused module, shard), for any prefix (mlp, mlp.experts.N, mlp.shared_expert)
_FUSE_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)$")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


class MoeDecoderLayer(LlamaDecoderLayer):
    decode_lowering = "llama"  # the llama layer; its sparse MLP lowers as one MoE op (llmopt.step)

    def make_mlp(self, spec: ModelSpec, layer_idx: int, dtype, device) -> nn.Module:
        if not spec.is_moe_layer(layer_idx):
            return super().make_mlp(spec, layer_idx, dtype, device)
        return SparseMoeBlock(spec.hidden_size, spec.num_experts, spec.num_experts_per_tok,
                              spec.moe_intermediate_size, spec.norm_topk_prob,
                              spec.shared_expert_intermediate_size, dtype, device)


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Qwen2-MoE: checkpoint names are already ours, unfused."""

    decoder_layer = MoeDecoderLayer
    # the mapping of a sparse layer, expert 0 standing for every expert (hf_to_ours applies it by pattern)
    packed_modules_mapping = {
        **{f"self_attn.{p}": ("self_attn.qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")},
        "mlp.experts.0.gate_proj": ("mlp.experts.0.gate_up_proj", "gate_proj"),
        "mlp.experts.0.up_proj": ("mlp.experts.0.gate_up_proj", "up_proj"),
    }
    # of a sparse layer; expert 0 stands for every expert (a dense layer has the llama mlp.gate_up_proj,
    # mlp.down_proj; Qwen2-MoE adds mlp.shared_expert.gate_up_proj / down_proj)
    quantizable_linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts.0.gate_up_proj",
                           "mlp.experts.0.down_proj")
    float_linears = (r"^mlp\.gate$", r"^mlp\.shared_expert_gate$")
    # (checkpoint pattern, our replacement) over module paths inside a layer; `ours_to_hf` is the inverse
    hf_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    ours_to_hf: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def _rename(cls, local: str, rules) -> str:
        for pattern, repl in rules:
            local, n = re.subn(pattern, repl, local)
            if n:
                break
        return local

    @classmethod
    def hf_to_ours(cls, name: str) -> tuple[str, str | None]:
        m = _LAYER_RE.match(name)
        if not m:
            return super().hf_to_ours(name)
        idx, mod, kind = m.groups()
        mod = cls._rename(mod, cls.hf_renames)
        f = _FUSE_RE.match(mod)
        if f:
            return f"layers.{idx}.{f.group(1)}.{_FUSED[f.group(2)]}.{kind}", f.group(2)
        return f"layers.{idx}.{mod}.{kind}", None

    @classmethod
    def hf_module_name(cls, ours: str) -> str:
        m = re.match(r"^layers\.(\d+)\.(.+)$", ours)
        if not m:
            return super().hf_module_name(ours)
        return f"model.layers.{m.group(1)}.{cls._rename(m.group(2), cls.ours_to_hf)}"

    @classmethod
    def hf_parts(cls, name: str, module: nn.Module) -> dict[str, tuple[int, int]]:
        splits = output_splits(module)
        if not splits:
            return {cls.hf_module_name(name): (0, module.out_features)}
        parent = name.rsplit(".", 1)[0]
        return {cls.hf_module_name(f"{parent}.{shard}"): rows for shard, rows in splits.items()}


class MixtralForCausalLM(QwenMoeForCausalLM):
    """Mixtral: `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down), `block_sparse_moe.gate`."""

    packed_modules_mapping = {
        **{f"self_attn.{p}": ("self_attn.qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")},
        "block_sparse_moe.experts.0.w1": ("mlp.experts.0.gate_up_proj", "gate_proj"),
        "block_sparse_moe.experts.0.w3": ("mlp.experts.0.gate_up_proj", "up_proj"),
    }
    hf_renames = ((r"^block_sparse_moe\.experts\.(\d+)\.w1$", r"mlp.experts.\1.gate_proj"),
                  (r"^block_sparse_moe\.experts\.(\d+)\.w3$", r"mlp.experts.\1.up_proj"),
                  (r"^block_sparse_moe\.experts\.(\d+)\.w2$", r"mlp.experts.\1.down_proj"),
                  (r"^block_sparse_moe\.gate$", "mlp.gate"))
    ours_to_hf = ((r"^mlp\.experts\.(\d+)\.gate_proj(?=\.|$)", r"block_sparse_moe.experts.\1.w1"),
                  (r"^mlp\.experts\.(\d+)\.up_proj(?=\.|$)", r"block_sparse_moe.experts.\1.w3"),
                  (r"^mlp\.experts\.(\d+)\.down_proj(?=\.|$)", r"block_sparse_moe.experts.\1.w2"),
                  (r"^mlp\.gate(?=\.|$)", "block_sparse_moe.gate"))
