"""Each family's decoder layer as decode-step ops. A layer class names its lowering in its own body
(`decode_lowering = "llama"`; a subclass may change what a layer does, so it inherits none and lowers
only once it names one itself), and `LOWERINGS` maps the names to functions. A lowering mirrors the layer's
`forward` call for call; `lower_model` raises `NotLowered`, with the reason, for anything it does not take
(then the eager path runs the step): another layer class, a projection without one of our CPU kernels, hooks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from llmopt.layers.attention import PagedAttention
from llmopt.layers.kernel_linear import KernelLinear, kernel_linear
from llmopt.layers.norm import OffsetRMSNorm, RMSNorm
from llmopt.models.base import CausalLM
from llmopt.quant.rows import ConcatLinear
from llmopt.step.program import Buffer, Program


class NotLowered(Exception):
    """What the step does not take, in a few words (the engine logs it once and runs eagerly)."""


def linear_weights(mod: nn.Module) -> KernelLinear | list[KernelLinear]:
    """The kernel inputs of a projection that runs on one of our CPU kernels (a list: a ConcatLinear's parts)."""
    if type(mod) is ConcatLinear and not (mod._forward_hooks or mod._forward_pre_hooks):
        parts = [linear_weights(p) for p in mod.parts]
        if any(isinstance(p, list) for p in parts):
            raise NotLowered("a ConcatLinear of ConcatLinears")
        return parts  # type: ignore[return-value]
    k = kernel_linear(mod)
    if isinstance(k, str):
        raise NotLowered(k)
    return k


def _norm(prog: Program, norm: nn.Module, x: Buffer, out: Buffer, residual: Buffer | None = None) -> None:
    if type(norm) not in (RMSNorm, OffsetRMSNorm) or norm._forward_hooks or norm._forward_pre_hooks:
        raise NotLowered(f"{type(norm).__name__} norm")
    prog.norm(x, norm.weight, norm.eps, type(norm) is OffsetRMSNorm, out, residual)


def _attention(prog: Program, attn: nn.Module, cache, block_size: int, rope_set: int, x: Buffer,
               out: Buffer) -> None:
    """LlamaAttention.forward: qkv, q/k norms, RoPE over q|k, K/V into the pool, paged attention, o_proj."""
    pa: PagedAttention = attn.attn
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = prog.buffer("qkv", attn.q_size + 2 * attn.kv_size)
    prog.linear(x, linear_weights(attn.qkv_proj), qkv)
    rope_in = qkv
    if attn.qk_norm:
        normed = rope_in = prog.buffer("qk_normed", (h + hkv) * d)
        for norm, heads, at in ((attn.q_norm, h, 0), (attn.k_norm, hkv, h * d)):
            if type(norm) not in (RMSNorm, OffsetRMSNorm):
                raise NotLowered(f"{type(norm).__name__} q/k norm")
            prog.head_norm(qkv.at(at), heads, d, norm.weight, norm.eps, type(norm) is OffsetRMSNorm, normed.at(at))
    qk = prog.buffer("qk", (h + hkv) * d)
    prog.rotary(rope_in, h + hkv, d, rope_set, qk)
    g, pool, idx = cache.locate(pa.layer_idx)
    prog.kv_write(qk.at(h * d), qkv.at((h + hkv) * d), pool, idx, g)
    attn_out = prog.buffer("attn", h * d)
    prog.attend(qk, h, pool, idx, block_size, g, pa.window or 0, pa.scale, attn_out)
    prog.linear(attn_out, linear_weights(attn.o_proj), out)


def lowering_name(mod: nn.Module) -> str | None:
    """The lowering `mod`'s own class names (not one it inherits)."""
    return type(mod).__dict__.get("decode_lowering")


def _mlp(prog: Program, mlp: nn.Module, x: Buffer, out: Buffer) -> None:
    if lowering_name(mlp) == "sparse_moe":
        if mlp._forward_hooks or mlp._forward_pre_hooks or mlp.calibrate_all:
            raise NotLowered("a MoE block with hooks")
        native = mlp.native()
        if isinstance(native, str):
            raise NotLowered(f"MoE block: {native}")
        prog.moe(x, native, out)
        return
    if lowering_name(mlp) != "gated_mlp":
        raise NotLowered(f"{type(mlp).__name__} MLP")
    gelu = {"silu_and_mul": False, "gelu_tanh_and_mul": True}.get(mlp.act.__name__)
    if gelu is None:
        raise NotLowered(f"activation {mlp.act.__name__}")
    i = mlp.intermediate_size
    gate_up, act = prog.buffer("gate_up", 2 * i), prog.buffer("act", i)
    prog.linear(x, linear_weights(mlp.gate_up_proj), gate_up)
    prog.act(gate_up, i, gelu, act)
    prog.linear(act, linear_weights(mlp.down_proj), out)


def _input_norm(prog: Program, layer: nn.Module, first: bool, hidden: int) -> Buffer:
    """input_norm: the first layer normalizes the stream itself, later ones add the branch in first."""
    residual, branch, normed = (prog.buffer(n, hidden) for n in ("residual", "branch", "normed"))
    if first:
        _norm(prog, layer.input_layernorm, residual, normed)
    else:
        _norm(prog, layer.input_layernorm, branch, normed, residual)
    return normed


def lower_llama(prog: Program, layer: nn.Module, first: bool, cache, block_size: int) -> None:
    hidden = layer.input_layernorm.weight.shape[0]
    normed = _input_norm(prog, layer, first, hidden)
    residual, branch = prog.buffer("residual", hidden), prog.buffer("branch", hidden)
    _attention(prog, layer.self_attn, cache, block_size, 0, normed, branch)
    _norm(prog, layer.post_attention_layernorm, branch, normed, residual)
    _mlp(prog, layer.mlp, normed, branch)


def lower_gemma3(prog: Program, layer: nn.Module, first: bool, cache, block_size: int) -> None:
    hidden = layer.input_layernorm.weight.shape[0]
    normed = _input_norm(prog, layer, first, hidden)
    residual, branch, tmp = (prog.buffer(n, hidden) for n in ("residual", "branch", "tmp"))
    _attention(prog, layer.self_attn, cache, block_size, layer.rope_index, normed, tmp)
    _norm(prog, layer.post_attention_layernorm, tmp, branch)
    _norm(prog, layer.pre_feedforward_layernorm, branch, normed, residual)
    _mlp(prog, layer.mlp, normed, tmp)
    _norm(prog, layer.post_feedforward_layernorm, tmp, branch)


LOWERINGS: dict[str, Callable] = {"llama": lower_llama, "gemma3": lower_gemma3}


def lower_model(model: CausalLM, cache, block_size: int, rows: int) -> tuple[Program, list[int]]:
    """The program of a decode step of up to `rows` tokens: each layer's ops, then the final norm (the
    result in buffer "normed"); and where each layer's ops end (a layer-skip draft stops early)."""
    prog = Program(rows)
    ends = []
    for i, layer in enumerate(model.layers):
        fn = LOWERINGS.get(lowering_name(layer) or "")
        if fn is None:
            raise NotLowered(f"{type(layer).__name__} layers")
        fn(prog, layer, i == 0, cache, block_size)
        ends.append(len(prog.ops))
    hidden = model.spec.hidden_size
    _norm(prog, model.norm, prog.buffer("branch", hidden), prog.buffer("normed", hidden), prog.buffer("residual", hidden))
    return prog, ends
