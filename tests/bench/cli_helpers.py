"""Running `llmopt bench` from tests: in this process through the real `main()`, or as a subprocess."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cli_runner import run_cli

ROOT = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict[str, str]:
    """One thread (the machine is shared), a wide terminal (tables unwrapped), this checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250", "PYTHONPATH": str(ROOT)}


def run_bench_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`llmopt bench ARGS` in this process; returns (exit code, stdout, stderr)."""
    return run_cli(monkeypatch, capsys, "bench", *args)
