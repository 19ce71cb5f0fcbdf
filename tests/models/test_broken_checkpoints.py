"""A model folder with a broken file: every command that reads it says so in one line and exits 2 (quantize,
calibrate and generate showed a SafetensorError traceback, vram-plan a ValueError or ZeroDivisionError)."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_runner import run_cli


@pytest.fixture
def truncated(tiny_llama, tmp_path):
    d = tmp_path / "truncated"
    shutil.copytree(tiny_llama, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:1000])
    return d


@pytest.mark.parametrize("command", [
    ["quantize", "--scheme", "w8a16", "-o", "{tmp}/q"],
    ["calibrate", "--data", "{text}", "--num-samples", "1", "--seq-len", "16", "-o", "{tmp}/c"],
    ["generate", "--prompt", "hi", "--max-tokens", "2"],
    ["eval", "--ppl-data", "{text}"],
], ids=lambda c: c[0])
def test_a_truncated_safetensors_file_is_one_line_exit_2(command, truncated, tmp_path, monkeypatch, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = [a.format(tmp=tmp_path, text=text) for a in command]
    code, _, err = run_cli(monkeypatch, capsys, args[0], str(truncated), *args[1:])
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {truncated / 'model.safetensors'} is not a readable safetensors file"), err
    assert not (tmp_path / "q").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "abc", "config.json has a value llmopt cannot read: invalid literal for int()"),
    ("num_attention_heads", 0, "config.json: num_attention_heads must be positive, got 0"),
    ("rms_norm_eps", "tiny", "config.json has a value llmopt cannot read: could not convert string to float: 'tiny'"),
    ("bos_token_id", "first", "config.json has a value llmopt cannot read: bos_token_id: Input should be a valid integer"),
])
def test_a_config_value_of_the_wrong_kind_is_one_line_exit_2(key, value, message, tiny_llama, tmp_path, monkeypatch,
                                                             capsys):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(monkeypatch, capsys, "vram-plan", str(d))
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("target", [["--model", "{model}"], ["--ab", "{model}", "--ab", "{model}"]], ids=["model", "ab"])
def test_in_process_bench_checks_its_workload_before_loading_weights(target, truncated, tmp_path, monkeypatch,
                                                                      capsys):
    """A bad --dataset line is named before the engine loads (it loaded the whole model first): with weights
    that cannot load, the error is still the dataset's."""
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt": "hello", "max_tokens": 4}\n{"prompt": "", "max_tokens": 4}\n')
    args = [a.format(model=truncated) for a in target]
    code, _, err = run_cli(monkeypatch, capsys, "bench", *args, "--dataset", str(bad), "--no-progress")
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == f'error: {bad}:2: "prompt" is empty', err
