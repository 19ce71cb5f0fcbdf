"""Activation statistics of a model over calibration windows, and their `stats.safetensors` file.

Per linear input (our fused module names, e.g. `layers.3.self_attn.qkv_proj`: q, k and v share it):
per-channel absmax and mean |x| (`ChannelStats`, what AWQ and SmoothQuant use) and a per-tensor
range from the chosen observer. Per layer: K and V absmax per KV head, K measured after RoPE (what
the engine's INT8 cache stores). The calibration token windows are saved too, so that `quantize
--calib DIR` runs GPTQ/AWQ on exactly the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmopt.calibrate.forward import InputHook, KVObserver, embed_batches, layer_copy, run_layer
from llmopt.errors import LlmoptError
from llmopt.layers.linear import iter_linears
from llmopt.models.base import CausalLM
from llmopt.models.reader import unreadable
from llmopt.quant.observers import (
    ChannelStats,
    EmaObserver,
    MinMaxObserver,
    MseObserver,
    Observer,
    PercentileObserver,
)

TOKENS_KEY = "calibration_tokens"
OBSERVERS = ("minmax", "ema", "percentile", "mse")


def make_observer(kind: str, percentile: float = 99.9) -> Observer:
    if kind == "minmax":
        return MinMaxObserver()
    if kind == "ema":
        return EmaObserver()
    if kind == "percentile":
        return PercentileObserver(percentile)
    if kind == "mse":
        return MseObserver()
    raise LlmoptError(f"unknown observer {kind!r}; use {', '.join(OBSERVERS)}")


@dataclass
class LinearInputStats:
    channels: ChannelStats
    observer: Observer


@dataclass
class CalibrationStats:
    """Everything `calibrate` measures (see module doc)."""

    inputs: dict[str, LinearInputStats] = field(default_factory=dict)
    k_absmax: torch.Tensor | None = None  # [layers, kv_heads]
    v_absmax: torch.Tensor | None = None
    windows: torch.Tensor | None = None  # [N, L]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, s in self.inputs.items():
            lo, hi = s.observer.compute()
            out[f"{name}.input_absmax"] = s.channels.absmax
            out[f"{name}.input_mean_abs"] = s.channels.mean_abs
            out[f"{name}.input_range"] = torch.stack([lo.float().reshape(()), hi.float().reshape(())])
        if self.k_absmax is not None and self.v_absmax is not None:
            for i in range(self.k_absmax.shape[0]):
                out[f"layers.{i}.self_attn.k_absmax"] = self.k_absmax[i].contiguous()
                out[f"layers.{i}.self_attn.v_absmax"] = self.v_absmax[i].contiguous()
        if self.windows is not None:
            out[TOKENS_KEY] = self.windows.to(torch.int32).contiguous()
        return out

    def save(self, path: Path) -> None:
        save_file(self.to_tensors(), str(path))


@dataclass
class SavedStats:
    """`stats.safetensors` read back: the raw tensors plus typed accessors."""

    tensors: dict[str, torch.Tensor]

    @classmethod
    def load(cls, path: Path) -> SavedStats:
        if not path.is_file():
            raise LlmoptError(f"{path} is missing; is this a `llmopt calibrate` output directory?")
        try:
            return cls(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise unreadable(path, e) from None

    @property
    def windows(self) -> torch.Tensor:
        if TOKENS_KEY not in self.tensors:
            raise LlmoptError("the calibration stats hold no token windows")
        return self.tensors[TOKENS_KEY].long()

    def kv_absmax(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            k = torch.stack([self.tensors[f"layers.{i}.self_attn.k_absmax"] for i in range(num_layers)])
            v = torch.stack([self.tensors[f"layers.{i}.self_attn.v_absmax"] for i in range(num_layers)])
        except KeyError as e:
            raise LlmoptError(f"the calibration stats lack {e.args[0]}") from None
        return k, v


@torch.no_grad()
def collect_stats(model: CausalLM, windows: torch.Tensor, observer: str = "minmax",
                  percentile: float = 99.9, dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 4096,
                  progress: Callable[[int], None] | None = None,
                  load_layer: Callable[[int], None] | None = None, layer_done: Callable[[int], None] | None = None,
                  after_embedding: Callable[[], None] | None = None) -> CalibrationStats:
    """Run the (unquantized) model layer by layer over `windows` and measure every linear's input. Streamed
    callers pass `load_layer(i)` / `layer_done(i)` (read a layer just before it runs, free it after) and
    `after_embedding()` (free the embedding once the windows are embedded): memory then holds one layer."""
    spec = model.spec
    per_batch = max(1, batch_tokens // windows.shape[1])
    batches = embed_batches(model, windows, per_batch, dtype)
    if after_embedding:
        after_embedding()
    cache = KVObserver(spec.num_layers, spec.num_kv_heads)
    stats = CalibrationStats(windows=windows.cpu())
    for i in range(len(model.layers)):
        if load_layer:
            load_layer(i)
        fwd = layer_copy(model.layers[i], dtype)
        mods = {f"layers.{i}.{n}": m for n, m in iter_linears(fwd)}
        for name, m in mods.items():
            stats.inputs[name] = LinearInputStats(ChannelStats(m.in_features), make_observer(observer, percentile))

        def record(name: str, x: torch.Tensor) -> None:
            s = stats.inputs[name]
            s.channels.update(x)
            s.observer.update(x)

        with InputHook(mods, record).installed():
            run_layer(fwd, batches, cache)
        del fwd
        if layer_done:
            layer_done(i)
        if progress:
            progress(i)
    stats.k_absmax, stats.v_absmax = cache.k_absmax, cache.v_absmax
    return stats
