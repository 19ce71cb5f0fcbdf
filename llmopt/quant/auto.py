"""`--scheme auto --target-bits B`: each linear's precision chosen under a bits-per-weight budget (issue #32).

Streamed like `quantize` itself, one decoder layer in memory at a time:

1. Damage. On a sample of the calibration windows (the first `SAMPLE_TOKENS` tokens; `--auto-tokens`) every decoder layer
   runs in the forward dtype. For each linear it quantizes and each candidate scheme, that linear alone
   is quantized by the method the quantize will use (RTN; with `--method gptq`, GPTQ on a Hessian; with
   `--method awq`, AWQ's scale and clip searches on the linear's inputs; with `--method auto`, both, as two
   options of the same size, so the allocation takes the better per linear), the layer runs again, and
   the per-token squared change of the residual stream the layer writes, ‖δ_t‖², is kept. The unquantized
   stream then goes on to the next layer. GPTQ's Hessian and AWQ's inputs come from the next windows as
   many (the fit set), not from the sample the damage is measured on: a method fitted to the very tokens
   that judge it looks better than it does on held-out text (GPTQ's error feedback most: measured on
   SmolLM2, docs/QUANTIZE.md). With no windows beyond the sample, both come from the sample.
2. Prediction. The final norm and head turn that stream into next-token distributions, and the trace
   of each token's Fisher information with respect to the final residual stream, tr F_t, is estimated from
   the gradients of sampled tokens' log-probabilities. A perturbation that reaches the end along the
   residual path, in no preferred direction, costs KL_t ≈ ½ ‖δ_t‖² tr F_t / d (second order in δ).
   What the later layers do to a change on its way is measured once per layer: a depth probe (the
   layer's linears all at their cheapest candidate, on the first `PROBE_TOKENS` tokens) travels through
   the rest of the model as the layers stream past, and its real KL at the end over the KL the formula
   gives it is the layer's gain, which multiplies the predictions of its linears. Averaged over tokens,
   that is each (linear, candidate)'s predicted KL; summed over linears, the model's.
3. Allocation. Under the budget (the average stored bits per weight over the searched linears, scales
   and zero points included), a greedy multiple-choice knapsack over each linear's lower convex hull of
   (bits, predicted KL) takes the upgrades that remove the most predicted KL per bit first.

With `--lm-head auto` the output head (a tied one: the embedding it shares) is one more item of the
knapsack, its weights counted in the budget: bf16, int8 per row or int4 in groups of 32, whose KL is not
predicted but measured, on the same sample's final stream, with the head rounded as the export rounds it.
(A tied embedding's lookups are rounded too; that part of the damage is in neither KL.)

`quantize` then runs as usual with every linear's chosen scheme (the export writes one config group per
scheme) and measures the real KL of the result against step 1's stream on the same sample
(`measured_kl`), which the report sets beside the prediction.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from llmopt.calibrate.forward import (
    CalibBatch,
    InputHook,
    KVObserver,
    embed_batches,
    layer_copy,
    residual_stream,
)
from llmopt.errors import LlmoptError
from llmopt.group_size import is_valid_group_size
from llmopt.models.base import CausalLM
from llmopt.quant.awq import awq_search_clip, awq_search_scales, scale_linear_inputs
from llmopt.quant.fp8 import fp8_quantize
from llmopt.quant.gptq import GPTQ, GPTQFactor, gptq_factor, gptq_quantize
from llmopt.quant.head_kl import HeadAccess, fisher_trace, mean_kl
from llmopt.quant.recipe import SEARCHED_METHODS, ModuleScheme, candidate_scheme
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.sequential import scaled_producers
from llmopt.quant.targets import Target

SAMPLE_TOKENS = 2048  # calibration tokens the damage is measured on by default (the first windows)
PROBE_TOKENS = 512  # tokens each layer's depth probe carries to the end (the first windows of the sample)
HEAD = "lm_head"  # the head's key among the plan's options (`--lm-head auto`)


def stored_bits(scheme: ModuleScheme | None, in_features: int) -> float:
    """Bits a weight costs in the checkpoint: the code, plus its group's scale (and zero point) shared out."""
    if scheme is None:
        return 16.0
    w = scheme.weights
    group = in_features if w.per_channel else w.group_size
    scale_bits = torch.finfo(w.torch_scale_dtype).bits if w.kind == "int" else 32
    zero_bits = 0 if w.symmetric else w.bits
    return w.bits + (scale_bits + zero_bits) / group


@dataclass
class Option:
    """One candidate for one linear: its scheme (None: float), bits per weight and predicted KL; `method`: the
    quantizer it is measured and quantized with under `--method auto` (None: the run's)."""

    candidate: str
    scheme: ModuleScheme | None
    bits: float
    kl: float = 0.0
    method: str | None = None

    @property
    def label(self) -> str:
        return self.candidate if self.method is None else f"{self.candidate} {self.method}"


@dataclass
class AutoPlan:
    """The search's result: every searched linear's options and choice, and what the choice predicts."""

    target_bits: float
    options: dict[str, list[Option]]  # our module name -> its options
    weights: dict[str, int]  # our module name -> number of weights
    choice: dict[str, Option] = field(default_factory=dict)
    sample_tokens: int = 0
    seconds: float = 0.0
    reference: torch.Tensor | None = None  # [T, hidden] the unquantized final residual stream of the sample
    measured_kl: float | None = None
    gains: list[float] = field(default_factory=list)  # per decoder layer: real KL at the end / the formula's

    @property
    def bits(self) -> float:
        total = sum(self.weights.values())
        return sum(self.choice[m].bits * n for m, n in self.weights.items()) / total

    @property
    def predicted_kl(self) -> float:
        return sum(o.kl for o in self.choice.values())

    @classmethod
    def for_targets(cls, model: CausalLM, targets: list[Target], candidates: list[str], symmetric: bool,
                    target_bits: float, head: dict[str, ModuleScheme | None] | None = None,
                    methods: tuple[str, ...] = ()) -> AutoPlan:
        """The options and weight counts of `targets` that carry a scheme, from the model's shapes alone (the
        meta device will do), nothing measured yet; raises when a linear has no candidate. `head`: the head's
        candidates by name (`--lm-head auto`), or None to leave it out; `methods`: each int candidate once per
        method (`--method auto`), else once."""
        searched = [t for t in targets if t.scheme is not None]
        options = {t.module: candidate_options(t, candidates, symmetric, methods) for t in searched}
        missing = [t for t in searched if not options[t.module]]
        if missing:
            raise LlmoptError(f"no candidate's group size divides the input width {missing[0].in_features} of "
                              f"{next(iter(missing[0].parts))}; add w8a16 or bf16 to --candidates")
        weights = {t.module: model.get_submodule(t.module).weight.numel() for t in searched}
        if head:
            hidden = model.spec.hidden_size
            options[HEAD] = [Option(name, sch, stored_bits(sch, hidden)) for name, sch in head.items()
                             if _fits(sch, hidden)]
            weights[HEAD] = model.spec.vocab_size * hidden
        return cls(target_bits, options, weights)

    def head_scheme(self) -> ModuleScheme | None:
        """The head's chosen scheme (None: kept float, or not searched)."""
        o = self.choice.get(HEAD)
        return None if o is None else o.scheme

    def reallocate(self, target_bits: float) -> None:
        """Choose again, from the same measurements, under another budget."""
        self.target_bits = target_bits
        self.choice = allocate(self.options, self.weights, target_bits)
        self.measured_kl = None

    def bounds(self) -> tuple[float, float]:
        """The average bits of the cheapest choice everywhere, and of the dearest quantized one everywhere."""
        total = sum(self.weights.values())
        lo = sum(min(o.bits for o in self.options[m]) * n for m, n in self.weights.items()) / total
        hi = sum(max((o.bits for o in self.options[m] if o.scheme is not None), default=16.0) * n
                 for m, n in self.weights.items()) / total
        return lo, hi

    def apply(self, targets: list[Target]) -> list[Target]:
        """`targets` with each searched linear's chosen scheme (a float choice: unquantized, stored in bf16)."""
        out = []
        for t in targets:
            o = None if t.module == HEAD else self.choice.get(t.module)  # the head goes by `head_scheme`
            if o is None:
                out.append(t)
            else:
                out.append(replace(t, scheme=o.scheme, store_dtype=torch.bfloat16 if o.scheme is None else None,
                                   method=o.method))
        return out

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for o in self.choice.values():
            counts[o.label] = counts.get(o.label, 0) + 1
        return {
            "target_bits": self.target_bits, "bits": round(self.bits, 4), "sample_tokens": self.sample_tokens,
            "predicted_kl": self.predicted_kl, "measured_kl": self.measured_kl, "choices": counts,
            "seconds": round(self.seconds, 2), "depth_gains": [round(g, 3) for g in self.gains],
            "modules": [{"module": m, "choice": o.label, "bits": round(o.bits, 4), "predicted_kl": o.kl,
                         "options": {x.label: x.kl for x in self.options[m]}}
                        for m, o in self.choice.items()],
        }


def _fits(scheme: ModuleScheme | None, in_features: int) -> bool:
    """Whether `scheme` can quantize a weight `in_features` wide (float and per-channel always can; a group size
    must be valid for the width)."""
    return scheme is None or scheme.weights.per_channel or is_valid_group_size([in_features],
                                                                               scheme.weights.group_size)


def candidate_options(target: Target, candidates: list[str], symmetric: bool,
                      methods: tuple[str, ...] = ()) -> list[Option]:
    """The candidates valid for this linear (a group size must divide its input width), each int one once per
    method in `methods` (`--method auto`; fp8 and float ones once)."""
    out = []
    for name in candidates:
        scheme = candidate_scheme(name, symmetric)
        if not _fits(scheme, target.in_features):
            continue
        bits = stored_bits(scheme, target.in_features)
        per_method = methods if scheme is not None and scheme.weights.kind == "int" else ()
        out.extend([Option(name, scheme, bits, method=m) for m in per_method] or [Option(name, scheme, bits)])
    return out


def allocate(options: dict[str, list[Option]], weights: dict[str, int], target_bits: float) -> dict[str, Option]:
    """The choice per linear with the least total predicted KL whose average bits stay within `target_bits`:
    greedy over each linear's lower convex hull of (bits, KL), best KL saved per bit first."""
    total = sum(weights.values())
    budget = target_bits * total
    hulls = {m: _lower_hull(opts) for m, opts in options.items()}
    at = {m: 0 for m in hulls}
    spent = sum(h[0].bits * weights[m] for m, h in hulls.items())
    if spent > budget * (1 + 1e-9):
        raise LlmoptError(f"--target-bits {target_bits:g} is below the cheapest candidates' "
                          f"{spent / total:.3f} bits per weight; raise it or add a smaller candidate")
    heap: list[tuple[float, str]] = []

    def push(m: str) -> None:
        h, i = hulls[m], at[m]
        if i + 1 < len(h):
            gain = (h[i].kl - h[i + 1].kl) / ((h[i + 1].bits - h[i].bits) * weights[m])
            heapq.heappush(heap, (-gain, m))

    for m in hulls:
        push(m)
    while heap:
        _, m = heapq.heappop(heap)
        h, i = hulls[m], at[m]
        cost = (h[i + 1].bits - h[i].bits) * weights[m]
        if spent + cost > budget * (1 + 1e-9):
            continue  # further steps of this linear cost more still
        spent += cost
        at[m] = i + 1
        push(m)
    return {m: hulls[m][i] for m, i in at.items()}


def _lower_hull(opts: list[Option]) -> list[Option]:
    """Options by increasing bits whose KL strictly falls, keeping only the convex ones."""
    pts = []
    for o in sorted(opts, key=lambda o: (o.bits, o.kl)):
        if pts and o.kl >= pts[-1].kl:
            continue  # more bits and no less damage
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            # drop b when the slope a->o is at least as steep as a->b (b is above the segment)
            if (b.kl - a.kl) * (o.bits - a.bits) >= (o.kl - a.kl) * (b.bits - a.bits):
                pts.pop()
            else:
                break
        pts.append(o)
    return pts


def _dequantized(w: torch.Tensor, scheme: ModuleScheme, factor: GPTQFactor | None, x: torch.Tensor | None,
                 scaled: bool, opts: SearchOptions) -> torch.Tensor:
    """`w` [out, in] as the quantize would leave it under `scheme`, dequantized to float32: by GPTQ given its
    Hessian's factor, by AWQ given the linear's inputs `x` [n, in] (input-channel scales searched when `scaled`, and
    undone here: the pipeline folds 1/s into the producer, the same function), else by RTN."""
    ws = scheme.weights
    if ws.kind == "fp8":
        return fp8_quantize(w, ws).dequantize(torch.float32)
    if factor is not None:
        return gptq_quantize(w, factor, ws, damp=opts.damp, block_size=opts.block_size,
                             act_order=opts.act_order, static_groups=opts.act_order and opts.static_groups,
                             mse_observer=opts.mse)[0].dequantize(torch.float32)
    if x is None or scheme.int8_activations:
        return rtn_quantize(w, ws).dequantize(torch.float32)
    s = awq_search_scales(x, [w], ws)[0].to(w.device) if scaled else None
    if s is not None:
        w, x = scale_linear_inputs(w, s), x / s
    deq = rtn_quantize(w, ws, max_val=awq_search_clip(x, w, ws)).dequantize(torch.float32)
    return deq if s is None else deq / s[None, :]


def _run(layer, b: CalibBatch, cache: KVObserver) -> tuple[torch.Tensor, torch.Tensor | None]:
    return layer(b.rope, b.hidden, b.residual, cache, b.meta)


@dataclass
class SearchOptions:
    method: str  # rtn | gptq | awq, or auto: every int candidate measured by both GPTQ and AWQ
    candidates: list[str]
    symmetric: bool
    forward_dtype: torch.dtype
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    static_groups: bool = True
    mse: bool = True  # GPTQ's weighted range search, as the quantize runs it (`--no-mse`: min/max)
    batch_tokens: int = 4096
    sample_tokens: int = SAMPLE_TOKENS
    head: dict[str, ModuleScheme | None] | None = None  # `--lm-head auto`: the head's candidates by name
    head_dtype: torch.dtype | None = None  # an untied head's checkpoint dtype, held so (head_kl.HeadAccess)


@torch.no_grad()
def search(model: CausalLM, targets: list[Target], target_bits: float, windows: torch.Tensor,
           opts: SearchOptions, load: Callable[[str], None], release: Callable[[str], None],
           progress: Callable[..., None] | None = None, into: AutoPlan | None = None) -> AutoPlan:
    """Steps 1-3 of the module doc over `model` (built empty; `load(prefix)` / `release(prefix)` fill and free
    one module), for the `targets` that carry a scheme; returns the plan to `apply` (`into`, filled in
    place, when given)."""
    t0 = time.perf_counter()
    both = SEARCHED_METHODS if opts.method == "auto" else ()
    shapes = AutoPlan.for_targets(model, targets, opts.candidates, opts.symmetric, target_bits, opts.head, both)
    options, weights = shapes.options, shapes.weights
    searched = [t for t in targets if t.module in options]
    allocate(options, weights, target_bits)  # an impossible budget fails before any measuring
    n = max(1, opts.sample_tokens // windows.shape[1])
    sample, fit = windows[:n], windows[n:2 * n]
    per_batch = max(1, opts.batch_tokens // sample.shape[1])
    gptq, awq = opts.method in ("gptq", "auto"), opts.method in ("awq", "auto")
    load("embed_tokens")
    batches = embed_batches(model, sample, per_batch, opts.forward_dtype)
    # the fit set (GPTQ's Hessians, AWQ's inputs): windows the damage is not measured on, when there are any
    fit_batches = embed_batches(model, fit, per_batch, opts.forward_dtype) if (gptq or awq) and len(fit) else []
    release("embed_tokens")
    cache = KVObserver(len(model.layers), model.spec.num_kv_heads)
    cache.enabled = False
    sq_err: dict[tuple[str, int], torch.Tensor] = {}  # (module, index of its option) -> [T] ‖δ_t‖²
    probe = _DepthProbes(model, sample, opts, load, release)
    for i, layer in enumerate(model.layers):
        load(f"layers.{i}")
        prefix = f"layers.{i}."
        mine = {t.module[len(prefix):]: t for t in searched if t.module.startswith(prefix)}
        fwd = layer_copy(layer, opts.forward_dtype)
        dev = next(fwd.parameters()).device
        hessians = {rel: GPTQ(t.in_features, dev, opts.forward_dtype) for rel, t in mine.items()} if gptq else {}
        inputs: dict[str, list[torch.Tensor]] = {rel: [] for rel in mine} if awq else {}
        scaled = scaled_producers(model, mine) if awq else {}

        def record(rel: str, x: torch.Tensor, hessians=hessians, inputs=inputs) -> None:
            if gptq:
                hessians[rel].add_batch(x)
            if awq:
                inputs[rel].append(x.reshape(-1, x.shape[-1]).float())

        hook = InputHook({rel: fwd.get_submodule(rel) for rel in {*hessians, *inputs}}, record)
        with hook.installed():
            for b in fit_batches:  # recorded, and carried on to the next layer unquantized
                b.hidden, b.residual = _run(fwd, b, cache)
        with nullcontext() if fit_batches else hook.installed():  # no fit set: the sample is recorded
            ref = [_run(fwd, b, cache) for b in batches]
        ref_stream = [residual_stream(*r) for r in ref]
        cheapest: dict[str, torch.Tensor] = {}  # rel -> the weight under its cheapest candidate, for the probe
        for rel, t in mine.items():
            lin = fwd.get_submodule(rel)
            kept = lin.weight.data
            w = layer.get_submodule(rel).weight.data.float()
            rows = inputs.pop(rel, None)
            x = torch.cat(rows).to(w.device) if rows else None  # an expert no sampled token reached: RTN
            quantized = [(j, o) for j, o in enumerate(options[t.module]) if o.scheme is not None]
            hessian = hessians.pop(rel) if gptq else None
            # factored once for every GPTQ candidate (up to four grids on one Hessian), and the Hessian freed
            h = gptq_factor([hessian.take()], opts.damp, opts.act_order, w.device) if hessian is not None and any(
                (o.method or opts.method) == "gptq" and o.scheme.weights.kind != "fp8" for _, o in quantized) else None
            del hessian
            low = min((o.bits for _, o in quantized), default=None)
            cheap: dict[int, torch.Tensor] = {}  # the cheapest options' weights (one per method)
            for j, o in quantized:
                method = o.method or opts.method  # auto: the option's; with one method every option's is None
                lin.weight.data = _dequantized(w, o.scheme, h if method == "gptq" else None,
                                               x if method == "awq" else None, rel in scaled,
                                               opts).to(opts.forward_dtype)
                if o.bits == low:
                    cheap[j] = lin.weight.data
                sq_err[(t.module, j)] = torch.cat([
                    (residual_stream(*_run(fwd, b, cache)).float() - s.float()).pow(2).sum(-1)
                    for b, s in zip(batches, ref_stream, strict=True)]).cpu()
            if cheap:  # the probe carries the least damaging of them
                cheapest[rel] = cheap[min(cheap, key=lambda j: float(sq_err[(t.module, j)].sum()))]
            lin.weight.data = kept
            del w, h, x
        probe.step(i, fwd, cheapest, cache)
        del cheapest
        for b, (hidden, residual) in zip(batches, ref, strict=True):
            b.hidden, b.residual = hidden, residual
        del fwd, ref, ref_stream
        release(f"layers.{i}")
        if progress:
            progress(i)
    reference = torch.cat([b.stream for b in batches]).float()
    del batches, fit_batches
    with HeadAccess(model, load, release, opts.head_dtype).loaded():  # the norm and head, once for all three
        fisher = fisher_trace(model, reference) / reference.shape[-1]  # [T] tr F_t / d
        gains = probe.gains(fisher)
        for o in options.get(HEAD, []):
            o.kl = 0.0 if o.scheme is None else mean_kl(model, reference, reference, o.scheme)
    for (m, j), err in sq_err.items():
        options[m][j].kl = 0.5 * float((err * fisher).mean()) * gains[_layer_index(m)]
    plan = into if into is not None else AutoPlan(target_bits, {}, {})
    plan.options, plan.weights, plan.gains = options, weights, gains
    plan.sample_tokens, plan.reference = int(reference.shape[0]), reference
    plan.reallocate(target_bits)
    plan.seconds = time.perf_counter() - t0
    return plan


def _layer_index(module: str) -> int:
    """"layers.7.mlp.down_proj" -> 7."""
    return int(module.split(".")[1])


class _DepthProbes:
    """Per decoder layer, how much a change it makes grows or shrinks on its way through the later layers.

    Layer i's probe is the first `PROBE_TOKENS` tokens of the sample run through layer i with every linear
    at its cheapest candidate; from there it goes through the later layers unquantized, beside an
    unquantized copy of the same tokens, as each layer streams past. At the end, its real KL against the
    copy over ½‖δ‖²·tr F/d of the change it left layer i with is that layer's gain (1 for a layer with no
    searched linear, or a change too small to measure)."""

    def __init__(self, model: CausalLM, sample: torch.Tensor, opts: SearchOptions, load: Callable[[str], None],
                 release: Callable[[str], None]) -> None:
        self.model = model
        windows = sample[: max(1, PROBE_TOKENS // sample.shape[1])]
        load("embed_tokens")
        self.ref = embed_batches(model, windows, windows.shape[0], opts.forward_dtype)[0]
        release("embed_tokens")
        self.probes: dict[int, CalibBatch] = {}  # layer -> its probe, through the layers streamed so far
        self.sq: dict[int, torch.Tensor] = {}  # layer -> [Tp] ‖δ_t‖² it left that layer with

    def step(self, i: int, fwd: torch.nn.Module, cheapest: dict[str, torch.Tensor], cache: KVObserver) -> None:
        """Carry the earlier probes and the copy through layer `fwd` (unquantized), and start layer i's."""
        for b in self.probes.values():
            b.hidden, b.residual = _run(fwd, b, cache)
        out = _run(fwd, self.ref, cache)
        if cheapest:
            kept = {rel: fwd.get_submodule(rel).weight.data for rel in cheapest}
            for rel, w in cheapest.items():
                fwd.get_submodule(rel).weight.data = w
            hidden, residual = _run(fwd, self.ref, cache)
            for rel, w in kept.items():
                fwd.get_submodule(rel).weight.data = w
            self.probes[i] = replace(self.ref, hidden=hidden, residual=residual)
            self.sq[i] = (residual_stream(hidden, residual).float() - residual_stream(*out).float()).pow(2).sum(-1)
        self.ref.hidden, self.ref.residual = out

    def gains(self, fisher: torch.Tensor) -> list[float]:
        """Each layer's gain, given tr F_t / d of the sample's tokens (the probe's are its first); the final
        norm and head loaded."""
        out = [1.0] * len(self.model.layers)
        reference = self.ref.stream.float()
        f = fisher[: reference.shape[0]]
        for i, b in self.probes.items():
            formula = 0.5 * float((self.sq[i].cpu() * f).mean())
            real = mean_kl(self.model, reference, b.stream.float())
            if formula > 0 and math.isfinite(real) and real > 0:
                out[i] = real / formula
        return out


@torch.no_grad()
def measured_kl(model: CausalLM, plan: AutoPlan, final: torch.Tensor, load: Callable[[str], None],
                release: Callable[[str], None], head_dtype: torch.dtype | None = None) -> float:
    """Mean KL(unquantized ‖ quantized) per token on the sample, from the two final residual streams (an untied
    head held in `head_dtype`, as the search holds it)."""
    assert plan.reference is not None
    with HeadAccess(model, load, release, head_dtype).loaded():
        kl = mean_kl(model, plan.reference, final.float(), plan.head_scheme())
    if not math.isfinite(kl):
        raise LlmoptError("the quantized model's KL on the calibration sample is not finite")
    return kl
