"""Session fixtures: tiny random-weight checkpoints of the families the registry added after llama/qwen2.

Import the fixtures into a test module (`from tests.models.families import tiny_qwen3  # noqa: F401`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.testing.tiny_model import write_tiny_llama

WINDOW = 16  # sliding window of the tiny Mistral: far shorter than the 20-90-token test prompts


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Qwen3: q/k RMSNorm per head, no qkv bias, head_dim 32 != hidden 64 / 4 heads."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-qwen3"), model_type="qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_mistral_sw(tmp_path_factory) -> Path:
    """Mistral with sliding_window=16 on every layer."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-mistral-sw"), model_type="mistral", sliding_window=WINDOW)


@pytest.fixture(scope="session")
def tiny_qwen3_mixed(tmp_path_factory) -> Path:
    """Qwen3 whose layers alternate sliding (window 16) and full attention (transformers' `layer_types`)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-qwen3-mixed"), model_type="qwen3", head_dim=32,
                            num_layers=3, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """Gemma 3 text: 3 layers (sliding window 16, 16, full), head_dim 32, query_pre_attn_scalar 24 and
    linear RoPE scaling (x2) on the full layer, as Gemma-3-27B has."""
    from llmopt.testing.tiny_model import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=WINDOW,
                             rope_scaling={"rope_type": "linear", "factor": 2.0})


# ---- Mixture-of-Experts (appended with the MoE families) ----------------------------------------
from llmopt.testing.tiny_model import write_tiny_moe  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE: 8 experts, top-2, norm_topk_prob, q/k norms; layer 1 dense (`mlp_only_layers`)."""
    return write_tiny_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), model_type="qwen3_moe", num_layers=3,
                          mlp_only_layers=[1], head_dim=32)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """Mixtral: 8 experts (w1/w3/w2 names), top-2, always renormalized."""
    return write_tiny_moe(tmp_path_factory.mktemp("tiny-mixtral"), model_type="mixtral")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    """Qwen2-MoE: qkv bias, shared expert behind a sigmoid gate, top-k not renormalized, sparse every
    second layer (`decoder_sparse_step=2`)."""
    return write_tiny_moe(tmp_path_factory.mktemp("tiny-qwen2-moe"), model_type="qwen2_moe", num_layers=4,
                          top_k=3, norm_topk_prob=False, decoder_sparse_step=2)
