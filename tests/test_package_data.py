"""Every C source and header the kernels build from ships in a wheel: a file pyproject's package-data
misses exists in a checkout but not in a non-editable install, where its kernel then silently falls
back to torch."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(p for ext in ("*.c", "*.h") for p in (ROOT / "llmopt").rglob(ext))
    assert sources
    missing = [str(p.relative_to(ROOT)) for p in sources
               if not any(p.parent == ROOT / pkg.replace(".", "/") and p.match(glob)
                          for pkg, globs in data.items() for glob in globs)]
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
