"""The GPU memory bill of serving a model: weights, KV cache, activations and a framework reserve.

Every number is computed from the `ModelSpec` and the options; nothing is looked up in a table of
known models. The formulas (and why they were chosen) are in docs/VRAM_PLAN.md; the code keeps the
same names so the two can be read side by side.

Layout: `llmopt.planning.memory` holds what is shared: `VramPlanOptions` validates the user's input,
`MemoryModel` turns (spec, resolved dtypes) into bytes for one GPU holding some slice of the model.
Here `resolve_dtypes` applies `auto`, `plan_vram` builds the single-GPU plan plus the
recommendations, and `llmopt.planning.parallel` reuses `MemoryModel` for tensor/pipeline/data
parallel layouts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmopt.errors import LlmoptError
from llmopt.group_size import check_group_size, default_group_size
from llmopt.models.spec import ModelSpec
from llmopt.planning.memory import (
    CHECKPOINT_DTYPES,
    DTYPE_BITS,
    FLOAT_DTYPES,
    INT_WEIGHT_DTYPES,
    GpuBytes,
    MemoryModel,
    ResolvedDtypes,
    VramPlanOptions,
    largest_fitting,
)
from llmopt.planning.parallel import ParallelPlan, plan_parallel, smallest_fitting_ep, smallest_fitting_tp
from llmopt.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

# ---------------------------------------------------------------------------------------------------
# dtypes


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
        widths = quantized_in_features(spec)
        group = opts.group_size
        if group is None:  # auto: per-channel int8 (W8A16); int4 g128, else 64/32, else per channel
            group = -1 if weight == "int8" else (default_group_size(widths.values()) or -1)
        check_group_size(widths, group)
    return ResolvedDtypes(weight=weight, kv=kv, compute=compute, group_size=group)


def quantized_in_features(spec: ModelSpec) -> dict[str, int]:
    """Input sizes of the quantized Linears: groups run along the input dimension."""
    sizes = {"hidden": spec.hidden_size, "attention": spec.q_size}
    if len(spec.moe_layers) < spec.num_layers:  # some layer has the dense MLP
        sizes["intermediate"] = spec.intermediate_size
    if spec.is_moe:
        sizes["expert intermediate"] = spec.moe_intermediate_size
        if spec.shared_expert_intermediate_size:
            sizes["shared expert intermediate"] = spec.shared_expert_intermediate_size
    return sizes


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
        return asdict(self)


@dataclass(frozen=True)
class VramPlan:
    """The single-GPU memory bill, how much work fits, the parallel plan and the advice."""

    model: str
    spec: ModelSpec
    opts: VramPlanOptions
    dtypes: ResolvedDtypes
    params: int
    active_params: int  # read per token: MoE counts only the routed top-k experts (= params when dense)
    gpu: GpuBytes
    kv_bytes_per_token: int  # every layer's K and V of one token (a full-attention layer's share x layers)
    kv_bytes_per_sequence: int  # one sequence of opts.seq_len tokens: sliding layers hold at most their window
    fits: bool
    max_concurrent_sequences: int
    max_seq_len_at_batch: int
    parallel: ParallelPlan | None
    recommendations: list[Recommendation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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
            "active_params_per_token": self.active_params,
            "moe": None if not self.spec.is_moe else {
                "num_experts": self.spec.num_experts, "experts_per_token": self.spec.num_experts_per_tok,
                "sparse_layers": len(self.spec.moe_layers),
                "shared_expert": bool(self.spec.shared_expert_intermediate_size)},
            "weights_fraction_of_weights_plus_kv": self.gpu.weights.total / max(1, self.gpu.weights.total
                                                                              + self.kv_bytes_total),
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
        active_params=spec.active_params(),
        gpu=gpu,
        kv_bytes_per_token=model.kv_bytes_per_token(),
        kv_bytes_per_sequence=model.kv_bytes(opts.seq_len),
        fits=gpu.total <= gpu_mem,
        max_concurrent_sequences=largest_fitting(lambda b: model.gpu(opts.seq_len, b).total <= gpu_mem),
        max_seq_len_at_batch=largest_fitting(lambda n: model.gpu(n, opts.batch).total <= gpu_mem),
        parallel=plan_parallel(model, opts.num_gpus) if opts.num_gpus > 1 else None,
        warnings=warnings,
    )
    tp_fit = None if plan.fits else smallest_fitting_tp(model, gpu_mem)
    ep_fit = None if plan.fits else smallest_fitting_ep(model, gpu_mem)
    return replace(plan, recommendations=recommend(plan, model, tp_fit, ep_fit))


def recommend(
    plan: VramPlan, model: MemoryModel, tp_fit: tuple[int, int] | None = None,
    ep_fit: tuple[int, int] | None = None,
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
        group = opts.group_size
        if group is not None:  # the user's size where it fits, else 128/64/32, else per channel
            group = default_group_size(quantized_in_features(spec).values(), group) or -1
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
    if not plan.fits and ep_fit is not None:
        ep, per_gpu = ep_fit
        add(
            "expert_parallel",
            f"split the experts over {ep} GPUs with expert parallelism, attention TP={ep} (vLLM "
            f"--tensor-parallel-size {ep} --enable-expert-parallel); the saving is per GPU",
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
    slide = plan.spec.sliding_window if plan.spec.layer_types else None
    n_slide = sum(t == "sliding_attention" for t in plan.spec.layer_types)
    kv_note = f"{format_bytes(plan.kv_bytes_per_token)}/token × {o.seq_len} × {o.batch}"
    if slide is not None and o.seq_len > slide:
        kv_note = (f"{format_bytes(plan.kv_bytes_per_sequence)}/sequence × {o.batch}: {n_slide}/{plan.spec.num_layers}"
                   f" sliding layers hold ≤ {slide} tokens")
    table.add_row("KV cache", format_bytes(plan.kv_bytes_total), kv_note)
    table.add_row("activations", format_bytes(act.total),
                  f"layer peak @{act.prefill_chunk_tokens} tok + logits")
    table.add_row("reserve", format_bytes(g.reserve),
                  f"{format_bytes(o.reserve_fixed_bytes)} CUDA ctx + {o.reserve_percent:g}% fragm.")
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(plan.total_bytes)}[/]",
                  f"{100 * plan.total_bytes / o.gpu_memory_bytes:.0f}% of the GPU")
    console.print(table)
    if plan.spec.is_moe:
        s = plan.spec
        console.print(f"MoE: {s.num_experts} experts, {s.num_experts_per_tok} per token"
                      f"{' + a shared expert' if s.shared_expert_intermediate_size else ''} on "
                      f"{len(s.moe_layers)}/{s.num_layers} layers · params total {plan.params:,}, active per "
                      f"token {plan.active_params:,} ({100 * plan.active_params / plan.params:.0f}%): every expert "
                      "stays resident, decode reads only the active ones")
    if slide is not None and o.seq_len > slide:
        full = plan.kv_bytes_per_token * o.seq_len * o.batch
        console.print(f"sliding window: KV {format_bytes(plan.kv_bytes_total)} against {format_bytes(full)} if every "
                      f"layer kept all {o.seq_len} tokens ({100 * plan.kv_bytes_total / full:.0f}%; what vLLM and "
                      "llama.cpp keep; llmopt's own engine still keeps the whole context)")
    wkv = g.weights.total + plan.kv_bytes_total
    console.print(f"weights {format_bytes(g.weights.total)} ({100 * g.weights.total / max(1, wkv):.0f}%) vs KV cache "
                  f"{format_bytes(plan.kv_bytes_total)} ({100 * plan.kv_bytes_total / max(1, wkv):.0f}%)")

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
