"""The float layer of loading: build our model on the meta device, fill a module from HF-layout safetensors, give it
back. `llmopt.loading` composes these with the quantized formats and packing; quant's pipeline streams them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import llmopt.native as native
from llmopt.errors import LlmoptError
from llmopt.layers.linear import output_splits
from llmopt.models.base import CausalLM
from llmopt.models.reader import CheckpointTensors
from llmopt.models.registry import build_model
from llmopt.models.resolve import ResolvedModel

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
                device: str | torch.device | None = None, skip: Callable[[str], bool] | None = None) -> None:
    """Fill our parameters under `prefix` (a module path such as `layers.3`, or every one when None) that are
    still on the meta device from the checkpoint, shape-checked, materializing them on `device` first.
    Streamed callers fill one module at a time, so only it is in memory (`release` gives it back).
    `skip(name)`: checkpoint tensors another reader already took (a quantized linear's)."""
    inside = (lambda name: True) if prefix is None else (lambda name: name.startswith(prefix + "."))
    params = dict(model.named_parameters(remove_duplicate=False))
    pending = {name for name, p in params.items() if p.is_meta and inside(name)}
    if device is not None:
        _move_params(model, prefix, device)
        params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    wanted = [name for name in tensors.names() if "rotary_emb" not in name and not (skip and skip(name))
              and inside(type(model).hf_to_ours(name)[0])]
    with torch.no_grad():
        for name, tensor in tensors.read(wanted):
            ours, shard = type(model).hf_to_ours(name)
            if ours == "lm_head.weight" and model.spec.tie_word_embeddings and ours not in pending:
                continue  # a tied head's copy: the embedding is that parameter
            if ours not in pending:
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
    # every pending parameter, a fused one once per checkpoint projection in it
    expected = {f"{name}.{p}" + (f":{s}" if s else "") for name, mod in model.named_modules()
                for p, _ in mod.named_parameters(recurse=False) for s in output_splits(mod) or [None]
                if f"{name}.{p}" in pending}
    if model.spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise LlmoptError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def _move_params(model: CausalLM, prefix: str | None, device: str | torch.device) -> None:
    """Every parameter under `prefix` replaced by an uninitialized one on `device` (to the meta device: every
    one; elsewhere: those still on meta, so modules that landed already are kept). Buffers, such as RoPE
    tables, stay as they are; a tied head keeps sharing the embedding's parameter."""
    to_meta = torch.device(device).type == "meta"
    new: dict[int, nn.Parameter] = {}
    for mod in (model if prefix is None else model.get_submodule(prefix)).modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and (to_meta or p.is_meta):
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[name] = new[id(p)]
    if model.spec.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):  # not a quantized one
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
