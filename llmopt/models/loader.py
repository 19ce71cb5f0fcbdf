"""Load Hugging Face-layout weights (safetensors) into our fused model (the registry's class for the spec)."""

from __future__ import annotations

import torch
from torch import nn

import llmopt.native as native
from llmopt.errors import LlmoptError
from llmopt.layers.linear import output_splits
from llmopt.models.base import CausalLM
from llmopt.models.reader import CheckpointTensors
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


def fill_module(model: CausalLM, tensors: CheckpointTensors, prefix: str | None = None,
                device: str | torch.device | None = None) -> None:
    """Fill our parameters under `prefix` (a module path such as `layers.3`, or every one when None) from the
    checkpoint, shape-checked; with `device`, that module is first materialized there from the meta device.
    Streamed callers fill one module at a time, so only it is in memory (`release` gives it back)."""
    if device is not None:
        _move_params(model, prefix, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    inside = (lambda name: True) if prefix is None else (lambda name: name.startswith(prefix + "."))
    loaded: set[str] = set()
    wanted = [name for name in tensors.names() if "rotary_emb" not in name and inside(type(model).hf_to_ours(name)[0])]
    with torch.no_grad():
        for name, tensor in tensors.read(wanted):
            ours, shard = type(model).hf_to_ours(name)
            if ours not in params:
                raise LlmoptError(f"{tensors.where[name].name}: unexpected tensor {name!r} (does config.json's "
                                  f"architecture match the weights?)")
            target = params[ours]
            if shard is not None:  # the rows of one projection inside a fused linear
                lo, hi = output_splits(model.get_submodule(ours.rsplit(".", 1)[0]))[shard]
                target = target[lo:hi]
            if tuple(tensor.shape) != tuple(target.shape):
                raise LlmoptError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(ours if shard is None else f"{ours}:{shard}")
    # every parameter, a fused one once per checkpoint projection in it
    expected = {f"{name}.{p}" + (f":{s}" if s else "") for name, mod in model.named_modules()
                for p, _ in mod.named_parameters(recurse=False) for s in output_splits(mod) or [None]
                if inside(f"{name}.{p}")}
    if model.spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise LlmoptError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def _move_params(model: CausalLM, prefix: str | None, device: str | torch.device) -> None:
    """Every parameter under `prefix` replaced by an uninitialized one on `device` (buffers, such as RoPE
    tables, stay as they are); a tied head keeps sharing the embedding's parameter."""
    new: dict[int, nn.Parameter] = {}
    for mod in (model if prefix is None else model.get_submodule(prefix)).modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[name] = new[id(p)]
    if model.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def release(model: CausalLM, prefix: str) -> None:
    """Give a filled module's memory back: its parameters return to the meta device, and freed heap memory to
    the OS (`native.trim_heap`)."""
    _move_params(model, prefix, "meta")
    native.trim_heap()


def build_empty(resolved: ResolvedModel, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Our model for `resolved` with every parameter on the meta device (nothing allocated) and its RoPE
    tables on `device`; `fill_module` materializes it module by module."""
    with torch.device("meta"):
        model = build_model(resolved.spec, dtype, "meta")
    # buffers (rotary tables) are not in the checkpoint: built on the real device
    model.rotary = model.build_rotary(device)
    if resolved.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def load_model(resolved: ResolvedModel, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> CausalLM:
    """Build our model for `resolved` and fill it from its weights (GGUF is converted once and cached)."""
    directory = weights_dir(resolved)
    torch_dtype = parse_dtype(dtype, resolved.spec.dtype)
    if resolved.quantization_config is not None:
        from llmopt.quant.checkpoint import load_quantized_model  # lazy: quant builds on this module

        return load_quantized_model(resolved, directory, torch_dtype, device)
    model = build_empty(resolved, torch_dtype, device)
    try:
        fill_module(model, CheckpointTensors(directory), device=device)
    except LlmoptError as e:
        raise LlmoptError(f"{directory}: {e}") from None
    return model
