"""The model registry: which Hugging Face architectures llmopt runs, with which of our classes, and
the facts a config may leave implicit. Plain data, so `ModelSpec` and vram-plan read it without torch;
a model class is imported only when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmopt.errors import LlmoptError

if TYPE_CHECKING:
    import torch

    from llmopt.models.base import CausalLM
    from llmopt.models.spec import ModelSpec


@dataclass(frozen=True)
class ModelEntry:
    architecture: str  # the HF `architectures` entry, e.g. "LlamaForCausalLM"
    model_type: str  # the HF `model_type`, e.g. "llama"
    impl: str  # "module:Class" of our implementation
    label: str = ""  # the models people know it by (for messages and docs)
    qkv_bias: bool = False  # q/k/v bias when the config has no `attention_bias`
    force_qkv_bias: bool = False  # the bias is part of the architecture (Qwen2 configs never say)
    qk_norm: bool = False  # RMSNorm on every q and k head before RoPE (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # hidden-size norms per decoder layer (Gemma 3: pre and post, attention and MLP)
    moe: str = ""  # Mixture-of-Experts config layout: "mixtral", "qwen2_moe" (shared expert) or "qwen3_moe"


_LLAMA = "llmopt.models.llama:LlamaForCausalLM"
_GEMMA3 = "llmopt.models.gemma3:Gemma3ForCausalLM"
_MOE = "llmopt.models.moe:"

REGISTRY: tuple[ModelEntry, ...] = (
    ModelEntry("LlamaForCausalLM", "llama", _LLAMA, "Llama 2/3, SmolLM2"),
    ModelEntry("MistralForCausalLM", "mistral", _LLAMA, "Mistral, sliding window"),
    ModelEntry("Qwen2ForCausalLM", "qwen2", _LLAMA, "Qwen2/2.5", qkv_bias=True, force_qkv_bias=True),
    ModelEntry("Qwen3ForCausalLM", "qwen3", _LLAMA, "Qwen3 dense", qk_norm=True),
    ModelEntry("Qwen3MoeForCausalLM", "qwen3_moe", _MOE + "QwenMoeForCausalLM", "Qwen3-MoE", qk_norm=True,
               moe="qwen3_moe"),
    ModelEntry("MixtralForCausalLM", "mixtral", _MOE + "MixtralForCausalLM", "Mixtral", moe="mixtral"),
    ModelEntry("Qwen2MoeForCausalLM", "qwen2_moe", _MOE + "QwenMoeForCausalLM", "Qwen1.5/2-MoE, shared expert",
               qkv_bias=True, moe="qwen2_moe"),
    ModelEntry("Gemma3ForCausalLM", "gemma3_text", _GEMMA3, "Gemma 3 text", qk_norm=True, norms_per_layer=4),
)
BY_ARCHITECTURE = {e.architecture: e for e in REGISTRY}
BY_MODEL_TYPE = {e.model_type: e for e in REGISTRY}


def supported_hint() -> str:
    """One line listing the registry, for errors and docs."""
    return "supported architectures: " + ", ".join(
        f"{e.model_type} ({e.architecture}{': ' + e.label if e.label else ''})" for e in REGISTRY)


def lookup(cfg: dict[str, Any]) -> ModelEntry:
    """The registry entry for a HF config dict: its first known `architectures` entry, else `model_type`."""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    entry = next((BY_ARCHITECTURE[a] for a in archs if a in BY_ARCHITECTURE), None)
    entry = entry or BY_MODEL_TYPE.get(cfg.get("model_type"))  # type: ignore[arg-type]
    if entry is None:
        raise LlmoptError(f"unsupported architecture model_type={cfg.get('model_type')!r} "
                          f"({','.join(archs) or 'unknown'}); {supported_hint()}")
    return entry


def model_class(spec: ModelSpec) -> type[CausalLM]:
    """Our implementation class for `spec` (imported on first use)."""
    module, _, name = lookup({"architectures": [spec.architecture], "model_type": spec.model_type}).impl.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(spec: ModelSpec, dtype: torch.dtype, device: Any = "cpu") -> CausalLM:
    """An (uninitialized when `device` is meta) instance of the model class for `spec`."""
    return model_class(spec)(spec, dtype=dtype, device=device)
