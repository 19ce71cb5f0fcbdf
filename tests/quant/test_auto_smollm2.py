"""--scheme auto on SmolLM2 at the bits of uniform W4A16 g32 (4.5 per weight, scales counted) does less
held-out damage than uniform g32 by the same method (issue #32, slow). RTN on both sides, so the test
measures the search and not the method: the mix must put the bits where they remove the most damage. Damage
twice: perplexity, the issue's target, and KL to the unquantized model, what the search minimizes (on held-out
text here, not the calibration sample it chose on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from llmopt.eval.textdata import load_text
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from tests.conftest import requires_smollm2
from tests.quant._pipeline_helpers import held_out_ppl_kl

pytestmark = [pytest.mark.slow, requires_smollm2]

CALIB = Path(__file__).resolve().parents[2] / "calibration_data"


def test_auto_at_g32_bits_beats_uniform_g32_on_held_out_text(shared_data, tmp_path):
    text = load_text(shared_data / "wikitext2-valid.txt")[:40000]
    quiet = Console(stderr=True, quiet=True)
    calib = {"num_samples": 8, "calib_data": [str(CALIB / "general_prose.jsonl"), str(CALIB / "kb_calibration.jsonl")]}
    quantize_model(QuantizeConfig(model="smollm2-135m", scheme="w4a16", group_size=32, device="cpu",
                                  output=tmp_path / "uniform"), quiet)
    quantize_model(QuantizeConfig(model="smollm2-135m", scheme="auto", target_bits=4.5, device="cpu",
                                  output=tmp_path / "auto", **calib), quiet)
    (uniform, kl_uniform), (auto, kl_auto) = held_out_ppl_kl("smollm2-135m", [tmp_path / "uniform",
                                                                              tmp_path / "auto"], text)
    assert auto < uniform, f"auto at 4.5 bits {auto:.3f} >= uniform W4A16 g32 {uniform:.3f} (RTN both)"
    assert kl_auto < kl_uniform, f"held-out KL: auto {kl_auto:.4f} >= uniform {kl_uniform:.4f}"
