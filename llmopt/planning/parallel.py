"""Splitting a model over GPUs: tensor-parallel shards, pipeline stages and data-parallel replicas.

Per-GPU bytes come from the same `MemoryModel` as the single-GPU plan, asked for a shard (`tp`) and
a slice of layers (a pipeline stage), so both plans always agree. The rules follow vLLM:

* TP splits attention heads, so it must divide num_attention_heads; KV heads are split too, and
  when TP > num_kv_heads they are replicated (TP must then be a multiple of num_kv_heads), so each
  GPU still stores >= 1 KV head. The MLP is split along the intermediate size. Quantized row-parallel
  shards (o_proj, down_proj) must keep whole quantization groups.
* PP splits layers evenly; the remainder goes to the stages before the last one (the last stage
  also holds the final norm and lm_head), as vLLM's `get_pp_indices` does.
* DP replicates the smallest TP x PP layout that fits; each replica keeps its own KV cache.
* MoE models: TP shards every expert along its (small) intermediate size. Expert parallelism (EP, vLLM
  `--tensor-parallel-size N --enable-expert-parallel`) instead gives each of the N GPUs experts / N
  whole experts, while attention stays TP-sharded; it needs the expert count divisible by N, keeps
  each expert matmul full-width and needs no group-size divisibility of the expert shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmopt.models.spec import ModelSpec
from llmopt.planning.memory import GpuBytes, MemoryModel, largest_fitting
from llmopt.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

GPUS_PER_NODE = 8  # TP beyond one NVLink domain pays an inter-node all-reduce in every layer


def tp_problem(spec: ModelSpec, tp: int, group_size: int | None = None) -> str | None:
    """Why tensor parallelism of degree `tp` is impossible for this model, or None when it is fine."""
    if spec.num_heads % tp:
        return f"num_attention_heads={spec.num_heads} is not divisible by {tp}"
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        return f"num_key_value_heads={kv} can be neither split nor replicated evenly over {tp} GPUs"
    mlps = [("down_proj", "intermediate_size", spec.intermediate_size)] if len(spec.moe_layers) < spec.num_layers else []
    if spec.is_moe:
        mlps.append(("expert down_proj", "moe_intermediate_size", spec.moe_intermediate_size))
        if spec.shared_expert_intermediate_size:
            mlps.append(("shared expert down_proj", "shared_expert_intermediate_size",
                         spec.shared_expert_intermediate_size))
    for _, key, size in mlps:
        if size % tp:
            return f"{key}={size} is not divisible by {tp}"
    if group_size is not None and group_size > 0:
        for name, size in (("o_proj", spec.q_size), *((n, v) for n, _, v in mlps)):
            if (size // tp) % group_size:
                return f"the {name} input shard ({size // tp}) is not a multiple of group size {group_size}"
    return None


def ep_problem(spec: ModelSpec, ep: int, group_size: int | None = None) -> str | None:
    """Why expert parallelism over `ep` GPUs (attention TP=`ep`, whole experts split `ep` ways) is
    impossible, or None. Only MoE models have it."""
    if not spec.is_moe:
        return "the model has no experts"
    if spec.num_experts % ep:
        return f"{spec.num_experts} experts do not split evenly over {ep} GPUs"
    if spec.num_heads % ep:
        return f"num_attention_heads={spec.num_heads} is not divisible by {ep}"
    kv = spec.num_kv_heads
    if kv % ep and ep % kv:
        return f"num_key_value_heads={kv} can be neither split nor replicated evenly over {ep} GPUs"
    if group_size is not None and group_size > 0 and (spec.q_size // ep) % group_size:
        return f"the o_proj input shard ({spec.q_size // ep}) is not a multiple of group size {group_size}"
    dense = [("intermediate_size", spec.intermediate_size)] if len(spec.moe_layers) < spec.num_layers else []
    if spec.shared_expert_intermediate_size:
        dense.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    for key, size in dense:  # dense MLPs stay TP-sharded
        if size % ep or (group_size is not None and group_size > 0 and (size // ep) % group_size):
            return f"{key}={size} does not shard over {ep} GPUs"
    return None


def valid_tp_degrees(spec: ModelSpec, max_tp: int, group_size: int | None = None) -> list[int]:
    return [t for t in range(1, max_tp + 1) if tp_problem(spec, t, group_size) is None]


def pipeline_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per stage: an even split, the remainder added to the stages just before the last one."""
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    for i in range(2, extra + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class StagePlan:
    """One GPU of a layout: the layers it holds and its memory bill."""

    stage: int
    first_layer: int
    num_layers: int
    gpu: GpuBytes

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "first_layer": self.first_layer, "num_layers": self.num_layers,
                **self.gpu.to_json()}


@dataclass(frozen=True)
class LayoutPlan:
    """One model replica over tp x pp GPUs; every GPU of a stage holds the same bytes."""

    tp: int
    pp: int
    kv_heads_per_gpu: int
    kv_heads_replicated: bool
    stages: tuple[StagePlan, ...]
    fits: bool
    max_concurrent_sequences: int
    ep: int = 1  # > 1: experts split whole over the tp GPUs (expert parallelism)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def largest_stage(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.gpu.total)

    @property
    def name(self) -> str:
        if self.ep > 1:
            return f"EP={self.ep}"  # attention runs TP=ep
        parts = ([f"TP={self.tp}"] if self.tp > 1 or self.pp == 1 else []) + ([f"PP={self.pp}"] if self.pp > 1 else [])
        return " × ".join(parts)

    def to_json(self) -> dict[str, Any]:
        big = self.largest_stage
        out: dict[str, Any] = {
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "gpus": self.gpus,
            "kv_heads_per_gpu": self.kv_heads_per_gpu,
            "kv_heads_replicated": self.kv_heads_replicated,
            "weights_bytes_per_gpu": big.gpu.weights.total,
            "kv_bytes_per_gpu": big.gpu.kv,
            "activation_bytes_per_gpu": big.gpu.activation.total,
            "reserve_bytes_per_gpu": big.gpu.reserve,
            "total_bytes_per_gpu": big.gpu.total,
            "fits": self.fits,
            "max_concurrent_sequences": self.max_concurrent_sequences,
            "layers_per_stage": [s.num_layers for s in self.stages],
        }
        if self.pp > 1:
            out["largest_stage"] = big.stage
            out["stages"] = [s.to_json() for s in self.stages]
        return out


def plan_layout(model: MemoryModel, tp: int, pp: int, ep: int = 1) -> LayoutPlan:
    """Per-GPU memory of every stage at the requested load, and the most sequences that fit."""
    opts = model.opts
    counts = pipeline_partition(model.spec.num_layers, pp)
    firsts = [sum(counts[:i]) for i in range(pp)]
    multi = tp * pp > 1

    def stage_bytes(batch: int) -> list[GpuBytes]:
        # Stages differ only in (layers, has embedding, has lm_head): compute each kind once.
        cache: dict[tuple[int, bool, bool], GpuBytes] = {}
        out = []
        for i, n in enumerate(counts):
            key = (n, i == 0, i == pp - 1)
            if key not in cache:
                cache[key] = model.gpu(opts.seq_len, batch, tp=tp, layers=n, embedding=key[1],
                                       lm_head=key[2], multi_gpu=multi, ep=ep)
            out.append(cache[key])
        return out

    def fits(batch: int) -> bool:
        return all(g.total <= opts.gpu_memory_bytes for g in stage_bytes(batch))

    stages = tuple(StagePlan(i, firsts[i], counts[i], g) for i, g in enumerate(stage_bytes(opts.batch)))
    return LayoutPlan(
        tp=tp,
        pp=pp,
        kv_heads_per_gpu=model.kv_heads_per_gpu(tp),
        kv_heads_replicated=tp > model.spec.num_kv_heads,
        stages=stages,
        fits=all(s.gpu.total <= opts.gpu_memory_bytes for s in stages),
        max_concurrent_sequences=largest_fitting(fits),
        ep=ep,
    )


def smallest_fitting_tp(model: MemoryModel, gpu_memory_bytes: int) -> tuple[int, int] | None:
    """The smallest valid TP degree > 1 whose per-GPU total fits, with that total (None if none)."""
    opts = model.opts
    for tp in valid_tp_degrees(model.spec, model.spec.num_heads, model.dtypes.group_size)[1:]:
        total = model.gpu(opts.seq_len, opts.batch, tp=tp, multi_gpu=True).total
        if total <= gpu_memory_bytes:
            return tp, total
    return None


def smallest_fitting_ep(model: MemoryModel, gpu_memory_bytes: int) -> tuple[int, int] | None:
    """MoE: the smallest valid expert-parallel degree > 1 whose per-GPU total fits (None if none)."""
    spec, opts = model.spec, model.opts
    if not spec.is_moe:
        return None
    for ep in range(2, spec.num_experts + 1):
        if ep_problem(spec, ep, model.dtypes.group_size) is None:
            total = model.gpu(opts.seq_len, opts.batch, tp=ep, multi_gpu=True, ep=ep).total
            if total <= gpu_memory_bytes:
                return ep, total
    return None


@dataclass(frozen=True)
class ParallelPlan:
    """What `--num-gpus N` buys: TP options, a PP split, DP replicas, and advice."""

    num_gpus: int
    valid_tp_degrees: tuple[int, ...]
    invalid_tp_degrees: dict[int, str]
    tensor_parallel: tuple[LayoutPlan, ...]
    min_tp_that_fits: int | None
    pipeline_parallel: LayoutPlan
    min_pp_that_fits: int | None
    replica: LayoutPlan | None
    advice: tuple[str, ...]
    expert_parallel: tuple[LayoutPlan, ...] = ()  # MoE only: EP at each valid degree up to num_gpus
    invalid_ep_degrees: dict[int, str] | None = None

    @property
    def replicas(self) -> int:
        return self.num_gpus // self.replica.gpus if self.replica else 0

    @property
    def fits(self) -> bool:
        return self.replica is not None

    def data_parallel_json(self) -> dict[str, Any] | None:
        r = self.replica
        if r is None:
            return None
        return {
            "tp": r.tp,
            "pp": r.pp,
            "gpus_per_replica": r.gpus,
            "replicas": self.replicas,
            "idle_gpus": self.num_gpus - self.replicas * r.gpus,
            "max_concurrent_sequences_per_replica": r.max_concurrent_sequences,
            "max_concurrent_sequences_total": r.max_concurrent_sequences * self.replicas,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "num_gpus": self.num_gpus,
            "fits": self.fits,
            "valid_tp_degrees": list(self.valid_tp_degrees),
            "invalid_tp_degrees": {str(k): v for k, v in self.invalid_tp_degrees.items()},
            "min_tp_that_fits": self.min_tp_that_fits,
            "tensor_parallel": [t.to_json() for t in self.tensor_parallel],
            "pipeline_parallel": self.pipeline_parallel.to_json(),
            "min_pp_that_fits": self.min_pp_that_fits,
            "data_parallel": self.data_parallel_json(),
            "expert_parallel": [e.to_json() for e in self.expert_parallel],
            "invalid_ep_degrees": {str(k): v for k, v in (self.invalid_ep_degrees or {}).items()},
            "advice": list(self.advice),
        }

    def render(self, console: Console) -> None:
        """Per-GPU table of the TP options and the PP split, the DP layout, then the advice."""
        from rich.table import Table

        table = Table(title=f"Parallel plan on {self.num_gpus} GPUs (bytes per GPU; PP: largest stage)",
                      title_justify="left")
        for col in ("layout", "KV heads", "weights", "KV cache", "total", "fits", "max seqs"):
            table.add_column(col, justify="left" if col == "layout" else "right")
        for lay in (*self.tensor_parallel, self.pipeline_parallel, *self.expert_parallel):
            g = lay.largest_stage.gpu
            kv = f"{lay.kv_heads_per_gpu}" + (" (rep.)" if lay.kv_heads_replicated else "")
            table.add_row(lay.name, kv, format_bytes(g.weights.total), format_bytes(g.kv), format_bytes(g.total),
                          "[green]yes[/]" if lay.fits else "[red]no[/]", str(lay.max_concurrent_sequences))
        console.print(table)
        pp = self.pipeline_parallel
        counts = [s.num_layers for s in pp.stages]
        lo, hi = min(counts), max(counts)
        split = ", ".join(map(str, counts)) if len(counts) <= GPUS_PER_NODE else (f"{lo}–{hi}" if lo < hi else f"{lo}")
        console.print(f"{pp.name} layers per stage: {split} (stage 0 adds the embedding, the last the lm_head)")
        dp = self.data_parallel_json()
        if dp is not None and self.replica is not None:
            console.print(f"data parallel: {dp['replicas']} × ({self.replica.name}) → up to "
                          f"{dp['max_concurrent_sequences_total']} concurrent sequences")
        for line in self.advice:
            console.print(f"  • {line}")


def plan_parallel(model: MemoryModel, num_gpus: int) -> ParallelPlan:
    """TP at every valid degree up to `num_gpus`, PP over min(num_gpus, layers) stages, and the
    smallest TP x PP replica that fits (TP preferred at equal GPU count, kept inside one node)."""
    spec = model.spec
    group = model.dtypes.group_size
    valid = valid_tp_degrees(spec, num_gpus, group)
    invalid = {t: p for t in range(2, num_gpus + 1) if (p := tp_problem(spec, t, group)) is not None}
    tensor = tuple(plan_layout(model, t, 1) for t in valid)
    min_tp = next((lay.tp for lay in tensor if lay.fits), None)
    max_pp = min(num_gpus, spec.num_layers)
    pipeline = plan_layout(model, 1, max_pp)
    min_pp = next((p for p in range(1, max_pp + 1) if plan_layout(model, 1, p).fits), None)

    replica = None
    node_tps = [t for t in valid if t <= GPUS_PER_NODE]
    for gpus in range(1, min(num_gpus, GPUS_PER_NODE * spec.num_layers) + 1):
        for tp in sorted((t for t in node_tps if gpus % t == 0 and gpus // t <= spec.num_layers), reverse=True):
            lay = plan_layout(model, tp, gpus // tp)
            if lay.fits:
                replica = lay
                break
        if replica is not None:
            break

    ep_invalid: dict[int, str] = {}
    expert: tuple[LayoutPlan, ...] = ()
    if spec.is_moe:
        ep_invalid = {e: p for e in range(2, num_gpus + 1) if (p := ep_problem(spec, e, group)) is not None}
        expert = tuple(plan_layout(model, e, 1, ep=e) for e in range(2, num_gpus + 1) if e not in ep_invalid)
    return ParallelPlan(
        num_gpus=num_gpus,
        valid_tp_degrees=tuple(valid),
        invalid_tp_degrees=invalid,
        tensor_parallel=tensor,
        min_tp_that_fits=min_tp,
        pipeline_parallel=pipeline,
        min_pp_that_fits=min_pp,
        replica=replica,
        advice=tuple(_advice(model, num_gpus, valid, invalid, min_tp, replica)
                     + _expert_advice(model, tensor, expert, ep_invalid)),
        expert_parallel=expert,
        invalid_ep_degrees=ep_invalid,
    )


def _expert_advice(model: MemoryModel, tensor: tuple[LayoutPlan, ...], expert: tuple[LayoutPlan, ...],
                   invalid: dict[int, str]) -> list[str]:
    """MoE: how expert parallelism compares with TP at the same GPU count, and when it is the only way."""
    spec = model.spec
    if not spec.is_moe:
        return []
    lines = []
    by_tp = {t.tp: t for t in tensor}
    for e in expert:
        w = e.largest_stage.gpu.weights.total
        tp = by_tp.get(e.ep)
        vs = (f"vs {format_bytes(tp.largest_stage.gpu.weights.total)} at TP={e.ep}" if tp is not None
              else f"TP={e.ep} is not possible here")
        lines.append(f"EP={e.ep}: {spec.num_experts // e.ep} whole experts per GPU, weights {format_bytes(w)} per GPU "
                     f"({vs}); each expert's matmul keeps its full width {spec.moe_intermediate_size} "
                     f"instead of {spec.moe_intermediate_size // e.ep} (vLLM: --tensor-parallel-size {e.ep} "
                     "--enable-expert-parallel); routing becomes an all-to-all per MoE layer")
    if not expert:
        first = next(iter(invalid.items()), None)
        lines.append("expert parallelism is not possible here" + (f" (EP={first[0]}: {first[1]})" if first else ""))
    return lines


def _advice(
    model: MemoryModel,
    num_gpus: int,
    valid: list[int],
    invalid: dict[int, str],
    min_tp: int | None,
    replica: LayoutPlan | None,
) -> list[str]:
    spec = model.spec
    valid_txt = ", ".join(str(t) for t in valid)
    lines = []
    if replica is None:
        lines.append(f"no TP × PP layout over {num_gpus} GPUs fits (TP ≤ {GPUS_PER_NODE}): quantize weights "
                     "or the KV cache (see recommendations), shorten sequences or add GPUs")
    elif replica.gpus == 1:
        lines.append(f"the model fits on one GPU: run {num_gpus} data-parallel replicas for ~{num_gpus}× the "
                     "throughput; TP only lowers per-token latency")
    else:
        replicas = num_gpus // replica.gpus
        idle = num_gpus - replicas * replica.gpus
        lines.append(f"smallest layout that fits: {replica.name} ({replica.gpus} GPUs per replica) → {replicas} "
                     f"data-parallel replica(s)" + (f", {idle} GPU(s) idle" if idle else ""))
    if min_tp is not None:
        lines.append(f"smallest TP that fits: {min_tp} (valid TP degrees here: {valid_txt})")
    else:
        lines.append(f"no TP degree up to {num_gpus} fits on its own (valid TP degrees here: {valid_txt})")
    in_node = [t for t in invalid if t <= GPUS_PER_NODE]  # the full list is in the JSON
    if in_node:
        lines.append(f"TP not possible at {', '.join(map(str, in_node))} (e.g. TP={in_node[0]}: "
                     f"{invalid[in_node[0]]})")
    kv = spec.num_kv_heads
    if any(t > kv for t in valid):
        lines.append(f"past TP={kv} the {kv} KV heads are replicated (1 per GPU): KV memory per GPU stops "
                     "shrinking")
    lines.append(f"keep TP inside one node (≤{GPUS_PER_NODE} GPUs on NVLink: it all-reduces in every layer), "
                 "use PP across nodes, and DP replicas for more throughput")
    return lines
