"""The memory model shared by the single-GPU plan (`vram`) and the multi-GPU one (`parallel`): what
to plan for (`VramPlanOptions`), the dtypes after `auto` (`ResolvedDtypes`), and `MemoryModel`, which
turns (spec, dtypes, options) into the bytes one GPU holds for some shard and slice of the model.

Both plans build on this module and it imports neither, so they cannot disagree about a byte (and do
not import each other). The formulas are explained in docs/VRAM_PLAN.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from llmopt.errors import LlmoptError
from llmopt.models.spec import ModelSpec

MiB = 1024**2
GiB = 1024**3

WEIGHT_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int8", "int4")
KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int8")
FLOAT_DTYPES = ("fp32", "fp16", "bf16")
INT_WEIGHT_DTYPES = ("int8", "int4")
# Storage bits per element. int4 is the only sub-byte type, so weights are summed in bits.
DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
# Spellings people paste from transformers / vLLM, normalized to our short names.
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}
# config.json `torch_dtype` -> our name; what `auto` means for weights.
CHECKPOINT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# Quantization storage, chosen to match what vLLM loads (see docs/VRAM_PLAN.md, "Weights"):
GROUP_SCALE_BITS = 16  # one fp16 scale per group (GPTQ/AWQ/compressed-tensors store 16-bit scales)
INT4_ZERO_BITS = 4  # int4 is asymmetric: a packed 4-bit zero point per group (AWQ/GPTQ default)
FP8_TENSOR_SCALE_BYTES = 4  # fp8 weights: one fp32 scale per Linear (vLLM `--quantization fp8`)
KV_INT8_SCALE_BYTES = 2  # int8 KV: one fp16 scale per (token, KV head), for K and for V
LOGITS_FP32_COPIES = 2  # the sampler upcasts logits to fp32 and builds fp32 probabilities


def _normalize_dtype(value: Any, choices: tuple[str, ...], flag: str) -> str:
    name = _DTYPE_ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if name not in choices:
        raise LlmoptError(f"unknown {flag} {str(value)!r}; choose one of {', '.join(choices)}")
    return name


def _at_least(value: int, minimum: int, flag: str) -> int:
    if value < minimum:
        raise LlmoptError(f"{flag} must be at least {minimum}, got {value}")
    return value


# Fields that must be at least 1, and the CLI flag their error names.
_AT_LEAST_ONE = {"seq_len": "--seq-len", "batch": "--batch", "num_gpus": "--num-gpus",
                 "gpu_memory_bytes": "--gpu-memory (bytes)"}


class VramPlanOptions(BaseModel):
    """What to plan for. Validated here, at the edge, so the math below can trust its inputs.

    Pydantic checks types; the user-facing checks raise `LlmoptError` naming the CLI flag (pydantic
    lets non-ValueError exceptions through unchanged), so the CLI prints one line and exits 2.
    The last five fields are the planner's assumptions (docs/VRAM_PLAN.md); the CLI leaves them at
    their defaults, Python callers may tune them to their framework.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight_dtype: str = "auto"
    group_size: int | None = None  # None: -1 (per channel) for int8, 128 (or what divides) for int4
    kv_dtype: str = "auto"
    seq_len: int = 2048
    batch: int = 1
    gpu_memory_bytes: int = 24 * GiB
    num_gpus: int = 1
    # vLLM's chunked-prefill token budget (max_num_batched_tokens): the most tokens one forward sees.
    max_num_batched_tokens: int = Field(2048, ge=1)
    # CUDA context, cuBLAS workspaces, CUDA-graph pools: a fixed cost per GPU process.
    reserve_fixed_bytes: int = Field(1 * GiB, ge=0)
    # Caching-allocator fragmentation: a share of everything else on the GPU.
    reserve_percent: float = Field(5.0, ge=0, lt=100)
    # NCCL / custom all-reduce buffers, only on GPUs that talk to others (TP or PP > 1).
    comm_reserve_bytes: int = Field(256 * MiB, ge=0)
    # Above this share of the GPU the plan fits without headroom, so recommendations are given.
    tight_fraction: float = Field(0.9, gt=0, le=1)

    @field_validator("weight_dtype", mode="before")
    @classmethod
    def _weight_dtype(cls, v: Any) -> str:
        return _normalize_dtype(v, WEIGHT_DTYPES, "--weight-dtype")

    @field_validator("kv_dtype", mode="before")
    @classmethod
    def _kv_dtype(cls, v: Any) -> str:
        return _normalize_dtype(v, KV_DTYPES, "--kv-dtype")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise LlmoptError(f"--group-size must be -1 (per channel) or at least 1, got {v}")
        return v

    @field_validator(*_AT_LEAST_ONE)
    @classmethod
    def _at_least_one(cls, v: int, info: ValidationInfo) -> int:
        return _at_least(v, 1, _AT_LEAST_ONE[info.field_name])


# ---------------------------------------------------------------------------------------------------
# dtypes


@dataclass(frozen=True)
class ResolvedDtypes:
    """The concrete dtypes after `auto`: `compute` is what activations (and 16-bit leftovers) use."""

    weight: str
    kv: str
    compute: str
    group_size: int | None  # None unless weights are int8/int4


def linear_weight_bytes(out_features: int, in_features: int, dtype: str, group_size: int | None) -> int:
    """Bytes of one Linear's weight as stored for inference, quantization metadata included.

    int8: symmetric, one fp16 scale per group (or per output channel when group_size == -1).
    int4: asymmetric, per group one fp16 scale plus one packed 4-bit zero point.
    fp8: one fp32 per-tensor scale. Float dtypes: just the elements.
    """
    n = out_features * in_features
    if dtype in FLOAT_DTYPES:
        return n * DTYPE_BITS[dtype] // 8
    if dtype == "fp8":
        return n + FP8_TENSOR_SCALE_BYTES
    if group_size is None:
        raise ValueError(f"{dtype} weights need a group size")
    groups = out_features * (1 if group_size == -1 else in_features // group_size)
    meta_bits = GROUP_SCALE_BITS + (INT4_ZERO_BITS if dtype == "int4" else 0)
    bits = n * DTYPE_BITS[dtype] + groups * meta_bits
    return -(-bits // 8)  # integer ceil: exact at any size


# ---------------------------------------------------------------------------------------------------
# the memory model


@dataclass(frozen=True)
class WeightBytes:
    """Weights held by one GPU, split the way people ask about them."""

    embedding: int
    lm_head: int
    decoder_layers: int
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.decoder_layers + self.final_norm

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ActivationBytes:
    """Transient buffers at the peak of one forward step (see docs: "Activations")."""

    prefill_chunk_tokens: int
    layer_peak: int
    logits: int

    @property
    def total(self) -> int:
        return self.layer_peak + self.logits

    def to_json(self) -> dict[str, int]:
        return {
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "layer_peak_bytes": self.layer_peak,
            "logits_bytes": self.logits,
        }


@dataclass(frozen=True)
class GpuBytes:
    """Everything one GPU must hold; `total` is what is compared with its memory."""

    weights: WeightBytes
    kv: int
    activation: ActivationBytes
    reserve: int

    @property
    def total(self) -> int:
        return self.weights.total + self.kv + self.activation.total + self.reserve

    def to_json(self) -> dict[str, int]:
        return {
            "weights_bytes": self.weights.total,
            "kv_bytes": self.kv,
            "activation_bytes": self.activation.total,
            "reserve_bytes": self.reserve,
            "total_bytes": self.total,
        }


@dataclass(frozen=True)
class MemoryModel:
    """Bytes for one GPU holding `layers` decoder layers of the model, sharded `tp` ways.

    The single-GPU plan is `gpu(tp=1)` with every layer, the embedding and the lm_head; tensor and
    pipeline parallel plans ask for shards and slices of the same formulas.
    """

    spec: ModelSpec
    dtypes: ResolvedDtypes
    opts: VramPlanOptions
    # per (tp, sparse layer?, ep): one layer's bytes (MoE layers have hundreds of expert Linears)
    _layer_cache: dict[tuple[int, bool, int], int] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BITS[self.dtypes.compute] // 8

    @property
    def unquantized_bytes(self) -> int:
        """Embeddings, lm_head, norms and biases: the weight dtype if it is a float, else 16-bit."""
        w = self.dtypes.weight
        return DTYPE_BITS[w] // 8 if w in FLOAT_DTYPES else self.compute_bytes

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """TP splits KV heads; past num_kv_heads they are replicated, so every GPU keeps >= 1."""
        return max(1, self.spec.num_kv_heads // tp)

    def layer_linear_shapes(self, tp: int = 1, layer: int = 0, ep: int = 1) -> dict[str, tuple[int, int]]:
        """(out, in) of each Linear shard of decoder layer `layer`: column-parallel split `out`,
        row-parallel split `in`. A sparse (MoE) layer's experts are TP-sharded along their
        intermediate size like the dense MLP (vLLM's default); under expert parallelism (`ep` > 1, vLLM
        `--enable-expert-parallel`) each GPU instead holds ceil(experts / ep) whole experts."""
        s = self.spec
        q, kv, inter = s.q_size // tp, self.kv_heads_per_gpu(tp) * s.head_dim, s.intermediate_size // tp
        h = s.hidden_size
        shapes = {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
        }
        mlps: list[tuple[str, int]] = []
        if not s.is_moe_layer(layer):
            mlps.append(("mlp", inter))
        else:
            experts = -(-s.num_experts // ep) if ep > 1 else s.num_experts
            width = s.moe_intermediate_size if ep > 1 else s.moe_intermediate_size // tp
            mlps += [(f"mlp.experts.{e}", width) for e in range(experts)]
            if s.shared_expert_intermediate_size:
                mlps.append(("mlp.shared_expert", s.shared_expert_intermediate_size // tp))
        for prefix, m in mlps:
            shapes.update({f"{prefix}.gate_proj": (m, h), f"{prefix}.up_proj": (m, h), f"{prefix}.down_proj": (h, m)})
        return shapes

    def layer_weight_bytes(self, tp: int = 1, layer: int = 0, ep: int = 1) -> int:
        """One decoder layer's shard: quantizable Linears plus 16-bit norms (replicated), biases and
        (MoE) the router and shared-expert gate, which stay 16-bit and are replicated."""
        key = (tp, self.spec.is_moe_layer(layer), ep)
        if key not in self._layer_cache:
            shapes = self.layer_linear_shapes(tp, layer, ep)
            if key[1]:  # all experts have one shape: count one and multiply
                one = {k: v for k, v in shapes.items() if not k.startswith("mlp.experts.") or
                       k.startswith("mlp.experts.0.")}
                n_experts = sum(1 for k in shapes if k.startswith("mlp.experts.") and k.endswith(".down_proj"))
            else:
                one, n_experts = shapes, 1
            linear = 0
            for name, (o, i) in one.items():
                b = linear_weight_bytes(o, i, self.dtypes.weight, self.dtypes.group_size)
                linear += b * (n_experts if name.startswith("mlp.experts.") else 1)
            s = self.spec
            bias = (s.q_size // tp + 2 * self.kv_heads_per_gpu(tp) * s.head_dim) if s.attention_bias else 0
            other = s.layer_norm_params() + bias + s.layer_router_params(layer)
            self._layer_cache[key] = linear + other * self.unquantized_bytes
        return self._layer_cache[key]

    def decoder_layer_bytes(self, tp: int = 1, layers: int | None = None, ep: int = 1) -> int:
        """`layers` decoder layers' shards (all of them by default). For a slice (a pipeline stage) of a
        model whose layers differ (Qwen's mlp_only_layers) it is the slice's share of the total, rounded up."""
        s = self.spec
        sparse = len(s.moe_layers)
        first_dense = next((i for i in range(s.num_layers) if not s.is_moe_layer(i)), None)
        dense_bytes = self.layer_weight_bytes(tp, first_dense, ep) if first_dense is not None else 0
        sparse_bytes = self.layer_weight_bytes(tp, s.moe_layers[0], ep) if sparse else 0
        total = (s.num_layers - sparse) * dense_bytes + sparse * sparse_bytes
        n = s.num_layers if layers is None else layers
        return total if n == s.num_layers else -(-total * n // s.num_layers)

    def weights(
        self, tp: int = 1, layers: int | None = None, embedding: bool = True, lm_head: bool = True, ep: int = 1
    ) -> WeightBytes:
        """Weights on one GPU. Embedding and lm_head are vocab-parallel under TP (split `tp` ways).

        Tied embeddings are stored once when the same GPU holds both ends; a pipeline's last stage
        keeps its own copy of a tied lm_head (as vLLM does).
        """
        s = self.spec
        n_layers = s.num_layers if layers is None else layers
        b = self.unquantized_bytes
        rows = -(-s.vocab_size // tp)  # vocab rows per TP rank (ceil)
        head_rows = rows if lm_head and (not s.tie_word_embeddings or not embedding) else 0
        return WeightBytes(
            embedding=rows * s.hidden_size * b if embedding else 0,
            lm_head=head_rows * s.hidden_size * b,
            decoder_layers=self.decoder_layer_bytes(tp, n_layers, ep),
            final_norm=s.hidden_size * b if lm_head else 0,
        )

    def kv_bytes_per_token(self, tp: int = 1, layers: int | None = None) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes, plus int8's per-head fp16 scales."""
        n_layers = self.spec.num_layers if layers is None else layers
        per_head = self.spec.head_dim * DTYPE_BITS[self.dtypes.kv] // 8
        if self.dtypes.kv == "int8":
            per_head += KV_INT8_SCALE_BYTES
        return 2 * n_layers * self.kv_heads_per_gpu(tp) * per_head

    def sliding_layers(self, layers: int | None = None) -> int:
        """How many of `layers` (a pipeline stage's share; all by default) are sliding-window layers.
        Layer types interleave (Gemma 3: 5 of every 6), so a stage holds its proportional share."""
        s = self.spec
        sliding = sum(1 for i in range(s.num_layers) if s.attention_window(i) is not None)
        n = s.num_layers if layers is None else layers
        return math.ceil(sliding * n / s.num_layers)

    def kv_bytes(self, seq_len: int, tp: int = 1, layers: int | None = None) -> int:
        """KV of one sequence of `seq_len` tokens. A sliding-window layer keeps only its last `window`
        tokens, as vLLM and llama.cpp do (they free the blocks behind the window), so for Gemma 3 the
        context grows the KV of 1 layer in 6. llmopt's own engine still keeps the whole context."""
        n = self.spec.num_layers if layers is None else layers
        per_layer = self.kv_bytes_per_token(tp, 1)
        slide = self.sliding_layers(layers)
        window = self.spec.sliding_window or seq_len
        return per_layer * ((n - slide) * seq_len + slide * min(seq_len, window))

    def activation(self, seq_len: int, batch: int, tp: int = 1, logits: bool = True) -> ActivationBytes:
        """Peak transient memory of one step: the widest point of a layer over a prefill chunk, plus
        the logits of one sampled token per sequence (see docs: "Activations")."""
        s = self.spec
        a = self.compute_bytes
        tokens = min(seq_len * batch, self.opts.max_num_batched_tokens)
        q = s.q_size // tp
        attn_width = q + 2 * self.kv_heads_per_gpu(tp) * s.head_dim + q  # fused QKV out + attention out
        mlp_width = 3 * (s.intermediate_size // tp)  # fused gate_up out (2I) + act(gate) * up (I)
        if s.is_moe:  # per token: router logits, k gathered rows (hidden) + their expert's 3 x I', shared expert
            routed = s.num_experts_per_tok * (s.hidden_size + 3 * (s.moe_intermediate_size // tp))
            routed += s.num_experts + 3 * (s.shared_expert_intermediate_size // tp)
            mlp_width = max(routed, mlp_width if len(s.moe_layers) < s.num_layers else 0)
        layer_peak = tokens * a * (2 * s.hidden_size + max(attn_width, mlp_width))  # + residual, hidden
        logit_bytes = batch * s.vocab_size * (a + 4 * LOGITS_FP32_COPIES) if logits else 0
        return ActivationBytes(prefill_chunk_tokens=tokens, layer_peak=layer_peak, logits=logit_bytes)

    def reserve(self, used: int, multi_gpu: bool = False) -> int:
        """Framework reserve: fixed CUDA context + a share for fragmentation (+ comm buffers)."""
        o = self.opts
        return (
            o.reserve_fixed_bytes
            + math.ceil(used * o.reserve_percent / 100)
            + (o.comm_reserve_bytes if multi_gpu else 0)
        )

    def gpu(
        self,
        seq_len: int,
        batch: int,
        tp: int = 1,
        layers: int | None = None,
        embedding: bool = True,
        lm_head: bool = True,
        multi_gpu: bool = False,
        ep: int = 1,
    ) -> GpuBytes:
        """Everything one GPU holds while `batch` sequences of `seq_len` tokens are resident (`ep`:
        experts split over that many GPUs, see `layer_linear_shapes`)."""
        w = self.weights(tp, layers, embedding, lm_head, ep)
        kv = self.kv_bytes(seq_len, tp, layers) * batch
        act = self.activation(seq_len, batch, tp, logits=lm_head)
        return GpuBytes(weights=w, kv=kv, activation=act, reserve=self.reserve(w.total + kv + act.total, multi_gpu))


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 62) -> int:
    """Largest n >= 1 with fits(n) for a monotone predicate (0 when even 1 does not fit).

    Doubling then bisection: ~2 log2(n) evaluations, so exact answers stay cheap for huge GPUs.
    """
    if not fits(1):
        return 0
    lo = 1
    while lo < limit and fits(min(lo * 2, limit)):
        lo = min(lo * 2, limit)
    hi = min(lo * 2, limit + 1)  # fits(lo) is true, fits(hi) is false (or hi is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
