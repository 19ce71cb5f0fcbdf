"""MoE families through quantization: RTN and GPTQ reach every expert, routers stay float, both export
formats load back in llmopt (exactly the quantized weights) and generate, and transformers (through
compressed-tensors) loads the compressed-tensors export with the same dequantized expert weights, as
does the compressed-tensors library itself; transformers parses the GPTQ export's config (loading it needs
optimum + gptqmodel: an xfail where they are missing). Calibration of experts the calibration set rarely routes to falls back to all tokens, with a warning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.loading.load import load_model
from llmopt.models import resolve_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.rows import slice_rows
from llmopt.quant.sequential import SequentialOptions, SequentialQuantizer
from llmopt.quant.targets import plan_targets
from tests.models.families import tiny_mixtral, tiny_qwen2_moe, tiny_qwen3_moe  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from _pipeline_helpers import assert_transformers_loads_export, calib_options, quantize_tiny  # noqa: E402

CASES = [
    ("tiny_qwen3_moe", "rtn", "compressed-tensors"),
    ("tiny_qwen3_moe", "rtn", "gptq"),
    ("tiny_qwen3_moe", "gptq", "compressed-tensors"),
    ("tiny_qwen3_moe", "gptq", "gptq"),
    ("tiny_mixtral", "gptq", "compressed-tensors"),
    ("tiny_mixtral", "rtn", "gptq"),
    ("tiny_qwen2_moe", "gptq", "compressed-tensors"),
    ("tiny_qwen2_moe", "rtn", "gptq"),
    ("tiny_qwen2_moe", "awq", "compressed-tensors"),
]


def _hf_expert_weight(hf, layer: int, expert: int, part: str) -> torch.Tensor:
    """One expert projection from transformers 5's fused 3-D expert tensors (gate_up = [gate; up])."""
    mlp = hf.model.layers[layer]
    experts = (mlp.mlp if hasattr(mlp, "mlp") else mlp.block_sparse_moe).experts
    if part == "down":
        return experts.down_proj[expert]
    gate_up = experts.gate_up_proj[expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if part == "gate" else gate_up[half:]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c[0:3]).removeprefix("tiny_") for c in CASES])
def test_moe_quantize_export_load_generate(case, tmp_path, monkeypatch, request):
    family, method, fmt = case
    src_dir = request.getfixturevalue(family)
    out = tmp_path / "q"
    extra = calib_options() if method != "rtn" else {}
    report, modules = quantize_tiny(monkeypatch, src_dir, out, scheme="w4a16", group_size=32, method=method,
                                    format=fmt, **extra)
    spec = resolve_model(str(src_dir)).spec
    # every expert of every sparse layer is quantized, with the requested method; routers are not
    for i in spec.moe_layers:
        for e in range(spec.num_experts):
            for rel in ("gate_up_proj", "down_proj"):
                assert modules[f"layers.{i}.mlp.experts.{e}.{rel}"].method == method
        assert not any(n.startswith(f"layers.{i}.mlp.gate") and not n.startswith(f"layers.{i}.mlp.gate_up")
                       for n in modules)
        assert f"layers.{i}.mlp.shared_expert_gate" not in modules
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == fmt
    assert any(n.startswith("Mixture-of-Experts: the table was measured on dense") for n in report.deployment["notes"])
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16)
    model = llm.engine.model
    for name, qm in modules.items():
        torch.testing.assert_close(model.get_submodule(name).dequantize(), qm.qw.dequantize(), atol=0, rtol=0)
    src = LLM(str(src_dir), dtype="float32", device="cpu", num_kv_blocks=16).engine.model
    router = model.layers[spec.moe_layers[0]].mlp.gate
    assert type(router) is torch.nn.Linear
    assert torch.equal(router.weight, src.layers[spec.moe_layers[0]].mlp.gate.weight)
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 4
    if fmt != "compressed-tensors":
        return
    assert any("mlp.gate" in n or "block_sparse_moe.gate" in n for n in cfg["ignore"])

    def check_experts(hf) -> None:  # transformers decompressed exactly our expert weights into its fused tensors
        for i in spec.moe_layers:
            for e in range(spec.num_experts):
                gu = modules[f"layers.{i}.mlp.experts.{e}.gate_up_proj"].qw
                w = _hf_expert_weight(hf, i, e, "gate")
                half = w.shape[0]
                assert torch.equal(w, slice_rows(gu, 0, half).dequantize(w.dtype)), (i, e)
                assert torch.equal(_hf_expert_weight(hf, i, e, "up"),
                                   slice_rows(gu, half, 2 * half).dequantize(w.dtype))
                down = modules[f"layers.{i}.mlp.experts.{e}.down_proj"].qw
                assert torch.equal(_hf_expert_weight(hf, i, e, "down"), down.dequantize(w.dtype))

    # transformers keeps the decompressed 3-D expert tensors in the scales' dtype (fp16) while we run
    # fp32, so the logits agree to fp16 rounding of the expert products, not to fp32 exactness
    assert_transformers_loads_export(out, llm, modules, check_weights=check_experts, atol=5e-3, rtol=1e-3)


def _gptq_run(model_dir, min_expert_tokens):
    resolved = resolve_model(str(model_dir))
    model = load_model(resolved, torch.float32, "cpu")
    targets, _ = plan_targets(model, QuantizeConfig(model=str(model_dir), output=Path("unused"), scheme="w4a16",
                                                    group_size=32, method="gptq"))
    windows = torch.randint(3, resolved.spec.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    opts = SequentialOptions(method="gptq", forward_dtype=torch.float32, min_expert_tokens=min_expert_tokens)
    return SequentialQuantizer(model, targets, opts, windows).run()


def test_under_routed_experts_warn_and_calibrate_on_all_tokens(tiny_mixtral):  # noqa: F811
    """128 calibration tokens, top-2 of 8 experts: 32 routed per expert on average."""
    routed = _gptq_run(tiny_mixtral, 0)  # no minimum: every expert on its routed tokens only
    assert routed.notes == []
    with pytest.warns(UserWarning, match=r"layers\.0\.mlp: experts 0, 1, 2, 3, 4, 5, 6, 7 were routed fewer than "
                                         r"1000 calibration tokens .* calibrated on all 128 tokens"):
        everyone = _gptq_run(tiny_mixtral, 1000)
    assert len(everyone.notes) == 2  # one per sparse layer
    # attention is calibrated identically; layer 0's experts saw other tokens, so got other weights
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"):
        assert torch.equal(routed.modules[name].qw.q, everyone.modules[name].qw.q)
    changed = [e for e in range(8) if not torch.equal(routed.modules[f"layers.0.mlp.experts.{e}.down_proj"].qw.q,
                                                     everyone.modules[f"layers.0.mlp.experts.{e}.down_proj"].qw.q)]
    assert len(changed) >= 6
    # (that the block output still uses only the routed tokens is test_moe's calibrate_all check)
    # default minimum = hidden size (64): only the experts below it fall back
    default = _gptq_run(tiny_mixtral, None)
    assert default.notes and all("fewer than 64 calibration tokens" in n for n in default.notes)


def test_override_never_quantizes_the_router(tiny_qwen2_moe):  # noqa: F811
    model = load_model(resolve_model(str(tiny_qwen2_moe)), torch.float32, "cpu")
    cfg = QuantizeConfig(model=str(tiny_qwen2_moe), output=Path("unused"), scheme="w4a16", group_size=32,
                         override=[r"mlp\.=w8a16"])
    targets = {t.module: t for t in plan_targets(model, cfg)[0]}
    assert targets["layers.1.mlp.gate"].scheme is None and targets["layers.1.mlp.gate"].kept_float
    assert targets["layers.1.mlp.shared_expert_gate"].scheme is None
    assert targets["layers.1.mlp.experts.3.down_proj"].scheme.preset == "w8a16"
    assert targets["layers.1.mlp.shared_expert.gate_up_proj"].scheme.preset == "w8a16"


def test_compressed_tensors_library_decompresses_every_expert_exactly(tiny_qwen3_moe, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    out = tmp_path / "q"
    _, modules = quantize_tiny(monkeypatch, tiny_qwen3_moe, out, scheme="w4a16", group_size=32,
                               format="compressed-tensors")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    qcfg = QuantizationConfig.model_validate(cfg)
    group = next(iter(qcfg.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(group.format or qcfg.format)
    tensors = load_file(str(out / "model.safetensors"))
    experts = 0
    for qm in modules.values():
        for hf, (lo, hi) in qm.target.parts.items():
            local = {k[len(hf) + 1:]: v for k, v in tensors.items() if k.startswith(hf + ".")}
            got = compressor.decompress(local, group)["weight"]
            assert torch.equal(got.float(), slice_rows(qm.qw, lo, hi).dequantize(got.dtype).float()), hf
            experts += ".experts." in hf
    assert experts == 2 * 8 * 3  # 2 sparse layers x 8 experts x gate, up, down
    assert {"model.layers.0.mlp.gate", "model.layers.2.mlp.gate"} <= set(cfg["ignore"])


def test_transformers_parses_the_moe_gptq_config_but_cannot_load_it_here(tiny_mixtral, tmp_path, monkeypatch):  # noqa: F811
    """transformers reads our GPTQ config, but loading GPTQ weights needs optimum + gptqmodel (not
    installed here, for any family): proven, not assumed."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPTQConfig

    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_mixtral, out, scheme="w4a16", group_size=32, format="gptq")
    parsed = GPTQConfig.from_dict(AutoConfig.from_pretrained(str(out)).quantization_config)
    assert (parsed.bits, parsed.group_size) == (4, 32)
    try:
        import gptqmodel  # noqa: F401
        import optimum  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="optimum"):
            AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        pytest.xfail("transformers loads GPTQ checkpoints only through optimum + gptqmodel, not installed here")
    AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
