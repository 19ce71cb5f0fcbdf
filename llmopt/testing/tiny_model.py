"""Write a tiny random-weight model of a registered family (llama, mistral, qwen2, qwen3, and the MoE
families qwen3_moe, mixtral, qwen2_moe: config,
safetensors, tokenizer) to a directory, with transformers itself.

Tests use it so that most of the suite runs in seconds without the real SmolLM2. The tokenizer is a
byte-level BPE trained on a few lines of text, so it is self-contained and works offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache stores keys and values for every token of every sequence.",
    "Quantization trades a little quality for memory bandwidth and speed.",
    "Continuous batching schedules new requests at every step.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 +-*/=()[]{}<>,.;:!?'\"",
]


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save_random(config, out: Path, tok, seed: int, dtype: str, init) -> Path:
    """Build `config` with transformers, re-initialize every parameter with `init(name, p)` (seeded),
    save it in `dtype` with the tokenizer, and keep `torch_dtype` in config.json (transformers 5 rewrites
    some fields; both layouts are supported)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init(name, p)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    saved.setdefault("torch_dtype", dtype)
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return out


def _llama_init(name: str, p) -> None:
    """Larger than the default init, so that logits are not all ties; norms near 1."""
    import torch

    if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
    else:
        p.normal_(0.0, 0.08)


def write_tiny_llama(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    model_type: str = "llama",
    tie_word_embeddings: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_vocab_size: int = 512,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
) -> Path:
    """Create a random-weight model directory that both transformers and llmopt load.

    `head_dim` may differ from hidden / heads (Qwen3 does). `sliding_window` (mistral, qwen2, qwen3):
    the attention window, on every layer, or on those `layer_types` marks "sliding_attention"."""
    from transformers import AutoConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokenizer_vocab_size)
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": len(tok),
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": dtype,
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if model_type == "mistral":
        cfg["sliding_window"] = sliding_window
    elif model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = sliding_window is not None
        cfg["sliding_window"] = sliding_window
        cfg["max_window_layers"] = 0
    elif sliding_window is not None:
        raise ValueError(f"{model_type} has no sliding window")
    if layer_types is not None:
        cfg["layer_types"] = layer_types
    return _save_random(AutoConfig.for_model(**cfg), out, tok, seed, dtype, _llama_init)


def write_tiny_gemma3(
    out_dir: str | Path,
    *,
    num_layers: int = 3,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    sliding_window: int = 16,
    layer_types: list[str] | None = None,
    query_pre_attn_scalar: float = 24,
    rope_scaling: dict[str, Any] | None = None,
    final_logit_softcapping: float | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """A random-weight Gemma 3 text model (`Gemma3TextConfig`, `Gemma3ForCausalLM`) that transformers and
    llmopt both load. The defaults make every Gemma-specific knob matter: head_dim != hidden / heads, a
    query_pre_attn_scalar that is not head_dim, sliding layers (window 16) next to a full one, and norm
    weights away from zero (the scale is 1 + w)."""
    from transformers import Gemma3TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    kw: dict[str, Any] = {"rope_scaling": rope_scaling} if rope_scaling else {}
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, sliding_window=sliding_window,
        layer_types=layer_types or ["sliding_attention"] * (num_layers - 1) + ["full_attention"],
        query_pre_attn_scalar=query_pre_attn_scalar, final_logit_softcapping=final_logit_softcapping,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        architectures=["Gemma3ForCausalLM"], **kw)
    # norm weights w around 0: Gemma scales by 1 + w
    return _save_random(config, out, tok, seed, "float32",
                        lambda name, p: p.normal_(0.0, 0.1 if "norm" in name else 0.08))


_MOE_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def write_tiny_moe(
    out_dir: str | Path,
    *,
    model_type: str = "qwen3_moe",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    expert_intermediate_size: int = 32,
    intermediate_size: int = 96,
    shared_expert_intermediate_size: int = 64,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: list[int] | None = None,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_vocab_size: int = 512,
) -> Path:
    """A random-weight Qwen3-MoE, Mixtral or Qwen2-MoE directory, written by transformers'
    `save_pretrained` (per-expert tensor names, as on the hub). Mixtral's experts use
    `intermediate_size`; the Qwen families' dense layers (`mlp_only_layers`) use it too."""
    from transformers import AutoConfig

    if model_type not in _MOE_ARCH:
        raise ValueError(f"{model_type} is not a MoE family ({', '.join(_MOE_ARCH)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokenizer_vocab_size)
    cfg: dict[str, Any] = {
        "model_type": model_type, "architectures": [_MOE_ARCH[model_type]], "hidden_size": hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "vocab_size": len(tok), "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "torch_dtype": dtype,
        "num_experts_per_tok": top_k,
    }
    if model_type == "mixtral":
        cfg.update(num_local_experts=num_experts, intermediate_size=expert_intermediate_size)
    else:
        cfg.update(num_experts=num_experts, moe_intermediate_size=expert_intermediate_size,
                   intermediate_size=intermediate_size, norm_topk_prob=norm_topk_prob,
                   decoder_sparse_step=decoder_sparse_step, mlp_only_layers=mlp_only_layers or [])
    if model_type == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = shared_expert_intermediate_size
    if head_dim is not None:
        cfg["head_dim"] = head_dim

    def init(name: str, p) -> None:
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            p.normal_(0.0, 0.5)  # decisive routes: top-k choices are not near-ties
        else:
            _llama_init(name, p)

    return _save_random(AutoConfig.for_model(**cfg), out, tok, seed, dtype, init)
