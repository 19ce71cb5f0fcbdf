"""Our compressed-tensors tensors, decompressed by the compressed-tensors library itself."""

from __future__ import annotations

import pytest
import torch
from _qhelpers import correlated_inputs

from llmopt.errors import LlmoptError
from llmopt.quant import (
    QuantScheme,
    compressed_config_group,
    compressed_quantization_config,
    fp8_quantize,
    gptq_quantize,
    pack_compressed,
    rtn_quantize,
)

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402


def _library_decompress(cfg: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    parsed = QuantizationConfig.model_validate(cfg)
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    return compressor.decompress(dict(tensors), scheme)["weight"]


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(bits=4, group_size=32, symmetric=True),
        QuantScheme(bits=4, group_size=32, symmetric=False),
        QuantScheme(bits=8, group_size=-1, symmetric=True),
        QuantScheme(bits=8, group_size=-1, symmetric=False),
        QuantScheme(bits=4, group_size=-1, symmetric=True, scale_dtype="bfloat16"),
    ],
    ids=lambda s: f"{s.describe()} {s.scale_dtype}",
)
def test_library_decompresses_pack_quantized_exactly(scheme):
    w = torch.randn(48, 96) * 0.05
    w[1] += 0.2  # all-positive row: asym zero at its smallest
    qw = rtn_quantize(w, scheme)
    tensors = pack_compressed(qw)
    assert tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_packed"].shape == (48, 96 * scheme.bits // 32)
    assert tensors["weight_shape"].tolist() == [48, 96]
    assert tensors["weight_scale"].dtype == scheme.torch_scale_dtype
    assert ("weight_zero_point" in tensors) == (not scheme.symmetric)
    cfg = compressed_quantization_config(scheme, ignore=["lm_head"])
    got = _library_decompress(cfg, tensors)
    # the library computes in the scale dtype; our scales are exact in it, so this is bit-exact
    assert got.dtype == scheme.torch_scale_dtype
    assert torch.equal(got, qw.dequantize(scheme.torch_scale_dtype))


def test_library_decompresses_gptq_static_act_order():
    x = correlated_inputs(256, 64) * torch.linspace(0.2, 2, 64)
    scheme = QuantScheme(bits=4, group_size=32)
    qw, _ = gptq_quantize(
        torch.randn(16, 64), 2 * x.t() @ x / 256, scheme, act_order=True, static_groups=True
    )
    cfg = compressed_quantization_config(scheme, act_order=True)
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    got = _library_decompress(cfg, pack_compressed(qw))
    assert torch.equal(got, qw.dequantize(torch.float16))
    dynamic, _ = gptq_quantize(torch.randn(16, 64), 2 * x.t() @ x / 256, scheme, act_order=True,
                               static_groups=False)
    with pytest.raises(LlmoptError):
        pack_compressed(dynamic)


def test_actorder_is_declared_for_groups_only():
    """GPTQ runs act-order by default, also for per-channel int8 (w8a16, w8a8); a channel has one group, so
    nothing is declared there: compressed-tensors releases that vLLM ships reject actorder on a channel strategy
    ("Must use group quantization strategy in order to apply activation ordering")."""
    assert compressed_config_group(QuantScheme(bits=4, group_size=32), act_order=True)["weights"]["actorder"] == "weight"
    assert "actorder" not in compressed_config_group(QuantScheme(bits=8, group_size=-1), act_order=True)["weights"]


def test_library_decompresses_fp8_exactly():
    w = torch.randn(32, 64) * 0.02
    qw = fp8_quantize(w)
    tensors = pack_compressed(qw)
    assert tensors["weight"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (32, 1)
    cfg = compressed_quantization_config(qw.scheme)
    assert cfg["format"] == "float-quantized"
    got = _library_decompress(cfg, tensors)
    assert torch.equal(got, qw.dequantize())


def test_quantization_config_shape():
    int4 = QuantScheme(bits=4, group_size=64)
    cfg = compressed_quantization_config(int4, ignore=["lm_head"], kv_cache_scheme=None)
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    assert cfg["ignore"] == ["lm_head"]
    weights = cfg["config_groups"]["group_0"]["weights"]
    assert cfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert weights == weights | {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 64,
    }
    chan = compressed_config_group(QuantScheme(bits=8, group_size=-1), targets=["re:.*down_proj"])
    assert chan["weights"]["strategy"] == "channel" and chan["weights"]["group_size"] is None
    mixed = compressed_quantization_config({"group_0": compressed_config_group(int4), "group_1": chan})
    assert mixed["format"] == "pack-quantized"
    fp8 = compressed_config_group(fp8_quantize(torch.randn(4, 8)).scheme, targets=["re:.*lm_head"])
    assert compressed_quantization_config({"a": chan, "b": fp8})["format"] == "mixed-precision"
    # the library accepts every variant
    for c in (cfg, mixed, compressed_quantization_config({"a": chan, "b": fp8})):
        QuantizationConfig.model_validate(c)
