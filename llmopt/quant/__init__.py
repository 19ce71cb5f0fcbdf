"""Quantization library: schemes, algorithms (RTN, GPTQ, AWQ, fp8, SmoothQuant), observers,
checkpoint formats (GPTQ, compressed-tensors) and runtime low-bit linears (this namespace: the
tensor-level APIs), plus the model-level pipeline in its own modules, imported where used so that
this package stays light: `recipe` (QuantizeConfig), `targets` (which linear gets which scheme),
`sequential` (layer-by-layer GPTQ/AWQ/SmoothQuant), `export` / `checkpoint` (write / load
checkpoints), `pipeline` (`llmopt quantize`) and `report`. See docs/QUANTIZE.md.
"""

from __future__ import annotations

from llmopt.quant.awq import (
    awq_search_clip,
    awq_search_scales,
    fold_scales_into_bias,
    fold_scales_into_linear_rows,
    fold_scales_into_norm,
    scale_linear_inputs,
)
from llmopt.quant.dequantized import DequantizedLinear
from llmopt.quant.dynamic_int8 import Int8DynamicActivationLinear, quantize_per_token
from llmopt.quant.fp8 import FP8_E4M3_MAX, FP8_SCHEME, fp8_dequantize, fp8_quantize
from llmopt.quant.gptq import GPTQ, GPTQFactor, gptq_factor, gptq_quantize
from llmopt.quant.linear import (
    Fp8WeightOnlyLinear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    quantized_linear,
)
from llmopt.quant.observers import (
    ChannelStats,
    EmaObserver,
    MinMaxObserver,
    MseObserver,
    Observer,
    PercentileObserver,
)
from llmopt.quant.pack_compressed import (
    compressed_config_group,
    compressed_format,
    compressed_quantization_config,
    pack_compressed,
)
from llmopt.quant.pack_gptq import gptq_quantization_config, pack_gptq, unpack_gptq
from llmopt.quant.packing import pack_int32, unpack_int32
from llmopt.quant.qtensor import QuantizedWeight, identity_g_idx
from llmopt.quant.rows import ConcatLinear, concat_rows, slice_rows
from llmopt.quant.rtn import params_from_range, rtn_fake_quantize, rtn_quantize
from llmopt.quant.scheme import QuantScheme
from llmopt.quant.smoothquant import smoothing_scales

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_SCHEME",
    "GPTQ",
    "GPTQFactor",
    "ChannelStats",
    "ConcatLinear",
    "DequantizedLinear",
    "EmaObserver",
    "Fp8WeightOnlyLinear",
    "Int4WeightOnlyLinear",
    "Int8DynamicActivationLinear",
    "Int8WeightOnlyLinear",
    "MinMaxObserver",
    "MseObserver",
    "Observer",
    "PercentileObserver",
    "QuantScheme",
    "QuantizedWeight",
    "awq_search_clip",
    "awq_search_scales",
    "compressed_config_group",
    "concat_rows",
    "compressed_format",
    "compressed_quantization_config",
    "fold_scales_into_bias",
    "fold_scales_into_linear_rows",
    "fold_scales_into_norm",
    "fp8_dequantize",
    "fp8_quantize",
    "gptq_factor",
    "gptq_quantization_config",
    "gptq_quantize",
    "identity_g_idx",
    "pack_compressed",
    "pack_gptq",
    "pack_int32",
    "params_from_range",
    "quantize_per_token",
    "quantized_linear",
    "rtn_fake_quantize",
    "rtn_quantize",
    "scale_linear_inputs",
    "slice_rows",
    "smoothing_scales",
    "unpack_gptq",
    "unpack_int32",
]
