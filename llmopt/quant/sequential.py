"""Quantize a model layer by layer over calibration data (true-sequential GPTQ, AWQ, SmoothQuant).

For each decoder layer, in order:

1. capture: run the layer (float weights, but fed by the already-quantized layers before it) over the
   whole calibration set with hooks on its linears, accumulating what each method needs — the GPTQ
   Hessian, per-channel |x| maxima (SmoothQuant) and a strided sample of input rows (AWQ searches,
   error report). The forward stops at down_proj's input, the last thing needed.
2. transform: SmoothQuant (w8a8 targets) and AWQ (int weight-only targets) scale input channels and
   fold 1/s into the producer the model class declares (`CausalLM.quant_producers`; llama:
   input_layernorm → q|k|v, post_attention_layernorm → gate|up, up_proj rows → down_proj). o_proj is skipped: with GQA, the heads that share one v row would need tied scales.
   GPTQ Hessians are transformed exactly (H' = H / s sᵀ), so GPTQ can run on smoothed weights.
3. quantize every linear of the layer (GPTQ / AWQ clip + RTN / RTN / fp8).
4. propagate: rerun the layer with the quantized weights to produce the next layer's inputs, recording
   the per-head K (after RoPE) and V maxima the layer writes to its cache (INT8 KV-cache scales).

Mixture-of-Experts layers: the hooks sit on every expert's linears, so each expert is calibrated on
exactly the tokens the router sends it (GPTQ Hessian, AWQ samples). An expert that the calibration set
routes fewer than `min_expert_tokens` tokens to (default: its input width, the hidden size; below that
its Hessian XᵀX is rank-deficient and GPTQ would rest on dampening alone) gets a warning, and its
statistics are collected again from every calibration token of the layer, the block output still
using only the routed ones (`SparseMoeBlock.calibrate_all`). That is llm-compressor's "calibrate all
experts" for the experts that need it: still GPTQ/AWQ (not RTN) and a full-rank Hessian, from the
same distribution the router chooses from (the post-attention norm output), while well-covered
experts keep their true routed inputs. AWQ scales an expert's down_proj inputs into its own up_proj
rows; expert gate|up inputs are not scaled (the norm feeding them also feeds the router and every other
expert), so they get AWQ's clip search only. Routers stay float (`CausalLM.float_linears`).

Each linear goes by the run's method, or by its own (`Target.method`: `--scheme auto --method auto` gives each
GPTQ or AWQ, whichever its search measured less damage for); an AWQ linear's scales fold into its producer
whatever the method of the linear that producer is (a GPTQ gate|up takes down_proj's 1/s in its up rows).

Without calibration data (plain RTN, fp8) only step 3 runs. Forward passes use `forward_dtype`
(bf16 by default: ~3x faster on CPUs with bf16 units); every quantization computation is float32.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import llmopt.native as native
from llmopt.calibrate.forward import InputHook, KVObserver, embed_batches, layer_copy, run_layer
from llmopt.layers.linear import output_splits
from llmopt.layers.moe import SparseMoeBlock
from llmopt.models.base import CausalLM
from llmopt.quant.awq import (
    awq_search_clip,
    awq_search_scales,
    fold_scales_into_linear_rows,
    fold_scales_into_norm,
    scale_linear_inputs,
)
from llmopt.quant.fp8 import fp8_quantize
from llmopt.quant.gptq import GPTQ, gptq_quantize
from llmopt.quant.observers import ChannelStats
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.smoothquant import smoothing_scales
from llmopt.quant.targets import Target

SAMPLE_TOKENS = 512  # input rows kept per linear for AWQ searches and the error report

_EXPERT_DOWN = re.compile(r"^(mlp\.(?:experts\.\d+|shared_expert))\.down_proj$")


def scaled_producers(model: CausalLM, layer_targets) -> dict[str, tuple[str, str | None]]:
    """The linears AWQ / SmoothQuant scale, each with the op that takes 1/s: the model class's `quant_producers`
    plus, for MoE layers, each expert's (and the shared expert's) up_proj rows → its down_proj."""
    out = dict(type(model).quant_producers)
    for rel in layer_targets:
        m = _EXPERT_DOWN.match(rel)
        if m:
            out[rel] = (f"{m.group(1)}.gate_up_proj", "up_proj")
    return out


@dataclass
class SequentialOptions:
    method: str = "rtn"  # rtn | gptq | awq, or auto: each target's own (`Target.method`, chosen by the search)
    act_order: bool = True  # GPTQ only (issue #32: without it GPTQ lost to RTN on SmolLM2)
    static_groups: bool = True
    mse: bool = True  # GPTQ: ranges by the importance-weighted shrink search (gptq.range_weights), else min/max
    damp: float = 0.01
    block_size: int = 128
    smoothquant_alpha: float = 0.5
    forward_dtype: torch.dtype = torch.bfloat16
    batch_tokens: int = 4096
    min_expert_tokens: int | None = None  # None: the hidden size (see the module doc)


@dataclass
class QuantizedModule:
    """One quantized linear: its weight, float bias and how well it reproduces the original."""

    target: Target
    qw: QuantizedWeight
    bias: torch.Tensor | None
    method: str
    weight_rel_err: float
    output_rel_err: float | None = None
    gptq_loss: float | None = None
    seconds: float = 0.0


@dataclass
class SequentialResult:
    modules: dict[str, QuantizedModule]
    k_absmax: torch.Tensor | None  # [layers, kv_heads]
    v_absmax: torch.Tensor | None
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # e.g. experts calibrated on every token
    final_stream: torch.Tensor | None = None  # [keep_final, hidden] the last layer's residual stream, first tokens


class _Capture:
    """What step 1 records for one linear."""

    def __init__(self, in_features: int, gptq: bool, smooth: bool, stride: int, product_dtype: torch.dtype,
                 device) -> None:
        self.hessian = GPTQ(in_features, device, product_dtype) if gptq else None
        self.channels = ChannelStats(in_features) if smooth else None
        self.stride = stride
        self.rows: list[torch.Tensor] = []
        self.tokens = 0

    def __call__(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        self.tokens += x.shape[0]
        if self.hessian is not None:
            self.hessian.add_batch(x)
        if self.channels is not None:
            self.channels.update(x)
        self.rows.append(x[:: self.stride].float().cpu())

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)[:SAMPLE_TOKENS]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _output_rel_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    ref = x @ w.t()
    return _rel(x @ w_hat.t(), ref)


class SequentialQuantizer:
    """Runs the four steps (module doc) over every decoder layer of `model` (master weights fp32)."""

    def __init__(self, model: CausalLM, targets: list[Target], options: SequentialOptions,
                 windows: torch.Tensor | None, observe_kv: bool = False,
                 load_layer: Callable[[int], None] | None = None,
                 layer_done: Callable[[int, dict[str, QuantizedModule]], None] | None = None,
                 after_embedding: Callable[[], None] | None = None, keep_final: int = 0) -> None:
        """Streamed (`load_layer` and `layer_done` given): layer i's weights are filled by `load_layer(i)` just
        before it is processed, and its quantized modules go to `layer_done(i, modules)` (which may free the
        layer) instead of the result, so one layer at a time is in memory; `after_embedding()` runs once the
        calibration windows are embedded (the embedding may be freed then). `keep_final`: how many of the first
        calibration tokens' final residual stream (the quantized model's) to return (`--scheme auto` measures
        its KL from it)."""
        self.model = model
        self.load_layer, self.layer_done, self.after_embedding = load_layer, layer_done, after_embedding
        self.targets = {t.module: t for t in targets}
        self.opt = options
        self.windows = windows
        self.observe_kv = observe_kv
        self.keep_final = keep_final
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []

    def _time(self, stage: str, start: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start

    def _method(self, t: Target) -> str:
        return t.method or self.opt.method

    def _needs_capture(self, layer_targets: dict[str, Target]) -> bool:
        return self.windows is not None and any(
            t.scheme and (self._method(t) != "rtn" or t.scheme.int8_activations)
            for t in layer_targets.values())

    @torch.no_grad()
    def run(self, progress: Callable[..., None] | None = None) -> SequentialResult:
        spec = self.model.spec
        modules: dict[str, QuantizedModule] = {}
        cache = KVObserver(spec.num_layers, spec.num_kv_heads)
        batches = None
        if self.windows is not None:
            t0 = time.perf_counter()
            per_batch = max(1, self.opt.batch_tokens // self.windows.shape[1])
            batches = embed_batches(self.model, self.windows, per_batch, self.opt.forward_dtype)
            self._time("forward", t0)
            if self.after_embedding is not None:
                self.after_embedding()
        for i, layer in enumerate(self.model.layers):
            if self.load_layer is not None:
                self.load_layer(i)
            prefix = f"layers.{i}."
            layer_targets = {name[len(prefix):]: t for name, t in self.targets.items()
                             if name.startswith(prefix) and t.scheme is not None}
            captures: dict[str, _Capture] = {}
            if batches is not None and self._needs_capture(layer_targets):
                captures = self._capture(layer, layer_targets, batches, f"layers.{i}")
            self._transform(layer, layer_targets, captures)
            # each capture (a Hessian: 0.8 GB for an 8B down_proj) is dropped once its module is quantized
            done = {t.module: self._quantize(layer.get_submodule(rel), t, captures.pop(rel, None))
                    for rel, t in layer_targets.items()}
            del captures
            if batches is not None:
                t0 = time.perf_counter()
                fwd = layer_copy(layer, self.opt.forward_dtype)
                for rel, t in layer_targets.items():
                    fwd.get_submodule(rel).weight.data = done[t.module].qw.dequantize(self.opt.forward_dtype)
                run_layer(fwd, batches, cache)
                del fwd
                self._time("forward", t0)
            if self.layer_done is not None:
                self.layer_done(i, done)
            else:
                modules.update(done)
            del done  # streamed: layer i's modules (0.2 GB at 8B) are not held through layer i+1's quantize
            if progress:
                progress(i)
        kv = (cache.k_absmax, cache.v_absmax) if batches is not None and self.observe_kv else (None, None)
        final = None
        if batches is not None and self.keep_final:
            parts, n = [], 0
            for b in batches:
                if n >= self.keep_final:
                    break
                parts.append(b.stream[: self.keep_final - n].float())
                n += parts[-1].shape[0]
            final = torch.cat(parts)
        return SequentialResult(modules, kv[0], kv[1], self.timings, self.notes, final)

    def _capture(self, layer: nn.Module, layer_targets: dict[str, Target], batches,
                 layer_name: str = "layer") -> dict[str, _Capture]:
        t0 = time.perf_counter()
        fwd = layer_copy(layer, self.opt.forward_dtype)
        total = sum(b.num_tokens for b in batches)
        stride = max(1, total // SAMPLE_TOKENS)
        dev = next(layer.parameters()).device
        captures = {rel: _Capture(t.in_features, self._method(t) == "gptq", bool(t.scheme and t.scheme.int8_activations),
                                  stride, self.opt.forward_dtype, dev)
                    for rel, t in layer_targets.items()}
        mods = {rel: fwd.get_submodule(rel) for rel in captures}
        last = "mlp.down_proj" if "mlp.down_proj" in mods else None
        with InputHook(mods, lambda rel, x: captures[rel](x), stop_at=last).installed():
            run_layer(fwd, batches, KVObserver(len(self.model.layers), self.model.spec.num_kv_heads),
                      update=False)
        self._recapture_starved_experts(fwd, captures, batches, stride, layer_name)
        self._time("capture", t0)
        return captures

    def _recapture_starved_experts(self, fwd: nn.Module, captures: dict[str, _Capture], batches,
                                   stride: int, layer_name: str) -> None:
        """The module doc's fallback: experts routed too few tokens are captured again on all of them."""
        minimum = self.opt.min_expert_tokens
        for prefix, block in fwd.named_modules():
            if not isinstance(block, SparseMoeBlock):
                continue
            need = block.gate.in_features if minimum is None else minimum
            starved = {}
            for e in range(block.num_experts):
                rels = [r for r in captures if r.startswith(f"{prefix}.experts.{e}.")]
                if rels and captures[rels[0]].tokens < need:
                    starved[e] = (captures[rels[0]].tokens, rels)
            if not starved:
                continue
            note = (f"{layer_name}.{prefix}: experts {', '.join(map(str, starved))} were routed fewer than {need} calibration "
                    f"tokens ({', '.join(str(n) for n, _ in starved.values())}); calibrated on all "
                    f"{sum(b.num_tokens for b in batches)} tokens of the layer instead")
            warnings.warn(note, stacklevel=2)
            self.notes.append(note)
            rels = [r for _, rs in starved.values() for r in rs]
            for r in rels:
                old = captures[r]
                captures[r] = _Capture(fwd.get_submodule(r).in_features, old.hessian is not None,
                                       old.channels is not None, stride, self.opt.forward_dtype,
                                       next(fwd.parameters()).device)
            block.calibrate_all = frozenset(starved)
            try:
                with InputHook({r: fwd.get_submodule(r) for r in rels}, lambda rel, x: captures[rel](x)).installed():
                    run_layer(fwd, batches, KVObserver(len(self.model.layers), self.model.spec.num_kv_heads),
                              update=False)
            finally:
                block.calibrate_all = frozenset()

    def _transform(self, layer: nn.Module, layer_targets: dict[str, Target], captures: dict[str, _Capture]) -> None:
        """SmoothQuant / AWQ channel scaling, folded into the producers (step 2)."""
        t0 = time.perf_counter()
        scaled = False
        for rel, (producer, part) in scaled_producers(self.model, layer_targets).items():
            t = layer_targets.get(rel)
            cap = captures.get(rel)
            if t is None or cap is None or t.scheme is None:
                continue
            lin = layer.get_submodule(rel)
            w = lin.weight.data.float()
            if t.scheme.int8_activations:
                assert cap.channels is not None
                s = smoothing_scales(cap.channels.absmax.to(w.device), w, self.opt.smoothquant_alpha)
            elif self._method(t) == "awq" and t.scheme.weights.kind == "int":
                s, _ = awq_search_scales(cap.sample().to(w.device), [w], t.scheme.weights)
            else:
                continue
            scaled = True
            s = s.to(w.device)
            lin.weight.data = scale_linear_inputs(lin.weight.data, s)
            prod = layer.get_submodule(producer)
            if part is None:
                prod.weight.data = fold_scales_into_norm(prod.weight.data, s, getattr(prod, "weight_offset", 0.0))
            else:
                lo, hi = output_splits(prod)[part]
                prod.weight.data[lo:hi] = fold_scales_into_linear_rows(prod.weight.data[lo:hi], s)
                if getattr(prod, "bias", None) is not None:
                    prod.bias.data[lo:hi] = prod.bias.data[lo:hi] / s.to(prod.bias.dtype)
            cap.rows = [r / s.cpu()[None, :] for r in cap.rows]
            cap.channels = None  # stale after scaling; not used again
            if cap.hessian is not None:
                sd = s.to(cap.hessian.H.device).float()
                cap.hessian.H.div_(sd[:, None] * sd[None, :])
        if scaled:
            self._time("smoothquant/awq scales", t0)

    def _quantize(self, lin: nn.Module, t: Target, cap: _Capture | None) -> QuantizedModule:
        t0 = time.perf_counter()
        scheme = t.scheme
        assert scheme is not None
        w = lin.weight.data.float()
        bias = None if getattr(lin, "bias", None) is None else lin.bias.data.clone()
        ws = scheme.weights
        loss = None
        method = "rtn"
        if ws.kind == "fp8":
            qw = fp8_quantize(w, ws)
        elif self._method(t) == "gptq" and cap is not None and cap.hessian is not None:
            method = "gptq"
            qw, loss = gptq_quantize(w, [cap.hessian.take()], ws, damp=self.opt.damp, block_size=self.opt.block_size,
                                     act_order=self.opt.act_order,
                                     static_groups=self.opt.act_order and self.opt.static_groups,
                                     mse_observer=self.opt.mse)
        elif self._method(t) == "awq" and cap is not None and not scheme.int8_activations:
            method = "awq"
            max_val = awq_search_clip(cap.sample().to(w.device), w, ws)
            qw = rtn_quantize(w, ws, max_val=max_val)
        else:
            qw = rtn_quantize(w, ws)
        w_hat = qw.dequantize()
        out_err = _output_rel_err(cap.sample().to(w.device), w, w_hat) if cap is not None else None
        weight_err = _rel(w_hat, w)
        del w_hat
        native.trim_heap()  # GPTQ's Hessian inverse and blocks, the dequantized copy: freed, and given back
        seconds = time.perf_counter() - t0
        self._time(f"quantize ({method})", t0)
        return QuantizedModule(t, qw, bias, method, weight_err, out_err, loss, seconds)
