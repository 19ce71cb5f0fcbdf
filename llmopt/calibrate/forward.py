"""Run our model one decoder layer at a time over calibration windows.

Calibration and sequential quantization (GPTQ, AWQ, SmoothQuant) need every layer's inputs for the
whole calibration set, computed by the layers before it *as they will be served* (already quantized).
So the set is embedded once, and each layer is run over all of it before the next one; the per-layer
hidden states are the only activations kept.

Each window is one whole-sequence prefill, so attention reads K/V straight from the layer and the KV
cache is only written to: `KVObserver` stands in for `PagedKVCache`, stores nothing, and records the
per-head |K| (after RoPE, exactly what the engine caches) and |V| maxima for INT8 KV-cache scales.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.layers.attention import AttentionMetadata, get_backend
from llmopt.models.base import CausalLM


@dataclass
class CalibBatch:
    """Several windows laid out as one flat prefill batch, and the hidden state entering the next layer."""

    positions: torch.Tensor  # [T]
    rope: tuple  # what model.rotary gives for `positions` (llama: cos, sin), passed to every layer
    meta: AttentionMetadata
    hidden: torch.Tensor  # [T, hidden]
    residual: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def stream(self) -> torch.Tensor:
        """The residual stream entering the next layer (`residual_stream` of the two halves kept)."""
        return residual_stream(self.hidden, self.residual)


def residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream a layer leaves: our layers return the pre-norm add's two halves."""
    return hidden if residual is None else hidden + residual


class KVObserver:
    """Duck-typed `PagedKVCache` for whole-window prefills: records per-layer, per-head K/V absmax."""

    quantized = False  # whole-window prefills then read K/V straight from the layer, never from the pool
    dtype = None
    num_groups = 1

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.k_absmax = torch.zeros(num_layers, num_kv_heads)
        self.v_absmax = torch.zeros(num_layers, num_kv_heads)
        self.enabled = True

    def locate(self, layer: int) -> tuple[int, KVObserver, int]:
        return 0, self, layer

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if not self.enabled:
            return
        self.k_absmax[layer] = torch.maximum(self.k_absmax[layer], k.detach().abs().float().amax((0, 2)).cpu())
        self.v_absmax[layer] = torch.maximum(self.v_absmax[layer], v.detach().abs().float().amax((0, 2)).cpu())


@torch.no_grad()
def embed_batches(model: CausalLM, windows: torch.Tensor, batch_windows: int,
                  dtype: torch.dtype) -> list[CalibBatch]:
    """Embed `windows` [N, L] into batches of `batch_windows` sequences each (hidden in `dtype`)."""
    dev = model.embed_tokens.weight.device
    n, seq_len = windows.shape
    # one block per window: window i's tokens take slots i*L..(i+1)*L-1 of a pool nothing reads back
    attn = get_backend(dev, block_size=seq_len, allow_compiled=False)
    batches = []
    for start in range(0, n, batch_windows):
        ids = windows[start:start + batch_windows].to(dev)
        b = ids.shape[0]
        flat = ids.reshape(-1)
        meta = attn.build_metadata(KVObserver(0, 0), [([[i]], 0, seq_len) for i in range(b)], [])
        positions = torch.arange(seq_len, device=dev).repeat(b)
        batches.append(CalibBatch(positions, model.rotary(positions), meta, model.embed(flat).to(dtype), None))
    return batches


def layer_copy(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `layer` whose parameters are in `dtype` (buffers such as RoPE tables stay as they are)."""
    twin = copy.deepcopy(layer)
    for p in twin.parameters():
        p.data = p.data.to(dtype)
    return twin


class StopLayer(Exception):
    """Raised by a hook to end a layer's forward early once the inputs it needed were captured."""


@torch.no_grad()
def run_layer(layer: nn.Module, batches: list[CalibBatch], cache: KVObserver, update: bool = True,
              on_batch: Callable[[int], None] | None = None) -> None:
    """Run `layer` over every batch; with `update`, each batch's hidden state becomes the layer's output.

    A hook may raise `StopLayer` to skip the rest of the layer (then `update` must be False).
    """
    for i, b in enumerate(batches):
        try:
            hidden, residual = layer(b.rope, b.hidden, b.residual, cache, b.meta)
        except StopLayer:
            if update:
                raise
            hidden = residual = None
        if update:
            b.hidden, b.residual = hidden, residual
        if on_batch:
            on_batch(i)


@dataclass
class InputHook:
    """Calls `fn(name, x)` with the input of each named linear of a layer while installed."""

    modules: dict[str, nn.Module]
    fn: Callable[[str, torch.Tensor], None]
    stop_at: str | None = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        handles = []
        for name, mod in self.modules.items():
            def pre(_m, args, _name=name):
                self.fn(_name, args[0])
                if _name == self.stop_at:
                    raise StopLayer
            handles.append(mod.register_forward_pre_hook(pre))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
