"""Calibrated static INT8 KV-cache scales (`llmopt quantize --kv-cache int8`), in a file of their own.

They are written to `kv_cache_scales.json` next to config.json, **not** as a compressed-tensors
`kv_cache_scheme`: vLLM refuses a whole checkpoint whose kv_cache_scheme is int8 ("Currently supported
kv cache quantization is num_bits=8, type=float"), and transformers reports per-layer
`self_attn.k_scale` / `v_scale` tensors as unexpected and ignores them. Only llmopt's engine has an
int8 paged KV cache, so only it reads this file; every other tool loads the weights as if it were not
there (and runs its own KV cache: vLLM `--kv-cache-dtype auto|fp8`).

Layout (version 1): scales per layer and KV head, x ≈ q · scale with q = round(x / scale) clamped to
[−127, 127] (see llmopt/layers/attention/paged_kv_cache.py), K taken after RoPE:

    {"format": "llmopt-kv-cache-scales", "version": 1, "dtype": "int8",
     "num_layers": L, "num_kv_heads": H, "k_scale": [[...H] × L], "v_scale": [[...H] × L]}

Floats are float32 values written as JSON numbers (repr of the exact value), so they read back
bit-for-bit. Checkpoints written before this file existed (an int8 `kv_cache_scheme` plus per-layer
`self_attn.k_scale` / `v_scale` tensors) are still read by `llmopt.loading.formats.kv_cache_scales`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from llmopt.errors import LlmoptError

KV_SCALES_FILE = "kv_cache_scales.json"
FORMAT = "llmopt-kv-cache-scales"
VERSION = 1


def write_kv_scales(directory: Path, k_scale: torch.Tensor, v_scale: torch.Tensor) -> Path:
    """Write [layers, kv_heads] K and V scales to `directory/kv_cache_scales.json`."""
    if k_scale.shape != v_scale.shape or k_scale.dim() != 2:
        raise LlmoptError(f"KV scales must both be [layers, kv_heads], got {tuple(k_scale.shape)} and "
                          f"{tuple(v_scale.shape)}")
    doc = {
        "format": FORMAT, "version": VERSION, "dtype": "int8",
        "num_layers": int(k_scale.shape[0]), "num_kv_heads": int(k_scale.shape[1]),
        "k_scale": k_scale.float().cpu().tolist(), "v_scale": v_scale.float().cpu().tolist(),
    }
    path = directory / KV_SCALES_FILE
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_kv_scales(directory: Path, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) float32 [layers, kv_heads] from `directory`, or None when it has no such file."""
    path = directory / KV_SCALES_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LlmoptError(f"{path}: cannot read KV-cache scales ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LlmoptError(f"{path}: not an llmopt KV-cache scales file (format {doc.get('format')!r})"
                          if isinstance(doc, dict) else f"{path}: not an llmopt KV-cache scales file")
    if doc.get("version") != VERSION or doc.get("dtype") != "int8":
        raise LlmoptError(f"{path}: version {doc.get('version')!r} / dtype {doc.get('dtype')!r} is not supported "
                          f"(version {VERSION}, int8)")
    out = []
    for key in ("k_scale", "v_scale"):
        try:
            t = torch.tensor(doc[key], dtype=torch.float32)
        except (KeyError, TypeError, ValueError) as e:
            raise LlmoptError(f"{path}: bad {key} ({e})") from None
        if tuple(t.shape) != (num_layers, num_kv_heads):
            raise LlmoptError(f"{path}: {key} is {list(t.shape)}, the model has {num_layers} layers x "
                              f"{num_kv_heads} KV heads")
        if not all(math.isfinite(v) and v > 0 for v in t.reshape(-1).tolist()):
            raise LlmoptError(f"{path}: {key} must be finite and positive")
        out.append(t)
    return out[0], out[1]
