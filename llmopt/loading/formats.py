"""A reader per checkpoint format: what each of our modules is made of, read one module at a time.

- **HF float** (and a GGUF converted to an HF folder by models.resolve): every tensor is a float
  parameter; `fill_module` reads them by module prefix.
- **GPTQ** (`qweight`/`qzeros`/`scales`/`g_idx`) and **compressed-tensors** (`weight_packed`, int8,
  FP8, W8A8 groups): each quantized HF projection is read back into a QuantizedWeight (`LinearPart`);
  landing.py turns the parts of one of our (possibly fused) linears into its runtime module.

Also reads calibrated INT8 KV-cache scales for the engine: `kv_cache_scales.json` (what llmopt writes
now, see quant/kv_scales.py), or, from checkpoints written before it, an int8 compressed-tensors
`kv_cache_scheme` with per-layer `self_attn.k_scale` / `v_scale` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmopt.errors import LlmoptError
from llmopt.models.reader import CheckpointTensors
from llmopt.models.resolve import ResolvedModel, weights_dir
from llmopt.quant.kv_scales import read_kv_scales
from llmopt.quant.pack_gptq import unpack_gptq
from llmopt.quant.packing import unpack_int32
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.scheme import QuantScheme

_SCALE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SUPPORTED = ("gptq", "compressed-tensors")


@dataclass
class LinearPart:
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
    """The config group whose targets take the linear `name`: one naming it (exactly or by `re:`) before one
    targeting the class "Linear", as compressed-tensors ranks them (a quantized lm_head next to "Linear")."""
    if any(_matches(name, t) and t != "Linear" for t in qcfg.get("ignore") or []):
        return None
    groups = list((qcfg.get("config_groups") or {}).values())
    for by_name in (True, False):
        for group in groups:
            if any(_matches(name, t) and (t != "Linear") == by_name for t in group.get("targets") or []):
                return group
    return None


def _read_compressed(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> LinearPart | None:
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
        return LinearPart(qw, None, bias, int8_act)
    weight = ts.get(f"{name}.weight")
    if weight.dtype == torch.float8_e4m3fn:
        scheme = QuantScheme(bits=8, group_size=-1, symmetric=True, kind="fp8", scale_dtype=sdt)  # type: ignore[arg-type]
        qw = QuantizedWeight(q=weight, scale=scale.float().reshape(-1, 1), zero=None,
                             g_idx=torch.zeros(weight.shape[1], dtype=torch.int32), scheme=scheme)
        return LinearPart(qw, None, bias, int8_act)
    if weight.dtype == torch.int8:
        if not sym or strategy != "channel":
            raise LlmoptError(f"{name}: int-quantized weights must be symmetric per channel")
        scheme = QuantScheme(bits=8, group_size=-1, symmetric=True, scale_dtype=sdt)  # type: ignore[arg-type]
        qw = QuantizedWeight(q=(weight.to(torch.int16) + 128).to(torch.uint8), scale=scale.float().reshape(-1, 1),
                             zero=None, g_idx=torch.zeros(weight.shape[1], dtype=torch.int32), scheme=scheme)
        return LinearPart(qw, None, bias, int8_act)
    raise LlmoptError(f"{name}: unsupported compressed weight dtype {weight.dtype}")


def _read_gptq(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> LinearPart | None:
    if f"{name}.qweight" not in ts:
        return None
    if qcfg.get("checkpoint_format", "gptq") != "gptq":
        raise LlmoptError(f"GPTQ checkpoint_format {qcfg.get('checkpoint_format')!r} is not supported (only v1 'gptq')")
    qw = unpack_gptq(ts.get(f"{name}.qweight"), ts.get(f"{name}.qzeros"), ts.get(f"{name}.scales"),
                     ts.maybe(f"{name}.g_idx"), int(qcfg["bits"]), int(qcfg["group_size"]),
                     bool(qcfg.get("sym", True)))
    return LinearPart(qw, None, ts.maybe(f"{name}.bias"))


def _read_part(ts: CheckpointTensors, name: str, qcfg: dict[str, Any]) -> LinearPart:
    method = qcfg.get("quant_method")
    part = _read_gptq(ts, name, qcfg) if method == "gptq" else _read_compressed(ts, name, qcfg)
    if part is not None:
        return part
    if f"{name}.weight" not in ts:
        raise LlmoptError(f"checkpoint lacks {name} (neither quantized nor float tensors)")
    return LinearPart(None, ts.get(f"{name}.weight"), ts.maybe(f"{name}.bias"))


class QuantizedCheckpoint:
    """A GPTQ or compressed-tensors checkpoint: `parts(hf_names)` reads the projections of one of our
    linears; once they land as one module, `consume(hf_names)` marks their tensors, which the float fill
    then leaves alone (`skip`)."""

    def __init__(self, resolved: ResolvedModel, tensors: CheckpointTensors):
        self.qcfg = resolved.quantization_config or {}
        method = self.qcfg.get("quant_method")
        if method not in SUPPORTED:
            raise LlmoptError(f"{resolved.path}: quantized checkpoints with quant_method={method!r} are not "
                              f"supported (supported: {', '.join(SUPPORTED)})")
        self.tensors = tensors
        self.consumed: set[str] = set()
        self._by_module: dict[str, list[str]] = {}
        for k in tensors.where:
            self._by_module.setdefault(k.rsplit(".", 1)[0], []).append(k)

    def parts(self, hf_names: list[str]) -> list[LinearPart]:
        return [_read_part(self.tensors, hf, self.qcfg) for hf in hf_names]

    def embedding(self, hf_name: str) -> LinearPart | None:
        """A quantized embedding table (`quantize --lm-head int8` on a tied model), or None when it is float. Only a
        config group that names it takes it: the class target "Linear" never means an embedding."""
        if f"{hf_name}.weight_packed" not in self.tensors:
            return None
        named = [g for g in (self.qcfg.get("config_groups") or {}).values()
                 if any(_matches(hf_name, t) and t != "Linear" for t in g.get("targets") or [])]
        if not named:
            raise LlmoptError(f"{hf_name} is stored packed, but no quantization_config group names it")
        return _read_part(self.tensors, hf_name, {**self.qcfg, "config_groups": {"named": named[0]}})

    def consume(self, hf_names: list[str]) -> None:
        for hf in hf_names:
            self.consumed.update(self._by_module.get(hf, []))

    def skip(self, name: str) -> bool:
        """Tensors the float fill must not take: consumed by a quantized linear, or KV-cache scales."""
        return name in self.consumed or name.endswith(("k_scale", "v_scale"))


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
    """Calibrated static KV-cache scales (x ≈ q · scale), [layers, kv_heads] each; `dtype` int8 or fp8."""

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
    # fp8 (what vLLM and llm-compressor use), or legacy int8 (llmopt before kv_cache_scales.json): scales in
    # each layer's self_attn, one ("tensor") or one per KV head ("attn_head", llm-compressor's [kv_heads, 1, 1])
    kind = {"float": "fp8", "int": "int8"}.get(kv.get("type"))
    if (kind is None or int(kv.get("num_bits", 0)) != 8 or kv.get("dynamic")
            or (kind == "fp8" and kv.get("strategy", "tensor") not in ("tensor", "attn_head"))):
        raise LlmoptError(f"{resolved.path}: kv_cache_scheme {kv} is not supported (static 8-bit: float with one "
                          "scale per layer or per KV head, or int)")
    ts = CheckpointTensors(weights_dir(resolved))
    k, v = [], []
    for i in range(s.num_layers):
        for store, which in ((k, "k"), (v, "v")):
            key = f"model.layers.{i}.self_attn.{which}_scale"
            if key not in ts:
                raise LlmoptError(f"{resolved.path}: kv_cache_scheme is set but {key} is missing")
            scale = ts.get(key).float().reshape(-1)
            if scale.numel() not in (1, s.num_kv_heads):
                raise LlmoptError(f"{resolved.path}: {key} holds {scale.numel()} scales; expected 1 or one per KV "
                                  f"head ({s.num_kv_heads})")
            store.append(scale.expand(s.num_kv_heads))
    return KVCacheScales(kind, torch.stack(k), torch.stack(v))
