"""Calibration statistics: what the layer-by-layer pass measures equals the model's own activations,
and `run_calibration` writes a complete, reproducible CALIB_DIR atomically."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline_helpers import KB_CALIB

from llmopt.calibrate import CalibrateConfig, Manifest, SavedStats, collect_stats, run_calibration
from llmopt.errors import LlmoptError
from llmopt.layers.rotary import apply_rotary
from llmopt.loading.load import load_model
from llmopt.models.resolve import resolve_model


@torch.no_grad()
def test_stats_equal_the_model_activations(tiny_llama):
    model = load_model(resolve_model(str(tiny_llama)), torch.float32)
    windows = torch.randint(3, 400, (3, 20))
    stats = collect_stats(model, windows, "minmax", dtype=torch.float32, batch_tokens=40)
    # layer 0 by hand: qkv input = input_layernorm(embeddings); K after RoPE
    x = model.embed_tokens(windows.reshape(-1))
    h = model.layers[0].input_layernorm(x)
    s0 = stats.inputs["layers.0.self_attn.qkv_proj"]
    torch.testing.assert_close(s0.channels.absmax, h.abs().amax(0))
    torch.testing.assert_close(s0.channels.mean_abs, h.abs().mean(0))
    lo, hi = s0.observer.compute()
    assert float(lo) == pytest.approx(float(h.min())) and float(hi) == pytest.approx(float(h.max()))
    sp = model.spec
    qkv = model.layers[0].self_attn.qkv_proj(h)
    k = qkv[:, sp.q_size:sp.q_size + sp.kv_size].reshape(-1, sp.num_kv_heads, sp.head_dim)
    k = apply_rotary(k, *model.rotary(torch.arange(20).repeat(3)))
    torch.testing.assert_close(stats.k_absmax[0], k.abs().amax((0, 2)))
    v = qkv[:, sp.q_size + sp.kv_size:].reshape(-1, sp.num_kv_heads, sp.head_dim)
    torch.testing.assert_close(stats.v_absmax[0], v.abs().amax((0, 2)))
    assert set(stats.inputs) == {f"layers.{i}.{m}" for i in range(2) for m in
                                 ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("observer", ["ema", "percentile", "mse"])
def test_every_observer_gives_a_range(tiny_llama, observer):
    model = load_model(resolve_model(str(tiny_llama)), torch.float32)
    stats = collect_stats(model, torch.randint(3, 400, (2, 16)), observer, percentile=99.0)
    lo, hi = stats.inputs["layers.1.mlp.down_proj"].observer.compute()
    assert float(lo) < 0 < float(hi)


def test_run_calibration_writes_stats_and_manifest(tiny_llama, tmp_path):
    out = tmp_path / "calib"
    cfg = CalibrateConfig(model=str(tiny_llama), data=[f"{KB_CALIB}:1"], num_samples=4, seq_len=32, seed=3,
                          output=out, device="cpu")
    m = run_calibration(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "stats.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"][0]["files"][0]["sha256"] and manifest["model"]["weights"][0]["sha256"]
    assert manifest["settings"]["seed"] == 3 and manifest["num_windows"] == 4 == m.num_windows
    assert manifest["llmopt_version"] and "after RoPE" in manifest["notes"]["k_absmax"]
    saved = SavedStats.load(out / "stats.safetensors")
    assert saved.windows.shape == (4, 32)
    k, v = saved.kv_absmax(2)
    assert k.shape == (2, 2) and (k > 0).all() and (v > 0).all()
    assert Manifest.read(out).model.mismatch(Manifest.read(out).model) is None
    with pytest.raises(LlmoptError, match="already exists"):
        run_calibration(cfg)
    # same data and seed -> same windows
    run_calibration(cfg.model_copy(update={"output": tmp_path / "again"}))
    assert torch.equal(SavedStats.load(tmp_path / "again" / "stats.safetensors").windows, saved.windows)
