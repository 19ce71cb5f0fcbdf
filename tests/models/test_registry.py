"""The model registry: architectures -> implementation, one declared checkpoint-name mapping."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from llmopt.errors import LlmoptError
from llmopt.models import ModelSpec, registry
from llmopt.models.base import CausalLM

PKG = Path(__file__).resolve().parents[2] / "llmopt"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300}


@pytest.mark.parametrize("entry", registry.REGISTRY, ids=lambda e: e.architecture)
def test_every_entry_builds_and_maps_every_checkpoint_name(entry):
    spec = ModelSpec.from_hf_config({**TINY, "model_type": entry.model_type, "architectures": [entry.architecture]})
    assert spec.architecture == entry.architecture
    model = registry.build_model(spec, torch.float32, "meta")
    assert isinstance(model, CausalLM)
    cls = type(model)
    params = dict(model.named_parameters())
    for ours, _shard in cls.packed_modules_mapping.values():
        assert f"layers.0.{ours}.weight" in params
    # every fused module maps back to its checkpoint projections, and those map forward to it
    for name, mod in model.named_modules():
        if name.startswith("layers.0.") and hasattr(mod, "output_splits"):
            for hf in cls.hf_parts(name, mod):
                assert cls.hf_to_ours(hf + ".weight")[0] == name + ".weight"
    for local in cls.quantizable_linears:
        assert hasattr(model.get_submodule(f"layers.1.{local}"), "in_features")


def test_lookup_prefers_architectures_and_falls_back_to_model_type():
    assert registry.lookup({"architectures": ["Qwen2ForCausalLM"], "model_type": "x"}).model_type == "qwen2"
    assert registry.lookup({"model_type": "mistral"}).architecture == "MistralForCausalLM"
    with pytest.raises(LlmoptError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        registry.lookup({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_no_concrete_model_class_outside_models():
    bad = []
    for f in PKG.rglob("*.py"):
        if f.parent.name == "models" or f.parent.parent.name == "models":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "llmopt.models.llama":
                bad.append(str(f.relative_to(PKG)))
    assert not bad, bad
