"""Write a quantized model as a Hugging Face checkpoint in the GPTQ or compressed-tensors format.

Quantized fused weights are split back into HF projections by rows (see `rows`). The norms inside layers
(with any AWQ/SmoothQuant folding applied), routers and ignored linears are written in float32, the
quantizer's working dtype, so a float32 load reproduces them exactly (a linear `--scheme auto` leaves float:
in bfloat16, as its budget counts it). config.json's `torch_dtype` becomes bfloat16: with `--dtype auto` the
int4/int8 kernels then run on bf16 activations, their fast path, and every float tensor is cast to bf16 on
load. So the tensors outside the layers (embeddings, final norm, head), copied from the source, are stored in
bf16 when the source has them in float32 (`float_dtype`, the default): a GGUF-derived model's float32
embedding is most of a small model's checkpoint (113 of SmolLM2's 173 MB at W4A16). With `--float-dtype
source` they keep the source's dtype. `--lm-head int8` quantizes the head instead (`head_module`).

Calibrated INT8 KV-cache scales go to `kv_cache_scales.json` (llmopt/quant/kv_scales.py), never into
`quantization_config`: an int8 `kv_cache_scheme` makes vLLM refuse the whole checkpoint. FP8 ones are
what vLLM loads: a float `kv_cache_scheme` (one scale per layer, "tensor", or per KV head, "attn_head") and
each layer's `self_attn.k_scale` / `v_scale` tensors ([] or [kv_heads, 1, 1]), as llm-compressor writes them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmopt.errors import LlmoptError
from llmopt.layers.linear import iter_linears
from llmopt.models.base import CausalLM
from llmopt.models.reader import CheckpointTensors
from llmopt.models.shards import INDEX_FILE, ShardWriter
from llmopt.quant.kv_scales import KV_SCALES_FILE, write_kv_scales
from llmopt.quant.pack_compressed import (
    compressed_config_group,
    compressed_quantization_config,
    pack_compressed,
)
from llmopt.quant.pack_gptq import gptq_quantization_config, pack_gptq
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.recipe import ModuleScheme
from llmopt.quant.rows import slice_rows
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.sequential import QuantizedModule
from llmopt.quant.targets import Target, hf_parts

COMPUTE_DTYPE = "bfloat16"
_SKIP_COPY = {"config.json", INDEX_FILE, "quantization_report.json", KV_SCALES_FILE}

FP8_KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
}
INT8_TOKEN_ACTIVATIONS: dict[str, Any] = {
    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, "observer": None,
}


def stored(tensor: torch.Tensor, float_dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` as the checkpoint stores it: a float32 one in `float_dtype` when given (never widened, and
    narrower floats such as fp16 are not re-rounded into another 16-bit format)."""
    return tensor.to(float_dtype) if float_dtype is not None and tensor.dtype == torch.float32 else tensor


def float_tensors(model: CausalLM, targets: list[Target], within: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Every tensor not replaced by quantized ones whose parameter name `within` takes, under HF names (fused
    float linears split by rows)."""
    quantized = {t.module for t in targets if t.scheme is not None}
    cast = {t.module: t.store_dtype for t in targets if t.store_dtype is not None}
    linears = dict(iter_linears(model))
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied lm_head is deduplicated by named_parameters
        if not within(name):
            continue
        mod_name, _, kind = name.rpartition(".")
        if mod_name in quantized and kind == "weight":
            continue
        if mod_name in linears:
            for hf, (lo, hi) in hf_parts(model, mod_name, linears[mod_name]).items():
                out[f"{hf}.{kind}"] = p.data[lo:hi].to(cast.get(mod_name, p.dtype)).contiguous().cpu()
        else:
            out[type(model).hf_module_name(name)] = p.data.contiguous().cpu()
    return out


def _module_tensors(qm: QuantizedModule, fmt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for hf, (lo, hi) in qm.target.parts.items():
        part: QuantizedWeight = slice_rows(qm.qw, lo, hi)
        assert qm.target.scheme is not None
        if fmt == "gptq":
            packed = pack_gptq(part)
        elif qm.target.scheme.int8_activations:
            packed = {"weight": (part.q.to(torch.int16) - 128).to(torch.int8).contiguous(),
                      "weight_scale": part.scale.to(part.scheme.torch_scale_dtype).contiguous()}
        else:
            packed = pack_compressed(part)
        out.update({f"{hf}.{k}": v.cpu() for k, v in packed.items()})
        if qm.bias is not None:
            out[f"{hf}.bias"] = qm.bias[lo:hi].contiguous().cpu()
    return out


def head_module(tied: bool) -> str:
    """The checkpoint module `--lm-head` quantizes: the embedding a tied head shares, else lm_head."""
    return "model.embed_tokens" if tied else "lm_head"


def _compressed_config(targets: list[Target], act_order: bool, kv_cache: str | None,
                       head: tuple[str, ModuleScheme] | None = None, kv_strategy: str = "tensor") -> dict[str, Any]:
    by_scheme: dict[ModuleScheme, list[str]] = {}
    ignore: list[str] = []
    for t in targets:
        if t.scheme is None:
            ignore.extend(hf for hf in t.parts if head is None or hf != head[0])
        else:
            by_scheme.setdefault(t.scheme, []).extend(t.parts)
    groups: dict[str, Any] = {}
    for i, (scheme, names) in enumerate(by_scheme.items()):
        group_targets = ["Linear"] if len(by_scheme) == 1 else names
        g = compressed_config_group(scheme.weights, targets=group_targets, act_order=act_order)
        if scheme.int8_activations:
            g["input_activations"] = dict(INT8_TOKEN_ACTIVATIONS)
            g["format"] = "int-quantized"
        groups[f"group_{i}"] = g
    if head is not None:  # named exactly: a name outranks the class name "Linear" (compressed-tensors, formats.py)
        groups[f"group_{len(groups)}"] = compressed_config_group(head[1].weights, targets=[head[0]])
    kv_scheme = dict(FP8_KV_CACHE_SCHEME, strategy=kv_strategy) if kv_cache == "fp8" else None
    return compressed_quantization_config(groups, ignore=ignore, kv_cache_scheme=kv_scheme)


def _gptq_config(targets: list[Target], act_order: bool, damp: float, static_groups: bool) -> dict[str, Any]:
    schemes = {t.scheme for t in targets if t.scheme is not None}
    if len(schemes) != 1:
        raise LlmoptError("the gptq format has one bits/group_size for the whole model; use --format "
                          "compressed-tensors for mixed schemes")
    scheme = schemes.pop()
    skipped = [hf for t in targets if t.scheme is None and t.module != "lm_head" and not t.kept_float
               for hf in t.parts]
    if skipped:
        raise LlmoptError(f"the gptq format cannot leave decoder linears unquantized ({skipped[0]}); "
                          "use --format compressed-tensors")
    # desc_act means "read g_idx, the columns are not in group order": only act-order without static groups
    # leaves them so. With static groups the g_idx is the identity, which every kernel reads as plain groups,
    # and vLLM refuses desc_act=True outright ("no longer supported"); one group per channel has nothing to
    # order either. static_groups records that GPTQ ran in act-order with its group scales fixed up front.
    grouped = scheme.weights.group_size != -1
    desc_act = act_order and not static_groups and grouped
    return gptq_quantization_config(scheme.weights, desc_act=desc_act, static_groups=act_order and static_groups
                                    and grouped, damp_percent=damp)


def quantization_config(targets: list[Target], fmt: str, act_order: bool, damp: float,
                        static_groups: bool = True, kv_cache: str | None = None,
                        head: tuple[str, ModuleScheme] | None = None, kv_strategy: str = "tensor") -> dict[str, Any]:
    """config.json's `quantization_config` (raises early when the format cannot express the plan). The gptq
    format records `desc_act` and, with it, whether the groups were static (identity g_idx) or not. `head`:
    the checkpoint module `--lm-head` quantizes (`head_module`) and its scheme; `kv_strategy`: an fp8
    kv_cache_scheme's "tensor" or "attn_head"."""
    if fmt == "gptq":
        if head is not None:
            raise LlmoptError("the gptq format cannot hold a quantized head; use --format compressed-tensors")
        return _gptq_config(targets, act_order, damp, static_groups)
    return _compressed_config(targets, act_order, kv_cache, head, kv_strategy)


def _checkpoint_order(name: str) -> tuple:
    """Tensors in model order (layer 2 before layer 10), so a shard holds whole consecutive layers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


class CheckpointExport:
    """Writes a quantized checkpoint into `out` as its decoder layers finish (the streamed quantizer hands
    each one over, then frees it), then the rest: embeddings, final norm and head (float32 ones in
    `float_dtype` when given, see `stored`), config.json (with quantization_config), tokenizer and generation config, and
    the KV scales when given: int8 [layers, kv_heads] K and V in `kv_cache_scales.json`, fp8 [layers] ("tensor")
    or [layers, kv_heads] ("attn_head") as each layer's `self_attn.k_scale` / `v_scale` (compressed-tensors'
    kv_cache_scheme, which vLLM reads; per head as [kv_heads, 1, 1], llm-compressor's shape). Tensors go to
    safetensors shards of at most `max_shard_bytes` (`models.shards`) as they come."""

    def __init__(self, out: Path, targets: list[Target], fmt: str, act_order: bool, damp: float,
                 max_shard_bytes: int, static_groups: bool = True, kv_cache: str | None = None,
                 float_dtype: torch.dtype | None = None, head: tuple[str, ModuleScheme] | None = None,
                 kv_strategy: str = "tensor") -> None:
        self.out, self.targets, self.fmt, self.kv_cache, self.kv_strategy = out, targets, fmt, kv_cache, kv_strategy
        self.float_dtype, self.head = float_dtype, head
        self.head_report: dict[str, Any] | None = None  # what `finish` made of the head, for the report
        self.qcfg = quantization_config(targets, fmt, act_order, damp, static_groups, kv_cache, head,
                                        kv_strategy)  # fails early
        self.writer = ShardWriter(out, max_shard_bytes)

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.writer.add({name: tensors[name] for name in sorted(tensors, key=_checkpoint_order)})

    def _quantized_head(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """`--lm-head`: the head's (or the tied embedding's) weight rounded to its scheme, packed as a
        compressed-tensors linear. In its checkpoint dtype, widened a block of rows at a time (RTN, the error,
        the packing): an 8B model's 128k head widened whole, with the error's and the packing's temporaries,
        took this step to 13 GB."""
        assert self.head is not None
        name, scheme = self.head
        qw = rtn_quantize(weight, scheme.weights)
        err = qw.relative_error(weight)
        self.head_report = {"module": name, "scheme": scheme.describe(), "weight_rel_err": round(err, 6),
                            "bytes": qw.nbytes()}
        return {f"{name}.{k}": v for k, v in pack_compressed(qw).items()}

    def add_layer(self, model: CausalLM, index: int, modules: dict[str, QuantizedModule]) -> None:
        """Decoder layer `index`: its float tensors (norms, with any AWQ/SmoothQuant folding) and `modules`."""
        prefix = f"layers.{index}."
        tensors = float_tensors(model, self.targets, lambda name: name.startswith(prefix))
        for qm in modules.values():
            tensors.update(_module_tensors(qm, self.fmt))
        self._add(tensors)

    def finish(self, source: CheckpointTensors, source_dir: Path, source_config: dict[str, Any], tied: bool,
               kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> list[Path]:
        """Everything outside the decoder layers (embeddings, final norm, head: never folded), copied from the
        `source` checkpoint one tensor at a time (float32 ones `stored` in `float_dtype`, the `head` module
        quantized); returns the shard files."""
        outer = [name for name in sorted(source.names(), key=_checkpoint_order)
                 if not (name.startswith("model.layers.") or "rotary_emb" in name or (tied and name == "lm_head.weight"))]
        for name, tensor in source.read(outer):
            if self.head is not None and name == f"{self.head[0]}.weight":
                self._add(self._quantized_head(tensor))
            else:
                self._add({name: stored(tensor, self.float_dtype)})
        if kv_scales is not None and self.kv_cache == "fp8":
            k, v = kv_scales
            per_head = self.kv_strategy == "attn_head"
            assert k.dim() == (2 if per_head else 1), "fp8 KV scales: [layers, kv_heads] per head, [layers] per layer"
            shape = (-1, 1, 1) if per_head else ()
            self._add({f"model.layers.{i}.self_attn.{kind}_scale": s[i].reshape(shape).float().clone()
                       for i in range(k.shape[0]) for kind, s in (("k", k), ("v", v))})
        shards = self.writer.finish()
        if kv_scales is not None and self.kv_cache != "fp8":
            write_kv_scales(self.out, *kv_scales)
        cfg = dict(source_config)
        cfg["quantization_config"] = self.qcfg
        cfg["torch_dtype"] = COMPUTE_DTYPE
        cfg["dtype"] = COMPUTE_DTYPE
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        for f in sorted(source_dir.iterdir()):
            if f.is_file() and f.name not in _SKIP_COPY and f.suffix not in (".safetensors", ".gguf", ".bin"):
                shutil.copy2(f, self.out / f.name)
        return shards
