"""compressed-tensors checkpoint tensors (the layout vLLM and llm-compressor read).

`pack-quantized` (int4/int8), per linear `<name>`:

* `weight_packed` int32 [out, ceil(in·bits/32)]: codes packed along the input dim, LSB first.
  The library quantizes to signed q_s ∈ [−2^(bits−1), 2^(bits−1)) and packs q_s + 2^(bits−1), which
  is exactly our unsigned code q, so q is packed as is.
* `weight_scale` [out, n_groups] (n_groups = 1 for strategy "channel").
* `weight_zero_point` (asymmetric only) int32 [ceil(out·bits/32), n_groups]: zeros packed along the
  *output* dim, again as the unsigned value (signed zero + 2^(bits−1)).
* `weight_shape` int64 [2] = (out, in).

Dequantization (library): w = (q_s − zp_s) · scale = (q − zero) · scale, symmetric zp_s = 0.

`float-quantized` (fp8): `weight` float8_e4m3fn [out, in] and `weight_scale` [out, 1].

Act-order with non-contiguous groups (`weight_g_idx`, actorder "group") was removed from
compressed-tensors (0.20 rejects it), so it is refused here: quantize with GPTQ static groups
(identity g_idx, recorded as actorder "weight") or export the GPTQ format instead.
"""

from __future__ import annotations

from typing import Any

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.packing import pack_int32
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.scheme import QuantScheme


def compressed_format(scheme: QuantScheme) -> str:
    """The compressed-tensors `format` for a scheme."""
    return "float-quantized" if scheme.kind == "fp8" else "pack-quantized"


def pack_compressed(qw: QuantizedWeight, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per-linear tensors (keys without the module prefix) in the scheme's compressed-tensors format.

    Scales are written in `scale_dtype` (default: the scheme's, to which they were rounded while
    quantizing, so the library dequantizes exactly what the algorithm chose).
    """
    scheme = qw.scheme
    sdt = scale_dtype or scheme.torch_scale_dtype
    if scheme.kind == "fp8":
        return {"weight": qw.q.contiguous(), "weight_scale": qw.scale.to(sdt).reshape(-1, 1).contiguous()}
    if qw.is_act_order:
        raise LlmoptError(
            "compressed-tensors no longer reads group act-order (weight_g_idx); "
            "quantize with static_groups=True or export the gptq format"
        )
    bits = scheme.bits
    if int(qw.q.max()) > scheme.maxq:
        raise LlmoptError(f"codes exceed {bits} bits")
    out = {
        "weight_packed": pack_int32(qw.q, bits, dim=1),
        "weight_scale": qw.scale.to(sdt).contiguous(),
        "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64),
    }
    if qw.zero is not None:
        if int(qw.zero.max()) > scheme.maxq:
            raise LlmoptError(f"zero points exceed {bits} bits")
        out["weight_zero_point"] = pack_int32(qw.zero, bits, dim=0)
    return out


def compressed_config_group(
    scheme: QuantScheme, targets: list[str] | tuple[str, ...] = ("Linear",), act_order: bool = False
) -> dict[str, Any]:
    """One `config_groups` entry: which modules (`targets`, class names or `re:` patterns) get `scheme`."""
    strategy = "channel" if scheme.group_size == -1 else "group"
    weights: dict[str, Any] = {
        "num_bits": scheme.bits,
        "type": "float" if scheme.kind == "fp8" else "int",
        "symmetric": scheme.symmetric,
        "strategy": strategy,
        "group_size": None if strategy == "channel" else scheme.group_size,
        "dynamic": False,
        "observer": "minmax",
    }
    # Per channel there is one group and nothing to declare; compressed-tensors releases that vLLM ships
    # reject actorder on a channel strategy ("Must use group quantization strategy in order to apply
    # activation ordering"), and GPTQ's default act-order also runs on per-channel int8 (w8a16, w8a8).
    if act_order and strategy == "group":
        weights["actorder"] = "weight"
    return {
        "targets": list(targets),
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": compressed_format(scheme),
    }


def compressed_quantization_config(
    groups: QuantScheme | dict[str, dict[str, Any]],
    ignore: list[str] | tuple[str, ...] = ("lm_head",),
    kv_cache_scheme: dict[str, Any] | None = None,
    act_order: bool = False,
) -> dict[str, Any]:
    """The `quantization_config` of config.json for a compressed-tensors checkpoint.

    Pass one QuantScheme (applied to every Linear not in `ignore`) or ready `config_groups`
    built with `compressed_config_group`. `kv_cache_scheme` is passed through (e.g.
    {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}).
    """
    if isinstance(groups, QuantScheme):
        groups = {"group_0": compressed_config_group(groups, act_order=act_order)}
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": kv_cache_scheme,
        "global_compression_ratio": None,
    }
