"""benchmarks/checkpoint_decode.py, run as a user runs it, on two tiny checkpoints: one row each, the first
the reference of the ratios; a folder that is not there is refused in one line before anything loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import needs_cc

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_decode.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600)


@needs_cc
def test_each_checkpoint_gets_a_row_of_alternating_rounds(tiny_llama, tiny_qwen2):
    r = _run(str(tiny_llama), str(tiny_qwen2), "--tokens", "8", "--rounds", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(f"| {tiny_llama.name} ")
            or line.startswith(f"| {tiny_qwen2.name} ")]
    assert len(rows) == 2, r.stdout
    first = rows[0].split(" | ")
    assert first[3] == "1.00x"  # the reference of the ratios
    for row in rows:
        cells = row.split(" | ")
        assert float(cells[1]) > 0  # MB of safetensors
        median, rounds = cells[2].split(" (")
        assert float(median) > 0 and len(rounds.rstrip(")").split(", ")) == 2


def test_a_missing_folder_is_refused_in_one_line(tmp_path):
    r = _run(str(tmp_path / "nowhere"))
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"not a checkpoint folder: {tmp_path / 'nowhere'}"]
