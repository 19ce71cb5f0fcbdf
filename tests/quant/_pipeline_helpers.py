"""Helpers for the model-level quantization tests: run `quantize_model` on the tiny model and keep
the QuantizedWeights it wrote, so a test can compare them with what llmopt loads back, and check that
transformers loads a compressed-tensors export to the same weights and logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmopt import LLM
from llmopt.engine.scoring import iter_logits
from llmopt.quant.export import CheckpointExport
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.report import QuantReport
from llmopt.quant.rows import slice_rows
from llmopt.quant.sequential import QuantizedModule

REPO = Path(__file__).resolve().parents[2]
KB_CALIB = REPO / "calibration_data" / "kb_calibration.jsonl"
KB_FACTS = REPO / "calibration_data" / "kb_facts.md"
HF_SEQS = [list(range(3, 200, 7)), [5, 9, 17, 33]]


def quantize_tiny(monkeypatch, model: Path, out: Path, plan: Any = None,
                  **options: Any) -> tuple[QuantReport, dict[str, QuantizedModule]]:
    """quantize_model(...) plus the modules handed to the checkpoint writer (`plan`: an auto plan to reuse)."""
    captured: dict[str, Any] = {"modules": {}}
    real = CheckpointExport.add_layer

    def spy(self, model, index, modules):
        captured["modules"].update(modules)
        return real(self, model, index, modules)

    monkeypatch.setattr(CheckpointExport, "add_layer", spy)
    options.setdefault("device", "cpu")
    options.setdefault("forward_dtype", "float32")
    report = quantize_model(QuantizeConfig(model=str(model), output=out, **options), plan=plan)
    return report, captured["modules"]


def held_out_ppl(model: Path, text: str, tokens: int = 4096, seq_len: int = 512) -> float:
    """Perplexity of the engine on `model` over the first `tokens` tokens of `text`, in windows of `seq_len`."""
    from llmopt.eval.engines import EngineOptions, build_llm
    from llmopt.eval.perplexity import score_text

    engine = build_llm(str(model), EngineOptions(max_batch_tokens=2048)).engine
    ids = engine.tokenizer.encode(text)[:tokens]
    assert len(ids) == tokens
    return score_text(engine, ids, seq_len).nll[0].ppl


def held_out_ppl_kl(base: str | Path, models: list[Path], text: str, tokens: int = 4096,
                    seq_len: int = 512) -> list[tuple[float, float]]:
    """(perplexity, mean KL(base || model) per token) of each of `models` over the first `tokens` tokens of `text`,
    from one scoring pass each, as `llmopt eval --baseline` measures them (the base's top-k log-probs kept once)."""
    from llmopt.eval.divergence import BaselineTopK
    from llmopt.eval.engines import EngineOptions, build_llm
    from llmopt.eval.perplexity import score_text

    engine = build_llm(str(base), EngineOptions(max_batch_tokens=2048)).engine
    ids = engine.tokenizer.encode(text)[:tokens]
    assert len(ids) == tokens
    reference = BaselineTopK()
    score_text(engine, ids, seq_len, record=reference)
    out = []
    for m in models:
        s = score_text(build_llm(str(m), EngineOptions(max_batch_tokens=2048)).engine, ids, seq_len,
                       compare_to=reference)
        assert s.divergence is not None
        out.append((s.nll[0].ppl, s.divergence.kl_div))
    return out


def calib_options(num_samples: int = 6, seq_len: int = 64) -> dict[str, Any]:
    return {"calib_data": [str(KB_CALIB)], "num_samples": num_samples, "seq_len": seq_len}


def assert_transformers_loads_export(out: Path, llm: LLM, modules: dict[str, QuantizedModule], *,
                                     check_weights: Callable[[Any], None] | None = None,
                                     atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """transformers (through compressed-tensors) loads the compressed-tensors export `out` with no
    missing, unexpected or mismatched tensors, decompresses exactly the weights in `modules`, and its
    logits on HF_SEQS match `llm`'s. `check_weights(hf)` replaces the per-HF-module weight comparison
    (for MoE experts, which transformers fuses into 3-D tensors); skipped without compressed-tensors."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():  # (transformers decompresses the weights on the first forward)
        ref = [hf(torch.tensor([s])).logits[0] for s in HF_SEQS]
    if check_weights is not None:
        check_weights(hf)
    else:
        for qm in modules.values():  # transformers decompressed exactly our weights
            for hf_name, (lo, hi) in qm.target.parts.items():
                w = hf.get_submodule(hf_name).weight
                assert torch.equal(w.float(), slice_rows(qm.qw, lo, hi).dequantize(w.dtype).float()), hf_name
    got = dict(iter_logits(llm.engine, HF_SEQS))
    for i, r in enumerate(ref):
        torch.testing.assert_close(got[i], r, atol=atol, rtol=rtol)
