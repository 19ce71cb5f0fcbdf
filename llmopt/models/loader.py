"""Load Hugging Face-layout weights (safetensors) into our fused LlamaForCausalLM."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from llmopt.errors import LlmoptError
from llmopt.layers.linear import output_splits
from llmopt.models.llama import LlamaForCausalLM
from llmopt.models.resolve import ResolvedModel, weights_dir

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# HF projection name -> (our fused module, shard name)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q_proj"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k_proj"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v_proj"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate_proj"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up_proj"),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def parse_dtype(dtype: str | torch.dtype, spec_dtype: str = "float32") -> torch.dtype:
    """`auto` keeps the checkpoint dtype, except fp16 on CPU stays fp32 (CPU fp16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return _DTYPES.get(spec_dtype, torch.float32)
    if dtype not in _DTYPES:
        raise LlmoptError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def hf_name_to_ours(name: str) -> tuple[str, str | None]:
    """Map a checkpoint tensor name to (our parameter name, fused shard or None)."""
    if name.startswith("model.layers."):
        m = _LAYER_RE.match(name)
        if not m:
            return name, None
        idx, mod, kind = m.groups()
        if mod in _FUSED:
            ours, shard = _FUSED[mod]
            return f"layers.{idx}.{ours}.{kind}", shard
        return f"layers.{idx}.{mod}.{kind}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None


def load_state_into(model: LlamaForCausalLM, directory: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = sorted(directory.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if "rotary_emb" in name:
                    continue
                ours, shard = hf_name_to_ours(name)
                if ours not in params:
                    raise LlmoptError(f"{f.name}: unexpected tensor {name!r} (is this a llama-family model?)")
                target = params[ours]
                tensor = st.get_tensor(name)
                with torch.no_grad():
                    if shard is None:
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise LlmoptError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                        target.copy_(tensor)
                    else:
                        module = model.get_submodule(ours.rsplit(".", 1)[0])
                        lo, hi = output_splits(module)[shard]
                        target[lo:hi].copy_(tensor)
                loaded.add(ours if shard is None else f"{ours}:{shard}")
    expected = set()
    for name, mod in model.named_modules():
        splits = output_splits(mod)
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{name}.{pname}"
            if splits:
                expected.update(f"{full}:{s}" for s in splits)
            else:
                expected.add(full)
    if model.spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise LlmoptError(f"{directory}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def load_model(resolved: ResolvedModel, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build our model for `resolved` and fill it from its weights (GGUF is converted once and cached)."""
    directory = weights_dir(resolved)
    torch_dtype = parse_dtype(dtype, resolved.spec.dtype)
    if resolved.quantization_config is not None:
        from llmopt.quant.checkpoint import load_quantized_model  # lazy: quant builds on this module

        return load_quantized_model(resolved, directory, torch_dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(resolved.spec, dtype=torch_dtype, device="meta")
    model = model.to_empty(device=device)
    # buffers (rotary tables) are not in the checkpoint: rebuild them on the real device
    _rebuild_rotary(model, device)
    if resolved.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_state_into(model, directory)
    model.eval()
    return model


def _rebuild_rotary(model: LlamaForCausalLM, device) -> None:
    from llmopt.layers.rotary import RotaryEmbedding

    s = model.spec
    model.rotary = RotaryEmbedding(s.head_dim, s.max_position_embeddings, s.rope_theta, s.rope_scaling,
                                   device=device)
