"""Other readers of our checkpoints: the compressed-tensors library decompresses them to exactly our
weights; transformers parses our GPTQ config (its GPTQ kernels need optimum + gptqmodel, which are not
installed here); INT8 KV scales stay out of quantization_config. transformers loading and running our
compressed-tensors checkpoints: test_quant_transformers_interop.py."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline_helpers import calib_options, quantize_tiny
from safetensors.torch import load_file

from llmopt.quant.rows import slice_rows

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402


def _library_weight(qcfg: QuantizationConfig, tensors: dict[str, torch.Tensor], hf: str) -> torch.Tensor:
    group = next(g for g in qcfg.config_groups.values()
                 if any(t == "Linear" or match_name(hf, t) for t in g.targets))
    compressor = BaseCompressor.get_value_from_registry(group.format or qcfg.format)
    local = {k[len(hf) + 1:]: v for k, v in tensors.items() if k.startswith(hf + ".") and not k.endswith(".bias")}
    return compressor.decompress(local, group)["weight"]


@pytest.mark.parametrize("options", [
    {"scheme": "w4a16", "group_size": 32},
    {"scheme": "w4a16", "group_size": 64, "symmetric": False},
    {"scheme": "w8a16"},
    {"scheme": "fp8"},
    {"scheme": "w8a8", **calib_options()},
    {"scheme": "w4a16", "group_size": 32, "override": ["mlp=w8a16"], "ignore": [r"layers\.1\.self_attn"]},
], ids=["w4-sym", "w4-asym", "w8", "fp8", "w8a8", "mixed"])
def test_compressed_tensors_library_decompresses_our_checkpoint_exactly(tiny_llama, tmp_path, monkeypatch, options):
    out = tmp_path / "q"
    _, modules = quantize_tiny(monkeypatch, tiny_llama, out, format="compressed-tensors", **options)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    qcfg = QuantizationConfig.model_validate(cfg)
    tensors = load_file(str(out / "model.safetensors"))
    checked = 0
    for qm in modules.values():
        for hf, (lo, hi) in qm.target.parts.items():
            ours = slice_rows(qm.qw, lo, hi)
            got = _library_weight(qcfg, tensors, hf)
            assert torch.equal(got.float(), ours.dequantize(got.dtype).float()), hf
            assert hf not in qcfg.ignore
            checked += 1
    assert checked == sum(len(qm.target.parts) for qm in modules.values())
    for hf in cfg["ignore"]:
        assert f"{hf}.weight" in tensors or hf == "lm_head"


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_int8_kv_scales_stay_out_of_quantization_config(tiny_llama, tmp_path, monkeypatch, fmt):
    """vLLM refuses a checkpoint whose kv_cache_scheme is int8, so the scales live in llmopt's own
    kv_cache_scales.json: no kv_cache_scheme, no k_scale/v_scale tensors, and our engine still reads them."""
    from llmopt import LLM
    from llmopt.quant.kv_scales import KV_SCALES_FILE

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w8a16", format=fmt, kv_cache="int8", **calib_options())
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg.get("kv_cache_scheme") is None
    if fmt == "compressed-tensors":
        QuantizationConfig.model_validate(cfg)
    tensors = load_file(str(out / "model.safetensors"))
    assert not [k for k in tensors if k.endswith(("k_scale", "v_scale"))]
    doc = json.loads((out / KV_SCALES_FILE).read_text())
    assert (doc["num_layers"], doc["num_kv_heads"]) == (2, 2)
    cache = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16).engine.kv_cache
    assert cache.quantized
    assert torch.equal(cache.static_k_scale.cpu(), torch.tensor(doc["k_scale"], dtype=torch.float32))
    assert torch.equal(cache.static_v_scale.cpu(), torch.tensor(doc["v_scale"], dtype=torch.float32))


def test_legacy_int8_kv_cache_scheme_checkpoints_still_load(tiny_llama, tmp_path, monkeypatch):
    """Checkpoints written before kv_cache_scales.json (int8 kv_cache_scheme + per-layer tensors)."""
    from safetensors.torch import save_file

    from llmopt.loading.formats import kv_cache_scales
    from llmopt.models.resolve import resolve_model
    from llmopt.quant.kv_scales import KV_SCALES_FILE

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w8a16", kv_cache="int8", **calib_options())
    new = kv_cache_scales(resolve_model(str(out)))
    assert new is not None
    (out / KV_SCALES_FILE).unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "attn_head", "dynamic": False,
        "observer": "minmax"}
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = new.k_scale[i].reshape(-1, 1, 1).contiguous()
        tensors[f"model.layers.{i}.self_attn.v_scale"] = new.v_scale[i].reshape(-1, 1, 1).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    old = kv_cache_scales(resolve_model(str(out)))
    assert old is not None
    assert torch.equal(old.k_scale, new.k_scale) and torch.equal(old.v_scale, new.v_scale)


def test_a_bad_kv_scales_file_is_one_clear_error(tiny_llama, tmp_path, monkeypatch):
    from llmopt.errors import LlmoptError
    from llmopt.loading.formats import kv_cache_scales
    from llmopt.models.resolve import resolve_model
    from llmopt.quant.kv_scales import KV_SCALES_FILE

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w8a16", kv_cache="int8", **calib_options(2, 32))
    doc = json.loads((out / KV_SCALES_FILE).read_text())
    doc["k_scale"] = doc["k_scale"][:1]
    (out / KV_SCALES_FILE).write_text(json.dumps(doc))
    with pytest.raises(LlmoptError, match=r"k_scale is \[1, 2\], the model has 2 layers x 2 KV heads"):
        kv_cache_scales(resolve_model(str(out)))


@pytest.mark.parametrize("edit, msg", [
    ("count", r"model.layers.0.self_attn.k_scale holds 3 scales; expected 1 or one per KV head \(2\)"),
    ("strategy", r"kv_cache_scheme .* is not supported"),
], ids=["scale-count", "strategy"])
def test_a_bad_fp8_kv_cache_scheme_is_one_clear_error(tiny_llama, tmp_path, monkeypatch, edit, msg):
    """An fp8 kv_cache_scheme we cannot run (a scale count that is neither per layer nor per KV head, or a
    strategy such as per channel) is refused in one line, not run with wrong scales."""
    from safetensors.torch import save_file

    from llmopt.errors import LlmoptError
    from llmopt.loading.formats import kv_cache_scales
    from llmopt.models.resolve import resolve_model

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w8a16", kv_cache="fp8", kv_cache_strategy="attn_head",
                  **calib_options(2, 32))
    assert kv_cache_scales(resolve_model(str(out))).k_scale.shape == (2, 2)
    if edit == "count":
        tensors = load_file(str(out / "model.safetensors"))
        tensors["model.layers.0.self_attn.k_scale"] = torch.ones(3, 1, 1)
        save_file(tensors, str(out / "model.safetensors"))
    else:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LlmoptError, match=msg):
        kv_cache_scales(resolve_model(str(out)))


def test_transformers_parses_our_gptq_config(tiny_llama, tmp_path, monkeypatch):
    from transformers import AutoConfig, GPTQConfig

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w4a16", group_size=32, format="gptq")
    qc = AutoConfig.from_pretrained(str(out)).quantization_config
    parsed = GPTQConfig.from_dict(qc)
    assert (parsed.bits, parsed.group_size, parsed.sym, parsed.desc_act) == (4, 32, True, False)
    assert qc["checkpoint_format"] == "gptq" and qc["quant_method"] == "gptq"
