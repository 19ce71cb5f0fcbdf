"""vram-plan's parameter count for Gemma 3 equals transformers' `num_parameters()`: the real Gemma-3-27B
text config (google/gemma-3-27b-it's `text_config`, from its published numbers) and Gemma-3-270M,
with transformers building the model on the meta device (no memory, no weights)."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.models import ModelSpec
from llmopt.planning.vram import VramPlanOptions, plan_vram
from tests.cli_runner import run_cli

GEMMA3_27B_TEXT = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "vocab_size": 262_208, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
GEMMA3_270M = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512, "vocab_size": 262_144,
    "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
CONFIGS = {"gemma-3-27b": GEMMA3_27B_TEXT, "gemma-3-270m": GEMMA3_270M}


def hf_num_parameters(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
                                  | {"model_type": cfg["model_type"]})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


@pytest.mark.parametrize("name", CONFIGS)
def test_vram_plan_params_equal_transformers(name):
    cfg = CONFIGS[name]
    spec = ModelSpec.from_hf_config(cfg)
    expected = hf_num_parameters(cfg)
    assert spec.num_params() == expected
    plan = plan_vram(spec, VramPlanOptions(weight_dtype="bf16"), model_name=name)
    assert plan.params == expected
    assert plan.gpu.weights.total == 2 * expected  # the bf16 weights are exactly 2 bytes per parameter


def test_published_sizes():
    """27B is the language model of Gemma-3-27B (the SigLIP tower is not counted); 270M as named."""
    assert ModelSpec.from_hf_config(GEMMA3_27B_TEXT).num_params() == 27_009_346_304
    assert ModelSpec.from_hf_config(GEMMA3_270M).num_params() == 268_098_176


def test_multimodal_gemma3_config_plans_its_text_decoder(tmp_path, monkeypatch, capsys):
    """google/gemma-3-27b-it's own config.json nests the decoder in `text_config`: vram-plan reads that."""
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {k: v for k, v in GEMMA3_27B_TEXT.items() if k not in ("architectures",)},
           "vision_config": {"model_type": "siglip_vision_model"}, "torch_dtype": "bfloat16"}
    cfg["text_config"]["model_type"] = "gemma3_text"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run_cli(monkeypatch, capsys, "vram-plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["params"] == 27_009_346_304


def test_multimodal_gemma3_weights_are_refused_in_one_line(tmp_path):
    from llmopt.errors import LlmoptError
    from llmopt.models import resolve_model
    from llmopt.models.resolve import weights_dir

    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {**GEMMA3_270M, "architectures": None}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    resolved = resolve_model(str(tmp_path))
    assert resolved.spec.num_params() == 268_098_176
    with pytest.raises(LlmoptError, match="multimodal Gemma 3 checkpoint") as e:
        weights_dir(resolved)
    assert "\n" not in str(e.value)


def test_sliding_layers_bound_the_kv_by_their_window(tmp_path, monkeypatch, capsys):
    """Gemma-3-27B at 8k tokens: the 10 full-attention layers hold 8192 tokens, the 52 sliding ones
    1024 (what vLLM keeps); bf16 KV is 2 x 16 heads x 128 x 2 B = 8 KiB per layer and token."""
    spec = ModelSpec.from_hf_config(GEMMA3_27B_TEXT)
    assert sum(t == "sliding_attention" for t in spec.layer_types) == 52
    per_layer = 2 * 16 * 128 * 2
    plan = plan_vram(spec, VramPlanOptions(weight_dtype="bf16", seq_len=8192, batch=2), model_name="g27")
    assert plan.kv_bytes_per_token == 62 * per_layer
    assert plan.kv_bytes_per_sequence == per_layer * (10 * 8192 + 52 * 1024)
    assert plan.kv_bytes_total == 2 * plan.kv_bytes_per_sequence == plan.gpu.kv
    # within the window every layer holds every token
    short = plan_vram(spec, VramPlanOptions(weight_dtype="bf16", seq_len=512), model_name="g27")
    assert short.kv_bytes_per_sequence == 62 * per_layer * 512
    # a bigger window frees less; the longest sequence that fits grows with the bound
    h200 = {"weight_dtype": "bf16", "seq_len": 8192, "batch": 2, "gpu_memory_bytes": 141 * 10**9}
    full = plan_vram(ModelSpec.from_hf_config({**GEMMA3_27B_TEXT, "sliding_window_pattern": 1}),
                     VramPlanOptions(**h200), model_name="g27-full")
    assert full.kv_bytes_per_sequence == 62 * per_layer * 8192 > plan.kv_bytes_per_sequence
    sliding = plan_vram(spec, VramPlanOptions(**h200), model_name="g27")
    assert sliding.max_seq_len_at_batch > 3 * full.max_seq_len_at_batch > 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_27B_TEXT))
    code, out, err = run_cli(monkeypatch, capsys, "vram-plan", str(path), "--seq-len", "8192", "--weight-dtype", "bf16")
    assert code == 0, err
    assert "52/62 sliding layers hold ≤ 1024 tokens" in out and "llmopt's own engine still keeps" in out
