"""Running `llmopt bench` from tests: in this process through the real `main()`, or as a subprocess."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

import llmopt.cli as cli

ROOT = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict[str, str]:
    """One thread (the machine is shared), a wide terminal (tables unwrapped), this checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250", "PYTHONPATH": str(ROOT)}


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`llmopt bench ARGS` in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["llmopt", "bench", *args])
    monkeypatch.setattr(cli, "console", Console(width=250))
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
