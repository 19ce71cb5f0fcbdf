"""A fresh machine: an empty LLMOPT_CACHE must give the same results as a warm one.

The embedded model is a GGUF file that is converted into the cache on first use. A calibration made
while the cache was cold once carried a model identity that a later, warm `quantize` refused
("measured on another model"), so `make demo` failed on every fresh machine. Each command here runs in
a fresh process, as a user's would, and the first one always starts from an empty cache. Both tests
fail if the config built from GGUF metadata (cold) and the cached config.json (warm) differ: the
identity a calibration records hashes it (a separate in-process check of that was a third cold
conversion, half a minute of CI, for nothing these two do not catch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_smollm2

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, requires_smollm2]


def _llmopt(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMOPT_CACHE": str(cache), "HF_HOME": str(cache / "hf"),
           "QUICKSTART_CALIB_SAMPLES": "4"}
    return subprocess.run([sys.executable, "-m", "llmopt", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_calibrate_cold_then_quantize_warm_and_cold(tmp_path):
    cold = tmp_path / "cache"
    calib = tmp_path / "calib"
    _ok(_llmopt(cold, "calibrate", "smollm2-135m", "--data", "calibration_data/kb_calibration.jsonl",
                "--num-samples", "4", "--seq-len", "64", "--device", "cpu", "-o", str(calib)))
    _ok(_llmopt(cold, "quantize", "smollm2-135m", "--scheme", "w8a16", "--calib", str(calib),
                "--device", "cpu", "-o", str(tmp_path / "q-warm")))
    # another machine (or a wiped cache) with the same calibration directory
    _ok(_llmopt(tmp_path / "cache-2", "quantize", "smollm2-135m", "--scheme", "w8a16", "--calib", str(calib),
                "--device", "cpu", "-o", str(tmp_path / "q-cold")))
    exported = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("q-warm", "q-cold")]
    assert exported[0] == exported[1]
    assert exported[0]["architectures"] == ["LlamaForCausalLM"]


def test_quickstart_calibrate_and_quantize_twice_on_one_out(tmp_path):
    """The `make demo` failure itself: the shipped recipe, an empty cache, then a second run."""
    out = tmp_path / "run"
    args = ("run", "recipes/quickstart.yaml", "--stages", "calibrate,quantize", "--out", str(out), "--json")
    first = _llmopt(tmp_path / "cache", *args)
    _ok(first)
    second = _llmopt(tmp_path / "cache", *args)
    _ok(second)
    ran = {s["name"]: s["status"] for s in json.loads(first.stdout)["stages"] if s["status"] != "not_selected"}
    assert ran == {"calibrate": "ran", "quantize": "ran"}, ran
    again = {s["name"]: s["status"] for s in json.loads(second.stdout)["stages"] if s["status"] != "not_selected"}
    assert again == {"calibrate": "skipped", "quantize": "skipped"}, again
