"""Helpers for the recipe tests: writing recipes, running the real CLI entry point in this process."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
DATA = ROOT / "calibration_data"
LLAMA_CONFIG = RECIPES / "configs" / "llama-2-7b.config.json"


def write(directory: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path

