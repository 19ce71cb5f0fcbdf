"""Load Hugging Face-layout weights (safetensors) into our fused model (the registry's class for the spec)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from llmopt.errors import LlmoptError
from llmopt.layers.linear import output_splits
from llmopt.models.base import CausalLM
from llmopt.models.registry import build_model
from llmopt.models.resolve import ResolvedModel, weights_dir

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype, spec_dtype: str = "float32", device: torch.device | None = None
                ) -> torch.dtype:
    """A dtype name as a torch dtype. `auto` takes the checkpoint's, except fp16 on a CPU `device` (slow
    there), which runs in fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        auto = _DTYPES.get(spec_dtype, torch.float32)
        return torch.float32 if auto == torch.float16 and device is not None and device.type == "cpu" else auto
    if dtype not in _DTYPES:
        raise LlmoptError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def load_state_into(model: CausalLM, directory: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st, torch.no_grad():
            for name in st.keys():
                if "rotary_emb" in name:
                    continue
                ours, shard = type(model).hf_to_ours(name)
                if ours not in params:
                    raise LlmoptError(f"{f.name}: unexpected tensor {name!r} (does config.json's architecture "
                                      f"match the weights?)")
                target = params[ours]
                if shard is not None:  # the rows of one projection inside a fused linear
                    lo, hi = output_splits(model.get_submodule(ours.rsplit(".", 1)[0]))[shard]
                    target = target[lo:hi]
                tensor = st.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise LlmoptError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(ours if shard is None else f"{ours}:{shard}")
    # every parameter, a fused one once per checkpoint projection in it
    expected = {f"{name}.{p}" + (f":{s}" if s else "") for name, mod in model.named_modules()
                for p, _ in mod.named_parameters(recurse=False) for s in output_splits(mod) or [None]}
    if model.spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise LlmoptError(f"{directory}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def load_model(resolved: ResolvedModel, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> CausalLM:
    """Build our model for `resolved` and fill it from its weights (GGUF is converted once and cached)."""
    directory = weights_dir(resolved)
    torch_dtype = parse_dtype(dtype, resolved.spec.dtype)
    if resolved.quantization_config is not None:
        from llmopt.quant.checkpoint import load_quantized_model  # lazy: quant builds on this module

        return load_quantized_model(resolved, directory, torch_dtype, device)
    with torch.device("meta"):
        model = build_model(resolved.spec, torch_dtype, "meta")
    model = model.to_empty(device=device)
    # buffers (rotary tables) are not in the checkpoint: rebuild them on the real device
    model.rotary = model.build_rotary(device)
    if resolved.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_state_into(model, directory)
    model.eval()
    return model

