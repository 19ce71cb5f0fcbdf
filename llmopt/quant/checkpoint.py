"""Load GPTQ and compressed-tensors checkpoints into our model, with real low-bit linears.

The model is built on the meta device; every quantized HF projection is read back into a
QuantizedWeight, the parts of our fused projections (q|k|v, gate|up) are concatenated by rows and
swapped in as `llmopt.quant.linear` / W8A8 modules (`DequantizedLinear` for float32 on CPU), and only the remaining tensors (embeddings,
norms, unquantized linears) are materialized and filled. Parts that cannot be merged (different
schemes, act-order g_idx that differ) run side by side in a `ConcatLinear`.

Also reads calibrated INT8 KV-cache scales for the engine: `kv_cache_scales.json` (what llmopt writes
now, see kv_scales.py), or, from checkpoints written before it, an int8 compressed-tensors
`kv_cache_scheme` with per-layer `self_attn.k_scale` / `v_scale` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.layers.linear import iter_linears, output_splits, set_submodule
from llmopt.models.base import CausalLM
from llmopt.models.reader import CheckpointTensors
from llmopt.models.registry import build_model
from llmopt.models.resolve import ResolvedModel, weights_dir
from llmopt.quant.dequantized import DequantizedLinear
from llmopt.quant.dynamic_int8 import Int8DynamicActivationLinear
from llmopt.quant.kv_scales import read_kv_scales
from llmopt.quant.linear import quantized_linear
from llmopt.quant.pack_gptq import unpack_gptq
from llmopt.quant.packing import unpack_int32
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.rows import ConcatLinear, can_concat, concat_rows
from llmopt.quant.scheme import QuantScheme
from llmopt.quant.targets import hf_parts

_SCALE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SUPPORTED = ("gptq", "compressed-tensors")


@dataclass
class _Part:
    """One HF projection as read from the checkpoint: a QuantizedWeight or a float weight."""

    qw: QuantizedWeight | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    int8_activations: bool = False


def _matches(name: str, target: str) -> bool:
    import re

    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


def _ct_group(qcfg: dict[str, Any], name: str) -> dict[str, Any] | None:
    if any(_matches(name, t) and t != "Linear" for t in qcfg.get("ignore") or []):
        return None
    for group in (qcfg.get("config_groups") or {}).values():
        if any(_matches(name, t) for t in group.get("targets") or []):
            return group
    return None


def _read_compressed(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> _Part | None:
    group = _ct_group(qcfg, name)
    if group is None or not group.get("weights"):
        return None
    w = group["weights"]
    bits, sym = int(w["num_bits"]), bool(w.get("symmetric", True))
    strategy = w.get("strategy", "channel")
    if strategy not in ("channel", "group"):
        raise LlmoptError(f"{name}: compressed-tensors weight strategy {strategy!r} is not supported")
    act = group.get("input_activations")
    int8_act = bool(act) and act.get("type") == "int" and act.get("num_bits") == 8 and act.get("dynamic")
    if act and not int8_act:
        raise LlmoptError(f"{name}: input activation scheme {act} is not supported")
    if f"{name}.weight_g_idx" in ts:
        raise LlmoptError(f"{name}: group act-order (weight_g_idx) is not supported")
    bias = ts.maybe(f"{name}.bias")
    scale = ts.get(f"{name}.weight_scale")
    sdt = _SCALE_DTYPES.get(scale.dtype, "float32")
    if f"{name}.weight_packed" in ts:
        out, inp = (int(v) for v in ts.get(f"{name}.weight_shape").tolist())
        gs = -1 if strategy == "channel" else int(w["group_size"])
        q = unpack_int32(ts.get(f"{name}.weight_packed"), bits, dim=1, count=inp)
        zp = ts.maybe(f"{name}.weight_zero_point")
        zero = None if sym else unpack_int32(zp, bits, dim=0, count=out)  # type: ignore[arg-type]
        scheme = QuantScheme(bits=bits, group_size=gs, symmetric=sym, scale_dtype=sdt)  # type: ignore[arg-type]
        qw = QuantizedWeight(q=q, scale=scale.float().reshape(out, -1), zero=zero,
                             g_idx=torch.arange(inp, dtype=torch.int32) // (inp if gs == -1 else gs), scheme=scheme)
        return _Part(qw, None, bias, int8_act)
    weight = ts.get(f"{name}.weight")
    if weight.dtype == torch.float8_e4m3fn:
        scheme = QuantScheme(bits=8, group_size=-1, symmetric=True, kind="fp8", scale_dtype=sdt)  # type: ignore[arg-type]
        qw = QuantizedWeight(q=weight, scale=scale.float().reshape(-1, 1), zero=None,
                             g_idx=torch.zeros(weight.shape[1], dtype=torch.int32), scheme=scheme)
        return _Part(qw, None, bias, int8_act)
    if weight.dtype == torch.int8:
        if not sym or strategy != "channel":
            raise LlmoptError(f"{name}: int-quantized weights must be symmetric per channel")
        scheme = QuantScheme(bits=8, group_size=-1, symmetric=True, scale_dtype=sdt)  # type: ignore[arg-type]
        qw = QuantizedWeight(q=(weight.to(torch.int16) + 128).to(torch.uint8), scale=scale.float().reshape(-1, 1),
                             zero=None, g_idx=torch.zeros(weight.shape[1], dtype=torch.int32), scheme=scheme)
        return _Part(qw, None, bias, int8_act)
    raise LlmoptError(f"{name}: unsupported compressed weight dtype {weight.dtype}")


def _read_gptq(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> _Part | None:
    if f"{name}.qweight" not in ts:
        return None
    if qcfg.get("checkpoint_format", "gptq") != "gptq":
        raise LlmoptError(f"GPTQ checkpoint_format {qcfg.get('checkpoint_format')!r} is not supported (only v1 'gptq')")
    qw = unpack_gptq(ts.get(f"{name}.qweight"), ts.get(f"{name}.qzeros"), ts.get(f"{name}.scales"),
                     ts.maybe(f"{name}.g_idx"), int(qcfg["bits"]), int(qcfg["group_size"]),
                     bool(qcfg.get("sym", True)))
    return _Part(qw, None, ts.maybe(f"{name}.bias"))


def _read_part(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> _Part:
    method = qcfg.get("quant_method")
    part = _read_gptq(ts, name, qcfg) if method == "gptq" else _read_compressed(ts, name, qcfg)
    if part is not None:
        return part
    if f"{name}.weight" not in ts:
        raise LlmoptError(f"checkpoint lacks {name} (neither quantized nor float tensors)")
    return _Part(None, ts.get(f"{name}.weight"), ts.maybe(f"{name}.bias"))


def _runtime(qw: QuantizedWeight, bias: torch.Tensor | None, int8_act: bool, dtype: torch.dtype,
             device: torch.device) -> nn.Module:
    if int8_act:
        return Int8DynamicActivationLinear.from_quantized(qw, bias, dtype, device)
    if dtype == torch.float32 and device.type == "cpu":
        return DequantizedLinear(qw, bias, device)  # see dequantized.py: fp32 CPU kernels are far slower
    return quantized_linear(qw, bias, dtype, device)


def _build_linear(parts: list[_Part], dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """The module for one of our linears (None: all parts are float, load them densely)."""
    if all(p.qw is None for p in parts):
        return None
    qws = [p.qw for p in parts]
    biases = [p.bias for p in parts]
    same_act = len({p.int8_activations for p in parts}) == 1
    if all(q is not None for q in qws) and same_act and can_concat(qws):  # type: ignore[arg-type]
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return _runtime(concat_rows(qws), bias, parts[0].int8_activations, dtype, device)  # type: ignore[arg-type]
    mods: list[nn.Module] = []
    for p in parts:
        if p.qw is not None:
            mods.append(_runtime(p.qw, p.bias, p.int8_activations, dtype, device))
        else:
            assert p.weight is not None
            lin = nn.Linear(p.weight.shape[1], p.weight.shape[0], bias=p.bias is not None, dtype=dtype, device=device)
            with torch.no_grad():
                lin.weight.copy_(p.weight)
                if p.bias is not None:
                    lin.bias.copy_(p.bias)
            mods.append(lin)
    return ConcatLinear(mods)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialized) every parameter still on the meta device."""
    for mod in model.modules():
        if any(t.is_meta for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))):
            mod.to_empty(device=device, recurse=False)


def load_quantized_model(resolved: ResolvedModel, directory: Path, dtype: torch.dtype,
                         device: str | torch.device = "cpu") -> CausalLM:
    """Our model for a GPTQ or compressed-tensors checkpoint; quantized linears compute in `dtype`."""
    qcfg = resolved.quantization_config or {}
    method = qcfg.get("quant_method")
    if method not in SUPPORTED:
        raise LlmoptError(f"{resolved.path}: quantized checkpoints with quant_method={method!r} are not supported "
                          f"(supported: {', '.join(SUPPORTED)})")
    device = torch.device(device)
    spec = resolved.spec
    ts = CheckpointTensors(directory)
    with torch.device("meta"):
        model = build_model(spec, dtype, "meta")
    used: set[str] = set()
    for name, mod in list(iter_linears(model)):
        if name == "lm_head" and spec.tie_word_embeddings:
            continue
        names = hf_parts(model, name, mod)
        parts = [_read_part(ts, hf, qcfg) for hf in names]
        used.update(k for hf in names for k in ts.where if k.startswith(hf + "."))
        built = _build_linear(parts, dtype, device)
        if built is not None:
            set_submodule(model, name, built)
            continue
        mod.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for (lo, hi), p in zip(names.values(), parts, strict=True):
                mod.weight[lo:hi].copy_(p.weight)  # type: ignore[arg-type]
                if p.bias is not None:
                    mod.bias[lo:hi].copy_(p.bias)
    _materialize(model, device)
    # RoPE tables are not in the checkpoint: build them on the real device
    model.rotary = model.build_rotary(device)
    params = dict(model.named_parameters())
    for key in ts.where:
        if key in used or key.endswith(("k_scale", "v_scale")) or "rotary_emb" in key:
            continue
        ours, _ = type(model).hf_to_ours(key)
        if ours not in params:
            raise LlmoptError(f"{directory}: unexpected tensor {key!r}")
        with torch.no_grad():
            params[ours].copy_(ts.get(key))
        used.add(key)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n in ("embed_tokens.weight", "norm.weight") if f"model.{n}" not in used]
    if missing:
        raise LlmoptError(f"{directory}: checkpoint lacks model.{missing[0]}")
    model.eval()
    return model


def read_quantized_weights(resolved: ResolvedModel) -> dict[str, QuantizedWeight]:
    """Every quantized projection of a checkpoint as a QuantizedWeight, by HF module name."""
    qcfg = resolved.quantization_config or {}
    ts = CheckpointTensors(weights_dir(resolved))
    names = sorted({k.rsplit(".", 1)[0] for k in ts.where if k.endswith((".qweight", ".weight_scale"))})
    out = {}
    for name in names:
        part = _read_part(ts, name, qcfg)
        if part.qw is not None:
            out[name] = part.qw
    return out


@dataclass
class KVCacheScales:
    """Calibrated static INT8 KV-cache scales (x ≈ q · scale), [layers, kv_heads] each."""

    dtype: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def kv_cache_scales(resolved: ResolvedModel) -> KVCacheScales | None:
    """The checkpoint's calibrated KV-cache scales, or None when it has none."""
    s = resolved.spec
    found = read_kv_scales(resolved.path, s.num_layers, s.num_kv_heads) if resolved.kind == "hf_dir" else None
    if found is not None:
        return KVCacheScales("int8", *found)
    qcfg = resolved.quantization_config
    kv = (qcfg or {}).get("kv_cache_scheme")
    if not kv:
        return None
    # legacy (llmopt before kv_cache_scales.json): int8 kv_cache_scheme + per-layer tensors
    if kv.get("type") != "int" or int(kv.get("num_bits", 0)) != 8 or kv.get("dynamic"):
        raise LlmoptError(f"{resolved.path}: kv_cache_scheme {kv} is not supported (static int8 only)")
    ts = CheckpointTensors(weights_dir(resolved))
    k, v = [], []
    for i in range(s.num_layers):
        for store, kind in ((k, "k"), (v, "v")):
            key = f"model.layers.{i}.self_attn.{kind}_scale"
            if key not in ts:
                raise LlmoptError(f"{resolved.path}: kv_cache_scheme is set but {key} is missing")
            store.append(ts.get(key).float().reshape(-1).expand(s.num_kv_heads))
    return KVCacheScales("int8", torch.stack(k), torch.stack(v))


def is_split_fused(model: nn.Module) -> bool:
    """True when some fused projection runs as a ConcatLinear (for reports and tests)."""
    return any(isinstance(m, ConcatLinear) and output_splits(m) for m in model.modules())
