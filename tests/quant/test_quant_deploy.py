"""Which tools run each checkpoint: one table (llmopt/quant/deploy.py), reported at export time."""

from __future__ import annotations

import json

import pytest
from _pipeline_helpers import calib_options, quantize_tiny

from llmopt.quant.deploy import TABLE, TOOLS, Cell, combine, deployment, row_key
from llmopt.quant.recipe import make_scheme


@pytest.mark.parametrize("preset, fmt, sym, key", [
    ("w8a16", "compressed-tensors", True, "ct-w8a16"),
    ("w8a16", "compressed-tensors", False, "ct-w8a16-asym"),
    ("w4a16", "compressed-tensors", True, "ct-w4a16"),
    ("w4a16", "compressed-tensors", False, "ct-w4a16-asym"),
    ("fp8", "compressed-tensors", True, "ct-fp8"),
    ("w8a8", "compressed-tensors", True, "ct-w8a8"),
    ("w4a16", "gptq", True, "gptq-w4"),
    ("w8a16", "gptq", True, "gptq-w8"),
])
def test_every_scheme_and_format_has_a_row(preset, fmt, sym, key):
    assert row_key(make_scheme(preset, None, sym), fmt) == key
    row = TABLE[key]
    assert all(row.cell(t).how for t in TOOLS)


def test_the_measured_cells():
    """The colleague's measurements (transformers 5.24, vLLM CPU 0.32) are what the table says."""
    assert TABLE["ct-w8a16"].vllm_cpu.runs is False and "uint8b128" in TABLE["ct-w8a16"].vllm_cpu.how
    assert TABLE["ct-w4a16"].vllm_cpu.runs is True
    assert TABLE["ct-fp8"].vllm_cpu.runs is False and "ScaledMM" in TABLE["ct-fp8"].vllm_cpu.how
    assert TABLE["ct-w8a8"].vllm_cpu.runs is True and TABLE["gptq-w4"].vllm_cpu.runs is True
    assert "optimum + gptqmodel" in TABLE["gptq-w4"].transformers.how
    assert all(TABLE[k].vllm_cuda.runs for k in ("ct-w8a16", "ct-w4a16", "ct-fp8", "ct-w8a8", "gptq-w4"))
    assert all(TABLE[k].cell(t).measured for k, t in [("ct-w8a16", "vllm_cpu"), ("ct-fp8", "vllm_cpu"),
                                                      ("ct-w4a16", "transformers")])


def test_a_mixed_checkpoint_runs_only_where_every_scheme_runs():
    yes, no, unknown = Cell(True, "a", True), Cell(False, "b", True), Cell(None, "c")
    assert combine([yes, no, unknown]) == Cell(False, "b", True)
    assert combine([yes, unknown]).runs is None
    assert combine([yes, yes]) == Cell(True, "a", True)
    dep = deployment([make_scheme("w4a16", 32, True), make_scheme("w8a16", None, True)], "compressed-tensors")
    assert dep["schemes"] == ["ct-w4a16", "ct-w8a16"]
    assert dep["vllm_cpu"]["runs"] is False and dep["vllm_cuda"]["runs"] is True and dep["notes"] == []


@pytest.mark.parametrize("options, cpu", [
    ({"scheme": "w8a16"}, False),
    ({"scheme": "w4a16", "group_size": 32}, True),
    ({"scheme": "w4a16", "group_size": 32, "override": ["mlp=w8a16"]}, False),
    ({"scheme": "w8a16", "kv_cache": "int8", **calib_options(2, 32)}, False),
], ids=["w8", "w4", "mixed", "w8-kv"])
def test_quantize_reports_where_the_checkpoint_runs(tiny_llama, tmp_path, monkeypatch, options, cpu):
    out = tmp_path / "q"
    report, _ = quantize_tiny(monkeypatch, tiny_llama, out, **options)
    saved = json.loads((out / "quantization_report.json").read_text())["deployment"]
    assert saved == report.deployment
    assert saved["vllm_cpu"]["runs"] is cpu and saved["transformers"]["runs"] is True
    assert bool(saved["notes"]) == ("kv_cache" in options)
    if "kv_cache" in options:
        assert "kv_cache_scales.json" in saved["notes"][0]


def test_the_printed_summary_names_each_backend(tiny_llama, tmp_path, monkeypatch):
    from rich.console import Console

    report, _ = quantize_tiny(monkeypatch, tiny_llama, tmp_path / "q", scheme="fp8")
    console = Console(width=250, record=True)
    report.render(console)
    text = console.export_text()
    assert "runs on vLLM CPU" in text and "no: no ScaledMM kernel for fp8 on CPU (measured)" in text
    assert "runs on vLLM CUDA" in text and "runs on transformers" in text
