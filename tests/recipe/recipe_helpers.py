"""Helpers for the recipe tests: writing recipes, running the real CLI entry point in this process."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

import llmopt.cli as cli

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
DATA = ROOT / "calibration_data"
LLAMA_CONFIG = RECIPES / "configs" / "llama-2-7b.config.json"


def write(directory: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`llmopt ARGS` through `cli.main()`; returns (exit code, stdout, stderr) with unwrapped lines."""
    monkeypatch.setattr(sys, "argv", ["llmopt", *args])
    monkeypatch.setattr(cli, "console", Console(width=250))
    monkeypatch.setattr(cli, "err_console", Console(stderr=True, width=250))
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
