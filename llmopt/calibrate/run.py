"""`llmopt calibrate`: sample calibration windows, measure activation statistics, write CALIB_DIR.

The output directory (stats.safetensors + manifest.json) is written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console

from llmopt.calibrate.manifest import MANIFEST, STATS, Manifest, ModelIdentity, data_record
from llmopt.calibrate.overlap import build_eval_index, find_overlaps
from llmopt.calibrate.progress import layer_progress
from llmopt.calibrate.sources import DataSource
from llmopt.calibrate.stats import collect_stats
from llmopt.calibrate.windows import CalibrationSet, build_calibration_set
from llmopt.errors import LlmoptError
from llmopt.io import atomic_directory, check_output_dir


class CalibrationDataConfig(BaseModel):
    """Where calibration windows come from (shared by `calibrate` and `quantize --calib-data`)."""

    model_config = ConfigDict(extra="forbid")

    data: list[str] = Field(min_length=1)
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=2)
    seed: int = 0
    chat_template: bool = False
    eval_data: list[str] = []
    allow_overlap: bool = False

    @field_validator("data")
    @classmethod
    def _parse_specs(cls, v: list[str]) -> list[str]:
        for spec in v:
            DataSource.parse(spec)  # a bad PATH:WEIGHT fails here, before any model loads
        return v

    @property
    def sources(self) -> list[DataSource]:
        return [DataSource.parse(d) for d in self.data]


class CalibrateConfig(CalibrationDataConfig):
    model: str | None = None
    observer: Literal["minmax", "ema", "percentile", "mse"] = "minmax"
    percentile: float = Field(99.9, gt=0, le=100)
    output: Path
    overwrite: bool = False
    device: str = "auto"
    threads: int | None = Field(None, ge=1)  # CPU threads (None: torch's default)
    forward_dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    batch_tokens: int = Field(4096, ge=1)


def sample_windows(cfg: CalibrationDataConfig, tokenizer, console: Console | None = None) -> CalibrationSet:
    """Build the windows and enforce the no-overlap rule against `eval_data`."""
    cs = build_calibration_set(cfg.sources, tokenizer, cfg.num_samples, cfg.seq_len, cfg.seed, cfg.chat_template)
    if cfg.eval_data:
        index = build_eval_index(cfg.eval_data)
        hits = find_overlaps([tokenizer.decode(w) for w in cs.windows.tolist()], index)
        if hits:
            msg = (f"{len(hits)} of {len(cs.windows)} calibration windows overlap the eval data "
                   f"(e.g. window {hits[0].window}: {hits[0].example!r})")
            if not cfg.allow_overlap:
                raise LlmoptError(msg + "; remove that text from the calibration data or pass --allow-overlap")
            cs.warnings.append(msg)
    if console is not None:
        for w in cs.warnings:
            console.print(f"[yellow]warning:[/] {w}", highlight=False)
    return cs


def run_calibration(cfg: CalibrateConfig, console: Console | None = None) -> Manifest:
    """Calibrate `cfg.model` and write `cfg.output`; returns the manifest written."""
    from llmopt.devices import torch_threads

    with torch_threads(cfg.threads):
        return _run_calibration(cfg, console)


def _run_calibration(cfg: CalibrateConfig, console: Console | None) -> Manifest:
    from llmopt.devices import forward_dtype, resolve_device
    from llmopt.models.loader import build_empty, fill_module, release
    from llmopt.models.reader import CheckpointTensors
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    console = console or Console(stderr=True)
    check_output_dir(cfg.output, cfg.overwrite)
    resolved = resolve_model(cfg.model)
    if resolved.quantization_config is not None:
        raise LlmoptError(f"{resolved.path} is already quantized; calibrate the original model")
    directory = weights_dir(resolved)
    tokenizer = load_tokenizer(directory)
    cs = sample_windows(cfg, tokenizer, console)
    device = resolve_device(cfg.device)
    # streamed as quantize is: one layer in memory at a time, read just before it runs (so an 8B model
    # calibrates in about one float32 layer plus the activations, not 32 GB)
    model = build_empty(resolved, torch.float32, device)
    dtype = forward_dtype(cfg.forward_dtype, device)
    tensors = CheckpointTensors(directory)
    fill_module(model, tensors, "embed_tokens", device)
    with layer_progress(console, "calibrating", resolved.spec.num_layers) as advance:
        stats = collect_stats(model, cs.windows, cfg.observer, cfg.percentile, dtype,
                              cfg.batch_tokens, progress=advance,
                              load_layer=lambda i: fill_module(model, tensors, f"layers.{i}", device),
                              layer_done=lambda i: release(model, f"layers.{i}"),
                              after_embedding=lambda: release(model, "embed_tokens"))
    manifest = Manifest(
        model=ModelIdentity.of(resolved, directory),
        data=[data_record(s, cs.per_source.get(s.path, 0)) for s in cfg.sources],
        settings=cfg.model_dump(mode="json", exclude={"output", "overwrite", "data", "eval_data"})
        | {"eval_data": cfg.eval_data, "forward_dtype": str(dtype).removeprefix("torch.")},
        num_windows=int(cs.windows.shape[0]),
        seq_len=cfg.seq_len,
        num_tokens=cs.num_tokens,
        duplicates_dropped=cs.num_duplicates,
        warnings=cs.warnings,
    )
    with atomic_directory(cfg.output, cfg.overwrite) as tmp:
        stats.save(tmp / STATS)
        manifest.write(tmp / MANIFEST)
    return manifest
