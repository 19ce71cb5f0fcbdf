"""`llmopt calibrate` through the CLI: a CALIB_DIR that `quantize --calib` accepts, and its error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_runner import run_cli

DATA = Path(__file__).resolve().parents[2] / "calibration_data"




def test_calibrate_then_quantize_with_it(tiny_llama, tmp_path, monkeypatch, capsys):
    calib = tmp_path / "calib"
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", str(tiny_llama), "--data",
                             f"{DATA / 'kb_calibration.jsonl'}:1", "--num-samples", "4", "--seq-len", "64",
                             "--observer", "percentile", "--eval-data", str(DATA / "kb_mc.jsonl"),
                             "--eval-data", str(DATA / "kb_gen.jsonl"), "--threads", "1", "-o", str(calib))
    assert code == 0, err
    assert "4 windows" in out
    manifest = json.loads((calib / "manifest.json").read_text())
    assert manifest["settings"]["observer"] == "percentile" and len(manifest["settings"]["eval_data"]) == 2
    assert manifest["settings"]["threads"] == 1
    code, out, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), "--scheme", "w8a16", "--method",
                             "gptq", "--calib", str(calib), "--kv-cache", "int8", "-o", str(tmp_path / "q"))
    assert code == 0, err
    assert "w8a16 / gptq" in out


@pytest.mark.parametrize("args, msg", [
    (["--data", "no/such/file.jsonl"], "could not be loaded"),
    (["--data", "README.md", "--observer", "fancy"], "invalid observer"),
    (["--data", "README.md", "--threads", "0"], "invalid threads"),
    (["--data", "README.md:0"], "the weight after ':' must be a positive number, got 0"),
])
def test_calibrate_errors_are_one_line(tiny_llama, tmp_path, monkeypatch, capsys, args, msg):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(tiny_llama), *args, "-o", str(tmp_path / "c"))
    assert code == 2 and msg in err and err.strip().count("\n") == 0
    assert not (tmp_path / "c").exists()


def test_overlap_with_eval_data_fails(tiny_llama, tmp_path, monkeypatch, capsys):
    text = tmp_path / "calib.txt"
    phrase = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    text.write_text(f"{phrase}. " * 200)  # every window contains the phrase
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"question": f"Which letters follow: {phrase}?"}) + "\n")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(tiny_llama), "--data", str(text), "--num-samples",
                           "2", "--seq-len", "128", "--eval-data", str(ev), "-o", str(tmp_path / "c"))
    assert code == 2 and "overlap the eval data" in err and "--allow-overlap" in err
