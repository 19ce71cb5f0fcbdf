"""`load_model`: a checkpoint of any format into our model, one top-level module at a time (see __init__)."""

from __future__ import annotations

import torch
from torch import nn

import llmopt.native as native
from llmopt.errors import LlmoptError
from llmopt.layers.linear import iter_linears, set_submodule
from llmopt.loading.formats import QuantizedCheckpoint
from llmopt.loading.landing import land_linear, pack_module
from llmopt.models.base import CausalLM
from llmopt.models.loader import build_empty, fill_module, parse_dtype
from llmopt.models.reader import CheckpointTensors
from llmopt.models.resolve import ResolvedModel, weights_dir
from llmopt.quant.embedding import QuantizedEmbedding


def module_order(model: nn.Module) -> list[str]:
    """Top-level modules in the order a forward uses them (embeddings, each decoder layer, the rest), a
    ModuleList expanded into its items: the unit that is read, landed and packed before the next."""
    out: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out += [f"{name}.{i}" for i in range(len(child))]
        elif name != "rotary":
            out.append(name)
    return out


def _land_embedding(model: CausalLM, quantized: QuantizedCheckpoint, tied: bool, dtype: torch.dtype,
                    device: torch.device) -> None:
    """A quantized embedding (`quantize --lm-head int8|int4` on a tied model) lands as a QuantizedEmbedding for
    the lookups and, when the head shares it, as the head's int8 / int4 linear too (two copies of the codes:
    the lookup reads rows, the head's kernel its own packed layout)."""
    hf = type(model).hf_module_name("embed_tokens")
    part = quantized.embedding(hf)
    if part is None:
        return
    assert part.qw is not None
    model.embed_tokens = QuantizedEmbedding(part.qw, dtype, device)
    if tied:
        head = land_linear([part], dtype, device)
        assert head is not None
        model.lm_head = head
    quantized.consume([hf])


def load_model(resolved: ResolvedModel, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               pack: bool = False) -> CausalLM:
    """Our model for `resolved` (HF float, GGUF-converted, GPTQ or compressed-tensors), computing in `dtype`.
    With `pack`, each module's linears are packed for the CPU kernels as soon as it is filled, so the plain
    weights of one module at most exist next to the packed model."""
    directory = weights_dir(resolved)
    torch_dtype = parse_dtype(dtype, resolved.spec.dtype)
    device = torch.device(device)
    tensors = CheckpointTensors(directory)
    quantized = QuantizedCheckpoint(resolved, tensors) if resolved.quantization_config is not None else None
    model = build_empty(resolved, torch_dtype, device)
    tied = resolved.spec.tie_word_embeddings
    try:
        for prefix in module_order(model):
            if quantized is not None and prefix == "embed_tokens":
                _land_embedding(model, quantized, tied, torch_dtype, device)
            if quantized is not None:
                for name, mod in list(iter_linears(model)):
                    if not (name == prefix or name.startswith(prefix + ".")) or (name == "lm_head" and tied):
                        continue
                    names = list(type(model).hf_parts(name, mod))
                    built = land_linear(quantized.parts(names), torch_dtype, device)
                    if built is not None:
                        set_submodule(model, name, built)
                        quantized.consume(names)
            fill_module(model, tensors, prefix, device, skip=quantized.skip if quantized is not None else None)
            if pack:
                pack_module(model, prefix)
                native.trim_heap()
    except LlmoptError as e:
        raise LlmoptError(f"{directory}: {e}") from None
    return model.eval()
