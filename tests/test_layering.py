"""Dependency direction: lower layers never import upper ones, and nothing imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "llmopt"

# package -> packages it must never import
FORBIDDEN = {
    "layers": {"engine", "serve", "bench", "eval", "calibrate", "recipe", "cli", "planning"},
    "quant": {"engine", "serve", "bench", "eval", "recipe", "cli"},
    "models": {"engine", "serve", "bench", "eval", "calibrate", "recipe", "cli"},
    "planning": {"engine", "serve", "bench", "eval", "quant", "calibrate", "recipe", "cli"},
    "engine": {"serve", "bench", "eval", "recipe", "cli"},
    "bench": {"serve", "eval", "recipe", "cli"},
    "serve": {"bench", "eval", "recipe", "cli"},
    "eval": {"serve", "bench", "recipe", "cli"},
    "calibrate": {"serve", "bench", "eval", "recipe", "cli"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmopt."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("llmopt."):
                    found.add(alias.name.split(".")[1])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    folder = PKG / package
    if not folder.is_dir():
        pytest.skip(f"llmopt/{package} does not exist")
    bad = []
    for f in folder.rglob("*.py"):
        hits = _imports(f) & FORBIDDEN[package]
        if hits:
            bad.append(f"{f.relative_to(PKG)} imports {sorted(hits)}")
    assert not bad, bad


def test_nothing_imports_the_cli():
    bad = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
           if f.name not in ("cli.py", "__main__.py") and "cli" in _imports(f)]
    assert not bad, bad
