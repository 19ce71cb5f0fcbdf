"""Checkpoints sharded as the Hugging Face convention says (`--max-shard-size`): shard names, the index, one
file when everything fits, atomic on failure, and a sharded quantized checkpoint that transformers and our
engine load to the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline_helpers import assert_transformers_loads_export, quantize_tiny
from cli_runner import run_cli
from safetensors.torch import load_file

import llmopt.models.shards as shards
from llmopt import LLM
from llmopt.errors import LlmoptError
from llmopt.models.shards import INDEX_FILE, SINGLE_FILE, ShardWriter, parse_shard_size
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig


def _tensors() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.w": torch.full((10, 10), float(i)) for i in range(5)}  # 400 bytes each


def test_shards_are_named_and_indexed_as_transformers_writes_them(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=900)  # two 400-byte tensors per shard
    tensors = _tensors()
    for name, t in tensors.items():  # as layers finish, one at a time
        writer.add({name: t})
    files = writer.finish()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5 * 400
    assert set(index["weight_map"]) == set(tensors)
    assert index["weight_map"]["model.layers.0.w"] == files[0].name
    assert index["weight_map"]["model.layers.4.w"] == files[2].name
    loaded = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(f.name for f in files), INDEX_FILE])


def test_every_dtype_a_checkpoint_holds_reads_back_exactly(tmp_path):
    """The writer lays out safetensors itself (header, then data): safetensors reads back every dtype,
    shape (0-d and empty included) and value."""
    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(3, 5, generator=g).bfloat16(), "f32": torch.randn(7, generator=g),
               "f16": torch.randn(2, 2, generator=g).half(), "i8": torch.randint(-128, 128, (9,), dtype=torch.int8),
               "i32": torch.randint(-9, 9, (4, 1), dtype=torch.int32), "u8": torch.arange(5, dtype=torch.uint8),
               "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6, generator=g)[:, ::2]}
    writer = ShardWriter(tmp_path, max_bytes=64)
    writer.add(tensors)
    loaded = {k: v for f in writer.finish() for k, v in load_file(str(f)).items()}
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape, k
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), k
    assert not list(tmp_path.glob(".shard-*"))


def test_one_shard_is_a_single_model_safetensors_without_an_index(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=parse_shard_size("5GB"))
    writer.add(_tensors())
    assert [f.name for f in writer.finish()] == [SINGLE_FILE]
    assert not (tmp_path / INDEX_FILE).exists()


def test_a_tensor_larger_than_a_shard_gets_a_shard_of_its_own(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=100)
    writer.add(_tensors())
    assert len(writer.finish()) == 5


def test_a_tensor_written_twice_and_a_bad_size_are_one_line_errors(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=900)
    writer.add(_tensors())
    with pytest.raises(LlmoptError, match="written twice"):
        writer.add({"model.layers.0.w": torch.zeros(1)})
    for bad in ("0", "-5GB", "lots"):
        with pytest.raises(LlmoptError):
            parse_shard_size(bad)
    assert parse_shard_size("5GB") == 5 * 1000**3 and parse_shard_size("2GiB") == 2 * 1024**3


def test_a_sharded_quantized_checkpoint_loads_in_transformers_and_our_engine_alike(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "q"
    report, modules = quantize_tiny(monkeypatch, tiny_llama, out, scheme="w4a16", group_size=32,
                                    max_shard_size="20KB")
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 2 and files[0].name.startswith("model-00001-of-")
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert report.bytes_after == sum(f.stat().st_size for f in files)
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=32)
    assert_transformers_loads_export(out, llm, modules)


def test_cli_max_shard_size(tiny_llama, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), "--scheme", "w8a16", "--device", "cpu",
                           "--max-shard-size", "30KB", "-o", str(out))
    assert code == 0, err
    assert (out / INDEX_FILE).is_file() and not (out / SINGLE_FILE).exists()
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), "--scheme", "w8a16", "--device", "cpu",
                           "--max-shard-size", "0", "-o", str(tmp_path / "bad"))
    assert code == 2 and "max-shard-size" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_a_failure_between_shards_leaves_no_output(tiny_llama, tmp_path, monkeypatch):
    """The disk fills while the second shard is written: no output directory, no temporary shards."""
    real, calls = shards.shutil.copyfileobj, []

    def failing_second(src, dst, length=0):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(src, dst, length)

    monkeypatch.setattr(shards.shutil, "copyfileobj", failing_second)
    with pytest.raises(OSError, match="No space"):
        quantize_model(QuantizeConfig(model=str(tiny_llama), scheme="w8a16", output=tmp_path / "q", device="cpu",
                                      max_shard_size="30KB"))
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
