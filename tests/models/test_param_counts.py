"""`ModelSpec.num_params` (what vram-plan counts) against transformers' `num_parameters()` for the
real Qwen3-8B, Mixtral-8x7B, Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B configs (written here from their
published config.json), instantiated on the meta device so nothing is allocated; and the MoE parts of
vram-plan: total vs active parameters, weights vs KV, expert-parallel advice."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.models import ModelSpec
from llmopt.planning.memory import VramPlanOptions
from llmopt.planning.vram import plan_vram
from tests.cli_runner import run_cli

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
    "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192, "moe_intermediate_size": 1408,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}
# published totals (model cards: 8.2B, 46.7B, 30.5B with 3.3B active, 14.3B with 2.7B active)
REAL = {"qwen3-8b": (QWEN3_8B, 8_190_735_360), "mixtral-8x7b": (MIXTRAL_8X7B, 46_702_792_704),
        "qwen3-30b-a3b": (QWEN3_30B_A3B, 30_532_122_624), "qwen1.5-moe-a2.7b": (QWEN15_MOE_A27B, 14_315_784_192)}
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 512}
TINY_MOE = {
    "qwen3_moe-sparse-step-2": {**TINY, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "decoder_sparse_step": 2},
    "qwen3_moe-mlp-only": {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1,
                           "moe_intermediate_size": 16, "mlp_only_layers": [0, 3], "head_dim": 24},
    "mixtral-tied": {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                     "tie_word_embeddings": True},
    "qwen2_moe": {**TINY, "model_type": "qwen2_moe", "num_experts": 5, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "mlp_only_layers": [1]},
}


def hf_num_parameters(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model.num_parameters()


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_param_counts_equal_transformers(name):
    cfg, published = REAL[name]
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.num_params() == hf_num_parameters(cfg) == published


@pytest.mark.parametrize("name", sorted(TINY_MOE))
def test_tiny_moe_layouts_count_like_transformers(name):
    cfg = TINY_MOE[name]
    assert ModelSpec.from_hf_config(cfg).num_params() == hf_num_parameters(cfg)


def test_active_params_per_token():
    # Mixtral: 2 of 8 experts of 3 x 4096 x 14336 per layer; Qwen3-30B-A3B: 8 of 128 of 3 x 2048 x 768
    mx = ModelSpec.from_hf_config(MIXTRAL_8X7B)
    assert mx.num_params() - mx.active_params() == 32 * 6 * 3 * 4096 * 14336
    assert mx.active_params() == 12_879_925_248
    q = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    assert q.active_params() == 3_353_032_704  # "3.3B activated"
    dense = ModelSpec.from_hf_config(QWEN3_8B)
    assert dense.active_params() == dense.num_params()


def test_vram_plan_reports_moe_and_expert_parallel():
    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    opts = VramPlanOptions(gpu_memory_bytes=80 * 2**30, seq_len=8192, batch=16, num_gpus=8, weight_dtype="int4")
    plan = plan_vram(spec, opts)
    j = plan.to_json()
    assert (j["params"], j["active_params_per_token"]) == (30_532_122_624, 3_353_032_704)
    assert j["moe"] == {"num_experts": 128, "experts_per_token": 8, "sparse_layers": 48, "shared_expert": False}
    assert 0 < j["weights_fraction_of_weights_plus_kv"] < 1
    par = j["parallel"]
    # int4 g128: TP=4 would cut each 768-wide expert to 192 columns (not whole groups); EP keeps experts whole
    assert "4" in par["invalid_tp_degrees"] and "expert down_proj" in par["invalid_tp_degrees"]["4"]
    eps = {e["ep"]: e for e in par["expert_parallel"]}
    assert sorted(eps) == [2, 4, 8]
    assert eps[8]["weights_bytes_per_gpu"] < eps[4]["weights_bytes_per_gpu"] < eps[2]["weights_bytes_per_gpu"]
    tp2 = next(t for t in par["tensor_parallel"] if t["tp"] == 2)
    assert tp2["weights_bytes_per_gpu"] == eps[2]["weights_bytes_per_gpu"]  # same bytes, split differently
    assert any(a.startswith("EP=4: 32 whole experts per GPU") and "TP=4 is not possible" in a for a in par["advice"])
    # a dense model has no expert-parallel layouts
    dense = plan_vram(ModelSpec.from_hf_config(QWEN3_8B), opts).to_json()["parallel"]
    assert dense["expert_parallel"] == [] and dense["invalid_ep_degrees"] == {}


def test_oom_checklist_offers_expert_parallelism():
    # Qwen3-30B-A3B in int4 g128 on 8 GiB GPUs: TP=4 is impossible (192-column expert shards), EP=4 fits
    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    opts = VramPlanOptions(gpu_memory_bytes=8 * 2**30, seq_len=4096, batch=4, weight_dtype="int4")
    recs = {r.kind: r for r in plan_vram(spec, opts).recommendations}
    assert "tensor_parallel" not in recs or "over 8 GPUs" in recs["tensor_parallel"].action
    ep = recs["expert_parallel"]
    assert ep.fits_after and "over 4 GPUs" in ep.action and "--enable-expert-parallel" in ep.action
    dense = plan_vram(ModelSpec.from_hf_config(QWEN3_8B), opts).recommendations
    assert all(r.kind != "expert_parallel" for r in dense)


def test_vram_plan_cli_on_a_moe_config(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    code, out, err = run_cli(monkeypatch, capsys, "vram-plan", str(tmp_path), "--gpu-memory", "80GiB",
                             "--num-gpus", "4")
    assert code == 0, err
    out = " ".join(out.split())
    assert "MoE: 8 experts, 2 per token on 32/32 layers" in out and "active per token 12,879,925,248" in out
    assert "EP=2" in out and "EP=4: 2 whole experts per GPU" in out
    assert "vs KV cache" in out
