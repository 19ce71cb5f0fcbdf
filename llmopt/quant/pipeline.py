"""`llmopt quantize`: model + recipe (+ calibration) → a quantized checkpoint directory, atomically.

Order matters for failing fast: the output directory, the recipe, the target plan, group sizes and
the format's ability to express the plan are all checked before any calibration or quantization work.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from llmopt.calibrate.manifest import MANIFEST, STATS, Manifest, ModelIdentity
from llmopt.calibrate.progress import layer_progress
from llmopt.calibrate.run import CalibrationDataConfig, sample_windows
from llmopt.calibrate.stats import SavedStats
from llmopt.errors import LlmoptError
from llmopt.io import atomic_directory, check_output_dir
from llmopt.layers.attention.kv_codes import LARGEST
from llmopt.models.shards import parse_shard_size
from llmopt.quant.auto import SAMPLE_TOKENS, AutoPlan, SearchOptions, measured_kl, search
from llmopt.quant.deploy import deployment
from llmopt.quant.export import CheckpointExport, head_module, quantization_config
from llmopt.quant.recipe import AUTO, QuantizeConfig
from llmopt.quant.report import ModuleReport, QuantReport
from llmopt.quant.sequential import QuantizedModule, SequentialOptions, SequentialQuantizer

if TYPE_CHECKING:
    from llmopt.models.reader import CheckpointTensors

REPORT = "quantization_report.json"


def _calibration(cfg: QuantizeConfig, resolved, directory: Path, tokenizer,
                 console: Console) -> tuple[torch.Tensor | None, dict | None]:
    """Token windows [N, L] (or None when the recipe needs none) and a description for the report."""
    if cfg.calib is not None:
        manifest = Manifest.read(cfg.calib)
        why = manifest.model.mismatch(ModelIdentity.of(resolved, directory))
        if why:
            raise LlmoptError(f"--calib {cfg.calib} was measured on another model ({why}); recalibrate")
        windows = SavedStats.load(cfg.calib / STATS).windows
        return windows, {"calib_dir": str(cfg.calib), "windows": int(windows.shape[0]),
                         "seq_len": int(windows.shape[1]), "manifest": str(cfg.calib / MANIFEST)}
    if cfg.calib_data:
        data = CalibrationDataConfig(data=cfg.calib_data, num_samples=cfg.num_samples, seq_len=cfg.seq_len,
                                     seed=cfg.seed)
        cs = sample_windows(data, tokenizer, console)
        return cs.windows, {"calib_data": cfg.calib_data, "windows": int(cs.windows.shape[0]),
                            "seq_len": cfg.seq_len, "seed": cfg.seed, "warnings": cs.warnings}
    return None, None


def _check_data_given(cfg: QuantizeConfig) -> None:
    need = cfg.data_need()
    if need is not None and cfg.calib is None and not cfg.calib_data:
        raise LlmoptError(f"{need[0]} needs calibration data: pass --calib DIR (from `llmopt calibrate`) or "
                          "--calib-data PATH")


def _head_dtype(model, checkpoint: CheckpointTensors) -> torch.dtype | None:
    """An untied head's stored float dtype, which the auto search holds it in (None: tied, or not found)."""
    if model.spec.tie_word_embeddings:
        return None
    names = [n for n in checkpoint.names() if type(model).hf_to_ours(n)[0] == "lm_head.weight"]
    return checkpoint.float_dtype(names[0]) if names else None


def _search(cfg: QuantizeConfig, model, targets, windows: torch.Tensor, load, console: Console,
            into: AutoPlan | None, head_dtype: torch.dtype | None, dtype: torch.dtype) -> AutoPlan:
    """`--scheme auto`: measure every candidate of every linear and choose under `--target-bits`."""
    from llmopt.models.loader import release

    opts = SearchOptions(method=cfg.method, candidates=cfg.candidates, symmetric=cfg.symmetric,
                         forward_dtype=dtype, damp=cfg.damp, block_size=cfg.block_size,
                         act_order=bool(cfg.act_order), static_groups=cfg.static_groups, mse=bool(cfg.mse),
                         batch_tokens=cfg.batch_tokens, sample_tokens=cfg.auto_tokens or SAMPLE_TOKENS,
                         head=cfg.head_candidates(), head_dtype=head_dtype)
    assert cfg.target_bits is not None
    with layer_progress(console, "measuring each linear's candidates", len(model.layers)) as advance:
        plan = search(model, targets, cfg.target_bits, windows, opts, load, lambda p: release(model, p), advance,
                      into=into)
    counts = ", ".join(f"{n} {c}" for c, n in sorted(plan.summary()["choices"].items()))
    console.print(f"[cyan]auto:[/] {plan.bits:.3f} bits per weight (target {cfg.target_bits:g}): {counts}; "
                  f"predicted KL {plan.predicted_kl:.4g}", highlight=False)
    return plan


def auto_bounds(cfg: QuantizeConfig) -> tuple[float, float]:
    """`--scheme auto`: the average bits of the cheapest candidate everywhere and of the dearest quantized one
    everywhere, from the model's shapes alone (nothing is read but config.json)."""
    from llmopt.models.loader import build_empty
    from llmopt.models.resolve import resolve_model
    from llmopt.quant.targets import plan_targets

    model = build_empty(resolve_model(cfg.model), torch.float32, "meta")
    targets, _ = plan_targets(model, cfg)
    return AutoPlan.for_targets(model, targets, cfg.candidates, cfg.symmetric, 0.0, cfg.head_candidates()).bounds()


def quantize_model(cfg: QuantizeConfig, console: Console | None = None, plan: AutoPlan | None = None) -> QuantReport:
    """Quantize `cfg.model` as `cfg` says and write `cfg.output`; returns the report written there.

    Streamed: the model is built on the meta device and each decoder layer is read from the checkpoint
    only when it is processed, in float32 on the compute device, then written to the output and freed
    (`SequentialQuantizer`'s load_layer / layer_done). The embeddings are read (in float32) for the
    calibration embedding only; they, the final norm and the head go to the output as the source stores
    them (float32 ones in bf16 by default, the head rounded to int8 with `--lm-head int8`), one tensor at a
    time. So memory holds one layer (plus its calibration activations and
    statistics), never the model: a model larger than the host's memory or the GPU quantizes on it
    (docs/QUANTIZE.md, "How big a model").

    `--scheme auto`: `plan`, when given, holds the measurements to reuse (a gate search quantizes several
    budgets from one search; `auto.search` fills an empty plan in place). `--threads` holds for the whole run
    and is recorded in the report's settings (GPTQ's rounding depends on it)."""
    from llmopt.devices import torch_threads

    with torch_threads(cfg.threads) as threads:
        return _quantize_model(cfg, console, plan, threads)


def _quantize_model(cfg: QuantizeConfig, console: Console | None, plan: AutoPlan | None, threads: int) -> QuantReport:
    from llmopt.devices import forward_dtype, resolve_device
    from llmopt.models.loader import build_empty, fill_module, release
    from llmopt.models.reader import CheckpointTensors
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer
    from llmopt.quant.targets import plan_targets

    console = console or Console(stderr=True)
    started = time.perf_counter()
    check_output_dir(cfg.output, cfg.overwrite)
    _check_data_given(cfg)
    if cfg.calib is not None and not (cfg.calib / MANIFEST).is_file():
        raise LlmoptError(f"--calib {cfg.calib}: no calibration directory there (no {MANIFEST}; run `llmopt calibrate`)")
    resolved = resolve_model(cfg.model)
    if resolved.quantization_config is not None:
        raise LlmoptError(f"{resolved.path} is already quantized; quantize the original model")
    directory = weights_dir(resolved)
    device = resolve_device(cfg.device)
    dtype = forward_dtype(cfg.forward_dtype, device)
    max_shard_bytes = parse_shard_size(cfg.max_shard_size)
    checkpoint = CheckpointTensors(directory)
    model = build_empty(resolved, torch.float32, device)
    targets, notes = plan_targets(model, cfg)
    act_order = bool(cfg.act_order)  # resolved by QuantizeConfig: on for GPTQ unless --no-act-order
    head_scheme = cfg.head_scheme()
    head = None if head_scheme is None else (head_module(resolved.spec.tie_word_embeddings), head_scheme)
    quantization_config(targets, cfg.format, act_order, cfg.damp, cfg.static_groups, cfg.kv_cache, head,
                        cfg.kv_cache_strategy)  # fail early
    tokenizer = load_tokenizer(directory)
    for note in notes:
        console.print(f"[cyan]note:[/] {note}", highlight=False)
    t0 = time.perf_counter()
    windows, calib = _calibration(cfg, resolved, directory, tokenizer, console)
    sample_s = time.perf_counter() - t0
    opts = SequentialOptions(method=cfg.method, act_order=act_order, static_groups=cfg.static_groups,
                             mse=cfg.mse, damp=cfg.damp, block_size=cfg.block_size,
                             smoothquant_alpha=cfg.smoothquant_alpha, forward_dtype=dtype,
                             batch_tokens=cfg.batch_tokens)
    bytes_before = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    load_s = write_s = 0.0
    module_reports: list[ModuleReport] = []

    def load(prefix: str) -> None:
        nonlocal load_s
        t = time.perf_counter()
        fill_module(model, checkpoint, prefix, device)
        load_s += time.perf_counter() - t

    search_s = None
    head_dtype = _head_dtype(model, checkpoint) if cfg.scheme == AUTO else None
    if cfg.scheme == AUTO:
        assert windows is not None and cfg.target_bits is not None
        if plan is None or not plan.options:
            plan = _search(cfg, model, targets, windows, load, console, into=plan, head_dtype=head_dtype, dtype=dtype)
            search_s = plan.seconds
        else:
            plan.reallocate(cfg.target_bits)
        targets = plan.apply(targets)
        if cfg.lm_head == "auto" and plan.head_scheme() is not None:
            head = (head_module(resolved.spec.tie_word_embeddings), plan.head_scheme())
    else:
        plan = None
    with atomic_directory(cfg.output, cfg.overwrite) as tmp:
        export = CheckpointExport(tmp, targets, cfg.format, act_order, cfg.damp, max_shard_bytes,
                                  static_groups=cfg.static_groups, kv_cache=cfg.kv_cache,
                                  kv_strategy=cfg.kv_cache_strategy,
                                  float_dtype=torch.bfloat16 if cfg.float_dtype == "bf16" else None, head=head)

        def layer_done(i: int, modules: dict[str, QuantizedModule]) -> None:
            nonlocal write_s
            t = time.perf_counter()
            module_reports.extend(ModuleReport.of(qm) for qm in modules.values())
            export.add_layer(model, i, modules)
            release(model, f"layers.{i}")
            write_s += time.perf_counter() - t

        if windows is not None:
            load("embed_tokens")  # embed_batches embeds the windows before layer 0; freed once they are
        runner = SequentialQuantizer(model, targets, opts, windows, observe_kv=cfg.kv_cache is not None,
                                     load_layer=lambda i: load(f"layers.{i}"), layer_done=layer_done,
                                     after_embedding=lambda: release(model, "embed_tokens"),
                                     keep_final=plan.sample_tokens if plan else 0)
        with layer_progress(console, f"quantizing ({cfg.scheme}, {cfg.method})", resolved.spec.num_layers) as advance:
            result = runner.run(progress=advance)
        for note in result.notes:
            console.print(f"[yellow]warning:[/] {note}", highlight=False)
        notes = notes + result.notes
        if plan is not None:
            assert result.final_stream is not None
            plan.measured_kl = measured_kl(model, plan, result.final_stream, load, lambda p: release(model, p),
                                           head_dtype)
        kv = None
        if cfg.kv_cache is not None:
            assert result.k_absmax is not None and result.v_absmax is not None
            k, v = result.k_absmax, result.v_absmax
            if cfg.kv_cache == "fp8" and cfg.kv_cache_strategy == "tensor":  # one scale per layer: the largest head's
                k, v = k.amax(1), v.amax(1)
            kv = ((k / LARGEST[cfg.kv_cache]).clamp(min=1e-8), (v / LARGEST[cfg.kv_cache]).clamp(min=1e-8))
        t0 = time.perf_counter()
        shards = export.finish(checkpoint, directory, resolved.config, resolved.spec.tie_word_embeddings, kv)
        timings = {"load weights": load_s, "sample calibration data": sample_s,
                   **({"choose precision (auto)": search_s} if search_s is not None else {}), **result.timings,
                   "write checkpoint": write_s + time.perf_counter() - t0}
        timings["total"] = time.perf_counter() - started
        report = QuantReport(
            model=resolved.source, output=str(cfg.output), format=cfg.format,
            settings=cfg.model_dump(mode="json", exclude={"output", "overwrite"}) | {"threads": threads,
                                                                                "forward_dtype": str(dtype).removeprefix("torch.")},
            calibration=calib,
            modules=module_reports,
            ignored=[hf for t in targets if t.scheme is None for hf in t.parts if head is None or hf != head[0]],
            head=export.head_report,
            timings_s={k: round(v, 3) for k, v in timings.items()},
            bytes_before=bytes_before, bytes_after=sum(f.stat().st_size for f in shards), notes=notes,
            auto=plan.summary() if plan else None,
            deployment=deployment([t.scheme for t in targets if t.scheme is not None], cfg.format,
                                  kv_cache=cfg.kv_cache, kv_strategy=cfg.kv_cache_strategy, moe=resolved.spec.is_moe,
                                  head=None if head is None else
                                  f"head-int{head[1].weights.bits}" + ("-tied" if resolved.spec.tie_word_embeddings else "")))
        report.write(tmp / REPORT)
    return report
