"""Which linears get which scheme: `--ignore` / `--override` regexes over Hugging Face module names.

Users (and checkpoints) name projections the Hugging Face way (`model.layers.3.self_attn.q_proj`),
while our model fuses q|k|v and gate|up. Every regex is matched (`re.search`) against the HF names;
the parts of one fused module must end up with the same scheme, because they are one weight here
(vLLM fuses them the same way and has the same rule). `lm_head` and the embeddings stay unquantized,
and so do the linears a model class lists in `float_linears` (MoE routers and the shared-expert gate:
a few thousand weights that decide which experts run; vLLM and llm-compressor keep them float too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.group_size import W4_DEFAULT_GROUPS, check_group_size, default_group_size
from llmopt.layers.linear import iter_linears
from llmopt.quant.recipe import ModuleScheme, QuantizeConfig, make_scheme

UNQUANTIZED = ("lm_head",)


@dataclass
class Target:
    """One of our linears, its HF parts (name → row range) and its scheme (None = left as is)."""

    module: str
    parts: dict[str, tuple[int, int]]
    in_features: int
    scheme: ModuleScheme | None
    kept_float: bool = False  # a router (`float_linears`): float in every format, not a user's --ignore
    store_dtype: torch.dtype | None = None  # unquantized: the dtype the checkpoint stores it in (None: as is)
    method: str | None = None  # its own quantization method (`--method auto` chose it), else the run's


def hf_parts(model: nn.Module, name: str, module: nn.Module) -> dict[str, tuple[int, int]]:
    """HF names of the projections inside our module `name` (e.g. layers.0.self_attn.qkv_proj), by the
    model class's declared name mapping (`CausalLM.hf_parts`)."""
    return type(model).hf_parts(name, module)  # type: ignore[attr-defined]


def _w4_group(cfg: QuantizeConfig, in_features: list[int]) -> tuple[int | None, str | None]:
    """The int4 group size to use when the user gave none (None when only -1 fits: the preset's 128
    then fails the check below, asking for a size), and a note when it is not 128."""
    if cfg.group_size is not None:
        return cfg.group_size, None
    g = default_group_size(in_features)
    note = None if g in (None, W4_DEFAULT_GROUPS[0]) else (
        f"group size {W4_DEFAULT_GROUPS[0]} does not divide every input width "
        f"({', '.join(map(str, sorted(set(in_features))))}); using {g}")
    return g, note


def check_group_sizes(targets: list[Target]) -> None:
    """One error for the whole model: each group size in use must be valid for every input width it
    applies to (the message names the first linear it does not divide and lists the valid sizes)."""
    widths: dict[int, dict[str, int]] = {}  # group size -> HF name -> input width
    for t in targets:
        if t.scheme and not t.scheme.weights.per_channel:
            widths.setdefault(t.scheme.weights.group_size, {})[next(iter(t.parts))] = t.in_features
    for group_size, by_name in widths.items():
        check_group_size(by_name, group_size)


def plan_targets(model: nn.Module, cfg: QuantizeConfig) -> tuple[list[Target], list[str]]:
    """Every linear of `model` with its scheme, and notes for the user (e.g. a group size chosen)."""
    linears = [(n, m) for n, m in iter_linears(model)]
    notes: list[str] = []
    ignore = cfg.ignore_patterns()
    rules = cfg.override_rules()
    widths = [m.in_features for n, m in linears if n not in UNQUANTIZED]
    w4_group, note = _w4_group(cfg, widths)
    if note and cfg.scheme != "auto" and (cfg.main_preset == "w4a16" or any(p == "w4a16" for _, p in rules)):
        notes.append(note)

    def scheme_for(preset: str, main: bool) -> ModuleScheme:
        gs = cfg.group_size if main else None
        if preset == "w4a16" and (gs is None):
            gs = w4_group
        return make_scheme(preset, gs, cfg.symmetric)

    main = scheme_for(cfg.main_preset, True)
    float_res = [re.compile(p) for p in getattr(type(model), "float_linears", ())]
    targets = []
    for name, mod in linears:
        parts = hf_parts(model, name, mod)
        local = re.sub(r"^layers\.\d+\.", "", name)
        if any(r.search(local) for r in float_res):  # kept float whatever --override says
            targets.append(Target(name, parts, mod.in_features, None, kept_float=True))
            continue
        chosen: dict[str, ModuleScheme | None] = {}
        for hf in parts:
            s: ModuleScheme | None = main
            for pattern, preset in rules:
                if pattern.search(hf):
                    s = scheme_for(preset, preset == cfg.main_preset)
            if name in UNQUANTIZED:
                if s is not main:
                    raise LlmoptError(f"quantizing {hf} is not supported: it stays in the model dtype")
                s = None
            if any(p.search(hf) for p in ignore):
                s = None
            chosen[hf] = s
        distinct = set(chosen.values())
        if len(distinct) > 1:
            desc = ", ".join(f"{h.rsplit('.', 1)[1]}={'ignored' if s is None else s.preset}" for h, s in chosen.items())
            raise LlmoptError(f"{', '.join(parts)} are one fused weight in llmopt and must share a scheme (got {desc})")
        targets.append(Target(name, parts, mod.in_features, distinct.pop()))
    check_group_sizes(targets)
    if not any(t.scheme for t in targets):
        raise LlmoptError("no linear is left to quantize (every one matched --ignore)")
    return targets, notes
