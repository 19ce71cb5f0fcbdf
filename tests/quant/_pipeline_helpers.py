"""Helpers for the model-level quantization tests: run `quantize_model` on the tiny model and keep
the QuantizedWeights it wrote, so a test can compare them with what llmopt loads back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.quant import pipeline
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.report import QuantReport
from llmopt.quant.sequential import QuantizedModule

REPO = Path(__file__).resolve().parents[2]
KB_CALIB = REPO / "calibration_data" / "kb_calibration.jsonl"
KB_FACTS = REPO / "calibration_data" / "kb_facts.md"


def quantize_tiny(monkeypatch, model: Path, out: Path, **options: Any) -> tuple[QuantReport, dict[str, QuantizedModule]]:
    """quantize_model(...) plus the modules handed to the checkpoint writer."""
    captured: dict[str, Any] = {}
    real = pipeline.write_checkpoint

    def spy(*args, **kwargs):
        captured["modules"] = args[5]
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "write_checkpoint", spy)
    options.setdefault("device", "cpu")
    options.setdefault("forward_dtype", "float32")
    report = quantize_model(QuantizeConfig(model=str(model), output=out, **options))
    return report, captured["modules"]


def calib_options(num_samples: int = 6, seq_len: int = 64) -> dict[str, Any]:
    return {"calib_data": [str(KB_CALIB)], "num_samples": num_samples, "seq_len": seq_len}
