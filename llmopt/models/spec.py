"""ModelSpec: the architecture facts every command needs (memory plans, the engine, quantization)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from llmopt.errors import LlmoptError
from llmopt.models import registry


class ModelSpec(BaseModel):
    """A decoder of one of the registry's architectures, normalized from a Hugging Face `config.json`
    (or GGUF metadata)."""

    model_config = ConfigDict(frozen=True)

    model_type: str
    architecture: str = ""  # the registry entry (HF `architectures` name); "" = look up by model_type
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head (head_dim weights) before RoPE (Qwen3)
    # per-layer attention: "full_attention" or "sliding_attention" (each query sees the last
    # `sliding_window` positions, itself included); empty = every layer full
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Mixture-of-Experts (num_experts == 0: dense): `moe_layers` have the sparse block, the others a dense
    # MLP. A shared expert (Qwen2-MoE) runs on every token behind a sigmoid gate.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # of the full-attention layers
    rope_local_theta: float | None = None  # RoPE base of the sliding layers when it differs (Gemma 3)
    norms_per_layer: int = 2  # hidden-size norms per decoder layer (Gemma 3 has 4)
    query_pre_attn_scalar: float | None = None  # attention scale = this**-0.5 (None: head_dim)
    hidden_activation: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    dtype: str = "float16"
    bos_token_id: int | None = None
    eos_token_id: list[int] = []

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        """Normalize a transformers config dict. Accepts transformers 4.x and 5.x rope layouts. A value of the
        wrong type or out of range is one LlmoptError (it was a traceback from wherever it was first used)."""
        try:
            return cls._from_hf_config(cfg)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise LlmoptError(f"config.json has a value llmopt cannot read: {where}: {first.get('msg')}") from None
        except (ValueError, TypeError, ZeroDivisionError, AttributeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LlmoptError(f"config.json has a value llmopt cannot read: {why}") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        cfg = _text_config(cfg)
        entry = registry.lookup(cfg)
        model_type = str(cfg.get("model_type") or entry.model_type)
        required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        try:
            hidden, heads, layers, inter, vocab = (int(cfg[k]) for k in required)
        except KeyError as e:
            raise LlmoptError(f"config.json lacks required key {e.args[0]!r}") from None
        for key, value in zip(required, (hidden, heads, layers, inter, vocab), strict=True):
            if value <= 0:
                raise LlmoptError(f"config.json: {key} must be positive, got {value}")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise LlmoptError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        rope = cfg.get("rope_parameters") or {}
        local_theta = None
        default_theta = 10000.0
        if model_type == "gemma3_text" or isinstance(rope.get("full_attention"), dict):
            # per-layer-type RoPE (transformers 5 nests it by layer type; 4.x: rope_local_base_freq)
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise LlmoptError(f"unsupported rope scaling {local['rope_type']!r} on sliding layers; "
                                  "supported there: default")
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            rope = rope.get("full_attention") or {}
            default_theta = 1_000_000.0 if model_type == "gemma3_text" else default_theta
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", default_theta)))
        scaling = cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "linear", "llama3"):
            raise LlmoptError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
        scaling = scaling if kind in ("linear", "llama3") else None
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
        attention_bias = entry.force_qkv_bias or bool(cfg.get("attention_bias", cfg.get("qkv_bias", entry.qkv_bias)))
        layer_types, window = _attention_layout(cfg, model_type, layers)
        moe = _moe_layout(cfg, entry.moe, layers, inter)
        if cfg.get("attn_logit_softcapping") is not None:
            raise LlmoptError(f"attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported "
                              "(Gemma 2 style attention soft-capping)")
        if cfg.get("use_bidirectional_attention"):
            raise LlmoptError("use_bidirectional_attention is not supported (llmopt runs causal decoders)")
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise LlmoptError(f"unsupported MLP activation {act!r}; supported: silu, gelu_pytorch_tanh")
        softcap, qpas = cfg.get("final_logit_softcapping"), cfg.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type, architecture=entry.architecture, num_layers=layers, hidden_size=hidden,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=attention_bias,
            qk_norm=entry.qk_norm, layer_types=layer_types, sliding_window=window, **moe, rope_theta=theta,
            rope_scaling=scaling, rope_local_theta=local_theta, norms_per_layer=entry.norms_per_layer,
            query_pre_attn_scalar=None if qpas is None else float(qpas), hidden_activation=act,
            final_logit_softcapping=None if softcap is None else float(softcap),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), dtype=dtype, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def attention_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full causal attention)."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def kv_groups(self) -> list[tuple[int | None, tuple[int, ...]]]:
        """(window, layers) of the layers that share a KV pool: one group when every layer has the same
        window; else the full layers first, then each window's (Gemma 3), sized for the window."""
        windows = [self.attention_window(i) for i in range(self.num_layers)]
        order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        return [(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of every quantizable Linear of layer `layer`, unfused llama names
        (experts as `mlp.experts.N.*`); routers stay float and are in `layer_router_params`."""
        h = self.hidden_size
        shapes = {"self_attn.q_proj": (self.q_size, h), "self_attn.k_proj": (self.kv_size, h),
                  "self_attn.v_proj": (self.kv_size, h), "self_attn.o_proj": (h, self.q_size)}
        mlps = [("mlp", self.intermediate_size)]  # (prefix, width) of each gated MLP
        if self.is_moe_layer(layer):
            mlps = [(f"mlp.experts.{e}", self.moe_intermediate_size) for e in range(self.num_experts)]
            if self.shared_expert_intermediate_size:
                mlps.append(("mlp.shared_expert", self.shared_expert_intermediate_size))
        for prefix, m in mlps:
            shapes.update({f"{prefix}.gate_proj": (m, h), f"{prefix}.up_proj": (m, h), f"{prefix}.down_proj": (h, m)})
        return shapes

    def layer_linear_params(self, layer: int = 0) -> int:
        return sum(o * i for o, i in self.linear_shapes(layer).values())

    def layer_router_params(self, layer: int = 0) -> int:
        """The router (experts x hidden) and the shared-expert gate (1 x hidden) of a sparse layer."""
        gates = self.num_experts + (1 if self.shared_expert_intermediate_size else 0)
        return self.hidden_size * gates if self.is_moe_layer(layer) else 0

    def layer_norm_params(self) -> int:
        """Norm weights of one decoder layer: the hidden-size norms and the per-head q/k norms."""
        return self.norms_per_layer * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def layer_params(self, layer: int) -> int:
        """Linears, norms, q/k/v biases and MoE routers of decoder layer `layer`."""
        bias = (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        return self.layer_linear_params(layer) + self.layer_norm_params() + bias + self.layer_router_params(layer)

    def layer_active_params(self, layer: int) -> int:
        """Parameters one token reads in `layer`: all but the experts it is not routed to."""
        unused = self.num_experts - self.num_experts_per_tok if self.is_moe_layer(layer) else 0
        return self.layer_params(layer) - unused * 3 * self.hidden_size * self.moe_intermediate_size

    def non_layer_params(self) -> int:
        """The embedding, the lm_head (none when tied: stored once) and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def num_params(self) -> int:
        """Exact parameter count (tied embeddings counted once; every expert counted)."""
        return self.non_layer_params() + sum(self.layer_params(i) for i in range(self.num_layers))

    def active_params(self) -> int:
        """Parameters one token's forward reads (MoE: only its top-k experts; = num_params when dense)."""
        return self.non_layer_params() + sum(self.layer_active_params(i) for i in range(self.num_layers))


LAYER_TYPES = ("full_attention", "sliding_attention")


# transformers' config defaults, for keys a config leaves out (experts, expert width, top-k, shared width)
_MOE_DEFAULTS = {"mixtral": (8, None, 2, 0), "qwen3_moe": (128, 768, 8, 0), "qwen2_moe": (60, 1408, 4, 5632)}


def _moe_layout(cfg: dict[str, Any], moe: str, num_layers: int, intermediate: int) -> dict[str, Any]:
    """The MoE fields of `ModelSpec` as transformers applies the config: Mixtral (every layer sparse,
    top-k renormalized) or Qwen2/3-MoE (`mlp_only_layers`, `decoder_sparse_step`, `norm_topk_prob`)."""
    if not moe:
        return {}
    d_experts, d_inter, d_top_k, d_shared = _MOE_DEFAULTS[moe]
    # hub configs say num_experts; transformers 5's save_pretrained writes num_local_experts
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or d_experts)
    top_k = int(cfg.get("num_experts_per_tok") or d_top_k)
    if moe == "mixtral":
        expert_inter, norm, sparse = intermediate, True, list(range(num_layers))
    else:
        expert_inter = int(cfg.get("moe_intermediate_size") or d_inter)
        norm = bool(cfg.get("norm_topk_prob", False))
        step = int(cfg.get("decoder_sparse_step") or 1)
        only_dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        sparse = [i for i in range(num_layers) if i not in only_dense and (i + 1) % step == 0]
    if not 1 <= top_k <= experts:
        raise LlmoptError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
    shared = int(cfg.get("shared_expert_intermediate_size", d_shared) or 0)
    if not sparse:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_inter,
            "shared_expert_intermediate_size": shared, "norm_topk_prob": norm, "moe_layers": tuple(sparse)}


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config (`model_type` gemma3) -> its text decoder's config (vram-plan sizes
    the language model; the vision tower is not counted)."""
    text = cfg.get("text_config")
    if cfg.get("model_type") != "gemma3" or not isinstance(text, dict):
        return cfg
    return {**text, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "torch_dtype": text.get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype")}


def _attention_layout(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers applies them: `layer_types`, else each family's
    rule (Mistral: every layer; Qwen: `use_sliding_window`, `max_window_layers`; Gemma 3: a pattern)."""
    window = cfg.get("sliding_window", 4096 if model_type == "gemma3_text" else None)  # transformers' default
    types = cfg.get("layer_types")
    if types is None:
        if model_type in ("mistral", "mixtral") and window:
            types = ["sliding_attention"] * num_layers
        elif model_type == "qwen3_moe" and cfg.get("use_sliding_window") and window:
            types = ["sliding_attention"] * num_layers  # Qwen3MoeAttention windows every layer
        elif model_type == "qwen2_moe" and cfg.get("use_sliding_window") and window:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
            first = int(cfg.get("max_window_layers", 0))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif model_type == "gemma3_text":  # older configs: every `sliding_window_pattern`-th layer is full
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            return (), None
    types = [str(t) for t in types]
    if len(types) != num_layers:
        raise LlmoptError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise LlmoptError(f"unsupported attention layer type {unknown[0]!r}; supported: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" not in types:
        return (), None
    if not window or int(window) <= 0:
        raise LlmoptError("layer_types has sliding_attention layers but config.json sets no sliding_window")
    window = int(window)
    # a window covering every position is no window, except where the layer type also picks the
    # RoPE base (Gemma 3): keep the types then (the mask is a no-op)
    if window >= int(cfg.get("max_position_embeddings", 2048)) and model_type != "gemma3_text":
        return (), None
    return tuple(types), window
