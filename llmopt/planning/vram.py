"""The GPU memory bill of serving a model: weights, KV cache, activations and a framework reserve.

Every number is computed from the `ModelSpec` and the options; nothing is looked up in a table of
known models. The formulas (and why they were chosen) are in docs/VRAM_PLAN.md; the code keeps the
same names so the two can be read side by side.

Layout: `VramPlanOptions` validates the user's input, `MemoryModel` turns (spec, resolved dtypes) into
bytes for one GPU holding some slice of the model, `plan_vram` builds the single-GPU plan plus the
recommendations, and `llmopt.planning.parallel` reuses `MemoryModel` for tensor/pipeline/data
parallel layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmopt.errors import LlmoptError
from llmopt.models.spec import ModelSpec
from llmopt.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from llmopt.planning.parallel import ParallelPlan

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

    @field_validator("seq_len")
    @classmethod
    def _seq_len(cls, v: int) -> int:
        return _at_least(v, 1, "--seq-len")

    @field_validator("batch")
    @classmethod
    def _batch(cls, v: int) -> int:
        return _at_least(v, 1, "--batch")

    @field_validator("num_gpus")
    @classmethod
    def _num_gpus(cls, v: int) -> int:
        return _at_least(v, 1, "--num-gpus")

    @field_validator("gpu_memory_bytes")
    @classmethod
    def _gpu_memory(cls, v: int) -> int:
        return _at_least(v, 1, "--gpu-memory (bytes)")


# ---------------------------------------------------------------------------------------------------
# dtypes


@dataclass(frozen=True)
class ResolvedDtypes:
    """The concrete dtypes after `auto`: `compute` is what activations (and 16-bit leftovers) use."""

    weight: str
    kv: str
    compute: str
    group_size: int | None  # None unless weights are int8/int4


def resolve_dtypes(spec: ModelSpec, opts: VramPlanOptions) -> ResolvedDtypes:
    """Apply `auto`: weights keep the checkpoint dtype; KV follows the compute dtype.

    Quantized weights (int8/int4/fp8) still run 16-bit activations: bf16 for a bf16 checkpoint,
    fp16 otherwise (vLLM's `--dtype auto` rule: fp16 for fp32 and fp16 models, bf16 for bf16 ones).
    """
    checkpoint = CHECKPOINT_DTYPES.get(spec.dtype)
    if opts.weight_dtype == "auto":
        if checkpoint is None:
            raise LlmoptError(
                f"checkpoint dtype {spec.dtype!r} is not float32, float16 or bfloat16; "
                "pass --weight-dtype explicitly"
            )
        weight = checkpoint
    else:
        weight = opts.weight_dtype
    compute = weight if weight in FLOAT_DTYPES else ("bf16" if checkpoint == "bf16" else "fp16")
    kv = compute if opts.kv_dtype == "auto" else opts.kv_dtype
    group = None
    if weight in INT_WEIGHT_DTYPES:
        group = opts.group_size
        if group is None:  # auto: per-channel int8 (W8A16), g128 int4 or the largest size that divides
            group = -1 if weight == "int8" else default_group_size(spec, 128)
        check_group_size(spec, group)
    return ResolvedDtypes(weight=weight, kv=kv, compute=compute, group_size=group)


def quantized_in_features(spec: ModelSpec) -> dict[str, int]:
    """Input sizes of the quantized Linears: groups run along the input dimension."""
    return {"hidden": spec.hidden_size, "attention": spec.q_size, "intermediate": spec.intermediate_size}


def valid_group_sizes(spec: ModelSpec) -> list[int]:
    """Group sizes that split every quantized Linear's input evenly (divisors >= 16 when any exist)."""
    g = math.gcd(*quantized_in_features(spec).values())
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    return [d for d in divisors if d >= 16] or [d for d in divisors if d > 1] or divisors


def check_group_size(spec: ModelSpec, group_size: int) -> None:
    """Kernels (Marlin, Machete, exllama) need whole groups; say which sizes would work instead."""
    if group_size == -1:
        return
    sizes = quantized_in_features(spec)
    if any(n % group_size for n in sizes.values()):
        shown = ", ".join(f"{name} {n}" for name, n in sizes.items() if name != "attention" or n != sizes["hidden"])
        valid = ", ".join(str(g) for g in valid_group_sizes(spec))
        raise LlmoptError(
            f"--group-size {group_size} does not divide the quantized layers' input sizes ({shown}); "
            f"valid group sizes here: {valid}, or -1 (per channel)"
        )


def default_group_size(spec: ModelSpec, preferred: int) -> int:
    """The user's group size if it fits this model, else the largest power of two <= 128 that does."""
    if preferred == -1 or all(n % preferred == 0 for n in quantized_in_features(spec).values()):
        return preferred
    for g in (128, 64, 32):
        if all(n % g == 0 for n in quantized_in_features(spec).values()):
            return g
    return -1


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
        return {
            "embedding": self.embedding,
            "lm_head": self.lm_head,
            "decoder_layers": self.decoder_layers,
            "final_norm": self.final_norm,
        }


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

    def layer_linear_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(out, in) of each Linear shard: column-parallel split `out`, row-parallel split `in`."""
        s = self.spec
        q, kv, inter = s.q_size // tp, self.kv_heads_per_gpu(tp) * s.head_dim, s.intermediate_size // tp
        h = s.hidden_size
        return {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }

    def layer_weight_bytes(self, tp: int = 1) -> int:
        """One decoder layer's shard: quantizable Linears plus 16-bit norms (replicated) and biases."""
        linear = sum(
            linear_weight_bytes(o, i, self.dtypes.weight, self.dtypes.group_size)
            for o, i in self.layer_linear_shapes(tp).values()
        )
        s = self.spec
        bias = (s.q_size // tp + 2 * self.kv_heads_per_gpu(tp) * s.head_dim) if s.attention_bias else 0
        return linear + (2 * s.hidden_size + bias) * self.unquantized_bytes

    def weights(
        self, tp: int = 1, layers: int | None = None, embedding: bool = True, lm_head: bool = True
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
            decoder_layers=n_layers * self.layer_weight_bytes(tp),
            final_norm=s.hidden_size * b if lm_head else 0,
        )

    def kv_bytes_per_token(self, tp: int = 1, layers: int | None = None) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes, plus int8's per-head fp16 scales."""
        n_layers = self.spec.num_layers if layers is None else layers
        per_head = self.spec.head_dim * DTYPE_BITS[self.dtypes.kv] // 8
        if self.dtypes.kv == "int8":
            per_head += KV_INT8_SCALE_BYTES
        return 2 * n_layers * self.kv_heads_per_gpu(tp) * per_head

    def activation(self, seq_len: int, batch: int, tp: int = 1, logits: bool = True) -> ActivationBytes:
        """Peak transient memory of one step: the widest point of a layer over a prefill chunk, plus
        the logits of one sampled token per sequence (see docs: "Activations")."""
        s = self.spec
        a = self.compute_bytes
        tokens = min(seq_len * batch, self.opts.max_num_batched_tokens)
        q = s.q_size // tp
        attn_width = q + 2 * self.kv_heads_per_gpu(tp) * s.head_dim + q  # fused QKV out + attention out
        mlp_width = 3 * (s.intermediate_size // tp)  # fused gate_up out (2I) + act(gate) * up (I)
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
    ) -> GpuBytes:
        """Everything one GPU holds while `batch` sequences of `seq_len` tokens are resident."""
        w = self.weights(tp, layers, embedding, lm_head)
        kv = self.kv_bytes_per_token(tp, layers) * seq_len * batch
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


# ---------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Recommendation:
    """One step of the OOM checklist; `saves_bytes` is measured against the current plan alone."""

    kind: str
    action: str
    saves_bytes: int
    total_bytes_after: int
    fits_after: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "action": self.action,
            "saves_bytes": self.saves_bytes,
            "total_bytes_after": self.total_bytes_after,
            "fits_after": self.fits_after,
        }


@dataclass(frozen=True)
class VramPlan:
    """The single-GPU memory bill, how much work fits, the parallel plan and the advice."""

    model: str
    spec: ModelSpec
    opts: VramPlanOptions
    dtypes: ResolvedDtypes
    params: int
    gpu: GpuBytes
    kv_bytes_per_token: int
    fits: bool
    max_concurrent_sequences: int
    max_seq_len_at_batch: int
    parallel: ParallelPlan | None
    recommendations: list[Recommendation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_sequence(self) -> int:
        return self.kv_bytes_per_token * self.opts.seq_len

    @property
    def kv_bytes_total(self) -> int:
        return self.kv_bytes_per_sequence * self.opts.batch

    @property
    def total_bytes(self) -> int:
        return self.gpu.total

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: exact byte counts, resolved dtypes and the assumptions used."""
        o = self.opts
        return {
            "model": self.model,
            "params": self.params,
            "weight_dtype": self.dtypes.weight,
            "group_size": self.dtypes.group_size,
            "kv_dtype": self.dtypes.kv,
            "compute_dtype": self.dtypes.compute,
            "seq_len": o.seq_len,
            "batch": o.batch,
            "num_gpus": o.num_gpus,
            "weights_bytes": self.gpu.weights.total,
            "weights_breakdown": self.gpu.weights.to_json(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "kv_bytes_total": self.kv_bytes_total,
            "activation_bytes": self.gpu.activation.total,
            "activation_breakdown": self.gpu.activation.to_json(),
            "reserve_bytes": self.gpu.reserve,
            "total_bytes": self.total_bytes,
            "gpu_memory_bytes": o.gpu_memory_bytes,
            "free_bytes": o.gpu_memory_bytes - self.total_bytes,
            "fits": self.fits,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "max_seq_len_at_batch": self.max_seq_len_at_batch,
            "max_position_embeddings": self.spec.max_position_embeddings,
            "parallel": None if self.parallel is None else self.parallel.to_json(),
            "recommendations": [r.to_json() for r in self.recommendations],
            "warnings": list(self.warnings),
            "assumptions": {
                "max_num_batched_tokens": o.max_num_batched_tokens,
                "reserve_fixed_bytes": o.reserve_fixed_bytes,
                "reserve_percent": o.reserve_percent,
                "comm_reserve_bytes": o.comm_reserve_bytes,
                "tight_fraction": o.tight_fraction,
                "quantized": "decoder Linears only; embeddings, lm_head, norms and biases stay 16-bit",
                "int4": "asymmetric: fp16 scale + packed 4-bit zero per group",
                "int8": "symmetric: fp16 scale per group (per output channel with group_size -1)",
                "fp8": "one fp32 scale per Linear; KV: per-tensor scales (negligible)",
                "kv_int8": "one fp16 scale per token per KV head, for K and V",
            },
        }


def plan_vram(spec: ModelSpec, opts: VramPlanOptions, model_name: str = "") -> VramPlan:
    """Build the plan for `batch` sequences of `seq_len` tokens on one GPU (and on `num_gpus`)."""
    from llmopt.planning import parallel  # imported here: parallel builds on MemoryModel, defined above

    model = MemoryModel(spec, resolve_dtypes(spec, opts), opts)
    gpu = model.gpu(opts.seq_len, opts.batch)
    gpu_mem = opts.gpu_memory_bytes
    warnings = []
    if opts.seq_len > spec.max_position_embeddings:
        warnings.append(
            f"seq_len {opts.seq_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}: quality past that length is not guaranteed"
        )
    plan = VramPlan(
        model=model_name,
        spec=spec,
        opts=opts,
        dtypes=model.dtypes,
        params=spec.num_params(),
        gpu=gpu,
        kv_bytes_per_token=model.kv_bytes_per_token(),
        fits=gpu.total <= gpu_mem,
        max_concurrent_sequences=largest_fitting(lambda b: model.gpu(opts.seq_len, b).total <= gpu_mem),
        max_seq_len_at_batch=largest_fitting(lambda n: model.gpu(n, opts.batch).total <= gpu_mem),
        parallel=parallel.plan_parallel(model, opts.num_gpus) if opts.num_gpus > 1 else None,
        warnings=warnings,
    )
    tp_fit = None if plan.fits else parallel.smallest_fitting_tp(model, gpu_mem)
    return replace(plan, recommendations=recommend(plan, model, tp_fit))


def recommend(
    plan: VramPlan, model: MemoryModel, tp_fit: tuple[int, int] | None = None
) -> list[Recommendation]:
    """The OOM checklist, in order: 16-bit weights, int8 then int4 weights (when weights dominate),
    an 8-bit KV cache, a max-length cap, a concurrency cap, then tensor parallelism.

    Nothing is advised when the plan fits with headroom (total <= tight_fraction of the GPU). Each
    saving is measured against the current plan on its own, not cumulatively. `tp_fit` is the
    smallest (TP degree, per-GPU total) that fits, when the caller found one.
    """
    spec, opts, dt = plan.spec, plan.opts, plan.dtypes
    gpu_mem = opts.gpu_memory_bytes
    total = plan.total_bytes
    if plan.fits and total <= opts.tight_fraction * gpu_mem:
        return []
    recs: list[Recommendation] = []

    def add(kind: str, action: str, after: int) -> None:
        if total - after > 0:
            recs.append(Recommendation(kind, action, total - after, after, after <= gpu_mem))

    def options_with(weight: str, kv: str) -> VramPlanOptions:
        group = opts.group_size if opts.group_size is None else default_group_size(spec, opts.group_size)
        return opts.model_copy(update={"weight_dtype": weight, "kv_dtype": kv, "group_size": group})

    def total_with(weight: str, kv: str) -> int:
        o = options_with(weight, kv)
        return MemoryModel(spec, resolve_dtypes(spec, o), o).gpu(opts.seq_len, opts.batch).total

    if plan.gpu.weights.total >= plan.kv_bytes_total:  # weights dominate: shrink them first
        half = "bf16" if CHECKPOINT_DTYPES.get(spec.dtype) == "bf16" else "fp16"
        steps = [
            ("weights_16bit", half, 16, f"serve the weights in {half} (--weight-dtype {half}, vLLM --dtype {half})"),
            ("weights_int8", "int8", 8, "quantize weights to int8 (W8A16; fp8 on Ada/Hopper is the same size)"),
            ("weights_int4", "int4", 4, "quantize weights to int4 (AWQ/GPTQ W4A16)"),
        ]
        for kind, target, bits, action in steps:
            if DTYPE_BITS[dt.weight] > bits:
                group = resolve_dtypes(spec, options_with(target, dt.kv)).group_size
                suffix = ""
                if target in INT_WEIGHT_DTYPES:
                    suffix = ", per channel" if group == -1 else f", group size {group}"
                add(kind, action + suffix, total_with(target, dt.kv))
    if DTYPE_BITS[dt.kv] > 8:
        int8_saves = total - total_with(dt.weight, "int8")
        add(
            "kv_fp8",
            "use an FP8 KV cache (--kv-dtype fp8, vLLM --kv-cache-dtype fp8); "
            f"int8 with per-token scales saves {format_bytes(int8_saves)}",
            total_with(dt.weight, "fp8"),
        )
    if not plan.fits and 0 < plan.max_seq_len_at_batch < opts.seq_len:
        n = plan.max_seq_len_at_batch
        add(
            "cap_seq_len",
            f"cap the sequence length at {n} tokens (vLLM --max-model-len {n})",
            model.gpu(n, opts.batch).total,
        )
    if not plan.fits and 0 < plan.max_concurrent_sequences < opts.batch:
        n = plan.max_concurrent_sequences
        add(
            "cap_batch",
            f"run at most {n} concurrent sequence{'' if n == 1 else 's'} (vLLM --max-num-seqs {n})",
            model.gpu(opts.seq_len, n).total,
        )
    if not plan.fits and tp_fit is not None:
        tp, per_gpu = tp_fit
        add(
            "tensor_parallel",
            f"shard over {tp} GPUs with tensor parallelism (--num-gpus {tp}, vLLM "
            f"--tensor-parallel-size {tp}); the saving is per GPU",
            per_gpu,
        )
    return recs


# ---------------------------------------------------------------------------------------------------
# rendering


def render_vram_plan(plan: VramPlan, console: Console) -> None:
    """Summary table, a green/red fit line, the parallel plan, then numbered recommendations.

    Sized for an 80-column terminal: the exact byte counts live in `--json`.
    """
    from rich.markup import escape
    from rich.table import Table

    o, dt, g = plan.opts, plan.dtypes, plan.gpu
    weights = dt.weight
    if dt.group_size is not None:
        weights += " per-channel" if dt.group_size == -1 else f" g{dt.group_size}"
    console.print(f"[bold]{escape(plan.model or 'model')}[/]: {plan.params:,} params · weights {weights} · "
                  f"KV {dt.kv} · {o.seq_len} tokens × {o.batch} seq · GPU {format_bytes(o.gpu_memory_bytes)}")
    table = Table()
    table.add_column("component")
    table.add_column("size", justify="right")
    table.add_column("how it is counted", style="dim")
    if dt.weight in FLOAT_DTYPES:
        w_note = f"{plan.params:,} × {DTYPE_BITS[dt.weight] // 8} B"
    else:
        w_note = f"{weights} layers (+ scales); rest {dt.compute}"
    act = g.activation
    table.add_row("weights", format_bytes(g.weights.total), w_note)
    table.add_row("KV cache", format_bytes(plan.kv_bytes_total),
                  f"{format_bytes(plan.kv_bytes_per_token)}/token × {o.seq_len} × {o.batch}")
    table.add_row("activations", format_bytes(act.total),
                  f"layer peak @{act.prefill_chunk_tokens} tok + logits")
    table.add_row("reserve", format_bytes(g.reserve),
                  f"{format_bytes(o.reserve_fixed_bytes)} CUDA ctx + {o.reserve_percent:g}% fragm.")
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(plan.total_bytes)}[/]",
                  f"{100 * plan.total_bytes / o.gpu_memory_bytes:.0f}% of the GPU")
    console.print(table)

    free = o.gpu_memory_bytes - plan.total_bytes
    if plan.fits:
        console.print(f"[green]fits on one GPU[/]: {format_bytes(free)} free")
    else:
        console.print(f"[red]does not fit on one GPU[/]: {format_bytes(-free)} short")
    console.print(f"max concurrent sequences of {o.seq_len} tokens: [bold]{plan.max_concurrent_sequences}[/]; "
                  f"longest sequence at batch {o.batch}: [bold]{plan.max_seq_len_at_batch}[/] tokens")
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    if plan.parallel is not None:
        plan.parallel.render(console)
    if plan.recommendations:
        console.print("[bold]Recommendations[/] (OOM checklist order; each saving vs. this plan):")
        for i, r in enumerate(plan.recommendations, 1):
            verdict = "[green]fits[/]" if r.fits_after else "[red]still too big[/]"
            console.print(f"  {i}. {escape(r.action)}: saves {format_bytes(r.saves_bytes)} "
                          f"→ {format_bytes(r.total_bytes_after)} ({verdict})")
    elif plan.fits:
        console.print("[dim]no recommendations: the plan fits with headroom[/]")
