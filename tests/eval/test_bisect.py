"""--bisect attributes a drop to the candidate's optimizations and names the culprit layer.

The candidate is a deliberately broken copy of a 4-layer tiny model: layer 2's output projections are
zeroed (the layer becomes a no-op), and it also runs an INT8 KV cache. Bisect must blame the weights
(not the KV cache), rank layer 2 first, and suggest keeping exactly layer 2 in float to meet the gate.
"""

from __future__ import annotations

import json
import shutil

import pytest
from eval_helpers import run_eval_cli
from safetensors.torch import load_file, save_file

from llmopt.testing.tiny_model import write_tiny_llama

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 8
CULPRIT = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = write_tiny_llama(tmp_path_factory.mktemp("bisect-base"), num_layers=4)
    broken = tmp_path_factory.mktemp("bisect-broken") / "model"
    shutil.copytree(base, broken)
    state = load_file(str(broken / "model.safetensors"))
    for name in (f"model.layers.{CULPRIT}.self_attn.o_proj.weight", f"model.layers.{CULPRIT}.mlp.down_proj.weight"):
        state[name].zero_()
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return base, broken


def test_bisect_names_the_broken_layer(pair, tmp_path, monkeypatch, capsys):
    base, broken = pair
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    png = tmp_path / "layers.png"
    code, out, err = run_eval_cli(monkeypatch, capsys, str(broken), "--baseline", str(base), "--ppl-data", str(data),
                                  "--seq-len", "64", "--kv-cache-dtype", "int8", "--bisect", "--bisect-plot",
                                  str(png), "--gate", "kl_div<=0.001", "--json")
    assert code == 1, err  # the broken candidate fails the gate
    b = json.loads(out)["bisect"]
    factors = {f["factor"]: f for f in b["factors"]}
    assert set(factors) == {"weights", "kv_cache"}
    assert factors["weights"]["share_of_kl"] > 0.95  # restoring the weights removes nearly all of it
    assert factors["kv_cache"]["share_of_kl"] < 0.1  # the INT8 KV cache barely matters
    ranked = sorted(b["layers"], key=lambda r: -r["kl_removed"])
    assert ranked[0]["layer"] == CULPRIT
    assert b["suggestion"]["layers"] == [CULPRIT] and b["suggestion"]["meets_gates"] is True
    assert b["suggestion"]["ignore"] == [rf"model\.layers\.{CULPRIT}\."]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
