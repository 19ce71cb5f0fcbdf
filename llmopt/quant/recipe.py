"""QuantizeConfig: every option of `llmopt quantize`, validated once at the edge.

Presets name what a module becomes: `w8a16` (int8 weights, per channel), `w4a16` (int4 weights,
grouped), `fp8` (float8_e4m3 weights, per channel) and `w8a8` (int8 weights per channel after
SmoothQuant, plus int8 activations quantized per token at run time).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.errors import LlmoptError
from llmopt.gates import parse_confidence_gates
from llmopt.group_size import W4_DEFAULT_GROUPS
from llmopt.models.shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size
from llmopt.quant.fp8 import FP8_SCHEME
from llmopt.quant.scheme import QuantScheme

Preset = Literal["w8a16", "w4a16", "fp8", "w8a8"]
PRESETS: tuple[str, ...] = ("w8a16", "w4a16", "fp8", "w8a8")
AUTO = "auto"  # `--scheme auto --target-bits B`: each linear's precision chosen under a budget (quant/auto.py)
# what --scheme auto chooses among by default: int4 at three group sizes, int8 per channel, or float
AUTO_CANDIDATES: tuple[str, ...] = ("w4a16-g128", "w4a16-g64", "w4a16-g32", "w8a16", "bf16")
# auto (with --scheme auto): each linear by GPTQ or AWQ, whichever the search measures less damage for
Method = Literal["rtn", "gptq", "awq", "auto"]
SEARCHED_METHODS: tuple[str, ...] = ("gptq", "awq")  # what --method auto chooses between, per linear
Format = Literal["gptq", "compressed-tensors"]


HEAD_INT4_GROUP = 32  # `--lm-head int4`: llama.cpp's Q4_0 block; Marlin and our int4 kernel take it


class ModuleScheme(BaseModel):
    """What one linear becomes: a weight scheme, plus dynamic int8 activations for w8a8."""

    model_config = ConfigDict(frozen=True)

    preset: Preset
    weights: QuantScheme
    int8_activations: bool = False

    def describe(self) -> str:
        return f"{self.preset} ({self.weights.describe()})"


def make_scheme(preset: str, group_size: int | None, symmetric: bool) -> ModuleScheme:
    """The ModuleScheme of a preset; `group_size=None` means the preset's default (w4a16: 128)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown scheme {preset!r}; use one of {', '.join(PRESETS)}")
    if preset == "fp8":
        if group_size not in (None, -1):
            raise ValueError("fp8 weights are per output channel; --group-size does not apply")
        return ModuleScheme(preset="fp8", weights=FP8_SCHEME)
    if preset == "w8a8":
        if group_size not in (None, -1):
            raise ValueError("w8a8 weights are per output channel (the int8 matmul takes one scale per row)")
        if not symmetric:
            raise ValueError("w8a8 is symmetric (int8 x int8 matmul without zero points)")
        return ModuleScheme(preset="w8a8", weights=QuantScheme(bits=8, group_size=-1, symmetric=True),
                            int8_activations=True)
    bits = 8 if preset == "w8a16" else 4
    default = -1 if preset == "w8a16" else W4_DEFAULT_GROUPS[0]
    gs = default if group_size is None else group_size
    return ModuleScheme(preset=preset, weights=QuantScheme(bits=bits, group_size=gs, symmetric=symmetric))


def candidate_scheme(name: str, symmetric: bool = True) -> ModuleScheme | None:
    """A `--candidates` entry's scheme: `w4a16-gN` (int4, groups of N), `w8a16`, `fp8`, or `bf16` (None: the
    linear stays float, stored in bfloat16)."""
    if name == "bf16":
        return None
    preset, _, group = name.partition("-g")
    if preset not in ("w4a16", "w8a16", "fp8") or (group and not group.isdigit()):
        raise ValueError(f"unknown candidate {name!r}; use w4a16-gN, w8a16, fp8 or bf16")
    return make_scheme(preset, int(group) if group else None, symmetric if preset != "fp8" else True)


# `--lm-head`: the head's schemes, symmetric (int4: groups of HEAD_INT4_GROUP)
HEAD_SCHEMES: dict[str, ModuleScheme] = {"int8": make_scheme("w8a16", -1, True),
                                        "int4": make_scheme("w4a16", HEAD_INT4_GROUP, True)}


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"bad regex {pattern!r}: {e}") from None


def _bits_budget(v: float | None) -> float | None:
    """--target-bits (average stored bits per weight) below bf16's 16, where a budget quantizes something; as a
    bound on the field, so that a recipe's `target_bits` is checked when it is validated."""
    if v is not None and not v < 16:  # inf too
        raise ValueError(f"{v:g}: a linear left in bf16 stores 16 bits, so a budget of 16 or more quantizes "
                         "nothing; give fewer (e.g. 4.5)")
    return v


class QuantizeConfig(BaseModel):
    """Options of `llmopt quantize` (see docs/QUANTIZE.md)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    scheme: Literal["w8a16", "w4a16", "fp8", "w8a8", "auto"]  # a Preset, or auto
    target_bits: Annotated[float | None, AfterValidator(_bits_budget)] = Field(None, gt=0)  # --scheme auto
    candidates: list[str] = list(AUTO_CANDIDATES)  # --scheme auto: what each linear may become
    auto_tokens: int | None = Field(None, gt=0)  # --scheme auto: calibration tokens the damage is measured on
    gate: list[str] = []  # --scheme auto: eval gates the smallest checkpoint must pass on eval_data
    eval_data: Path | None = None  # --scheme auto --gate: held-out text (as `llmopt eval --ppl-data`)
    eval_seq_len: int = Field(512, ge=2)  # --gate: tokens per perplexity window
    eval_max_tokens: int | None = Field(None, ge=2)  # --gate: only the first N tokens of eval_data
    method: Method = "rtn"
    group_size: int | None = None  # None: the preset default (w4a16: 128, or 64/32 when 128 does not divide)
    symmetric: bool = True
    # GPTQ: columns in decreasing Hessian-diagonal order. None (the default) means on for --method gptq and
    # off for the others; resolved to a bool by validation. Without it GPTQ chooses each group's range as it
    # reaches it and ends up worse than RTN on SmolLM2 (docs/QUANTIZE.md, "GPTQ defaults", issue #32).
    act_order: bool | None = None
    static_groups: bool = True  # act-order: fix group scales before the error feedback (identity g_idx)
    mse: bool | None = None  # GPTQ: each group's range by an importance-weighted shrink search (None: on), or min/max
    calib: Path | None = None
    calib_data: list[str] = []
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=2)
    seed: int = 0
    ignore: list[str] = []
    override: list[str] = []
    kv_cache: Literal["int8", "fp8"] | None = None
    # fp8 KV scales: one per layer ("tensor", which every vLLM attention backend reads) or one per KV head
    # ("attn_head", compressed-tensors' name: closer to the dynamic cache; vLLM 0.32 needs FlashAttention 3 on
    # CUDA for it, and its CPU backend runs each layer's largest). int8 scales are always per head.
    kv_cache_strategy: Literal["tensor", "attn_head"] = "tensor"
    # the output head (with a tied one, the embedding it shares), by rounding: int8 with a scale per row, or
    # int4 with a scale per HEAD_INT4_GROUP columns; auto (with --scheme auto): bf16, int8 or int4, chosen
    # inside the budget
    lm_head: Literal["int8", "int4", "auto"] | None = None
    # the float32 tensors outside the decoder layers (a GGUF-derived model's embedding, final norm, head) are
    # stored as: bf16 (what config.json's torch_dtype runs them in anyway, half the bytes) or as in the source
    float_dtype: Literal["bf16", "source"] = "bf16"
    format: Format = "compressed-tensors"
    output: Path
    overwrite: bool = False
    device: str = "auto"
    threads: int | None = Field(None, ge=1)  # CPU threads (None: torch's default); GPTQ's rounding depends on it
    damp: float = Field(0.01, gt=0)
    block_size: int = Field(128, ge=1)
    forward_dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    batch_tokens: int = Field(4096, ge=1)
    smoothquant_alpha: float = Field(0.5, ge=0, le=1)
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE  # per safetensors shard, as transformers' save_pretrained

    @field_validator("max_shard_size")
    @classmethod
    def _max_shard_size(cls, v: str) -> str:
        try:
            parse_shard_size(v)
        except LlmoptError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("candidates")
    @classmethod
    def _candidates(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("--candidates is empty")
        for name in v:
            candidate_scheme(name)
        return v

    @field_validator("ignore")
    @classmethod
    def _ignore(cls, v: list[str]) -> list[str]:
        for p in v:
            _compile(p)
        return v

    @field_validator("override")
    @classmethod
    def _override(cls, v: list[str]) -> list[str]:
        for item in v:
            pattern, sep, preset = item.rpartition("=")
            if not sep or not pattern:
                raise ValueError(f"override {item!r} is not REGEX=SCHEME")
            _compile(pattern)
            if preset not in PRESETS:
                raise ValueError(f"override {item!r}: unknown scheme {preset!r}; use one of {', '.join(PRESETS)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> QuantizeConfig:
        self.main_scheme()  # preset/group/sym combination
        if self.gate and self.scheme != AUTO:
            raise ValueError("--gate applies to --scheme auto (a fixed scheme is checked by `llmopt eval --gate`)")
        if self.scheme == AUTO:
            if (self.target_bits is None) == (not self.gate):
                raise ValueError("--scheme auto needs --target-bits B (average stored bits per weight, e.g. 4.5) "
                                 "or --gate EXPR with --eval-data PATH (the smallest checkpoint that passes), "
                                 "not both")
            if self.gate and self.eval_data is None:
                raise ValueError("--gate needs --eval-data PATH: held-out text to score each candidate on")
            try:
                parse_confidence_gates(self.gate)  # as `llmopt eval --gate` reads them (`@95` too)
            except LlmoptError as e:
                raise ValueError(str(e)) from None
            if self.format == "gptq":
                raise ValueError("the gptq format holds one scheme for the whole model; --scheme auto writes "
                                 "--format compressed-tensors")
            if self.override:
                raise ValueError("--scheme auto chooses every linear's scheme; use --ignore to keep one float")
            if self.group_size is not None:
                raise ValueError("--scheme auto chooses each linear's group size among --candidates (e.g. "
                                 "w4a16-g32); --group-size applies to a fixed scheme")
            for name in self.candidates:
                candidate_scheme(name, self.symmetric)
        elif self.method == AUTO:
            raise ValueError("--method auto lets --scheme auto choose GPTQ or AWQ per linear; give one method "
                             "(rtn, gptq, awq) otherwise")
        elif self.target_bits is not None or self.eval_data is not None or self.auto_tokens is not None:
            raise ValueError("--target-bits, --eval-data and --auto-tokens apply to --scheme auto only")
        elif self.lm_head == "auto":
            raise ValueError("--lm-head auto lets --scheme auto choose the head; give a fixed one (int8, int4) "
                             "otherwise")
        if self.group_size is not None and self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")
        if self.scheme == "fp8" and not self.symmetric:
            raise ValueError("fp8 weights are symmetric (a float format has no zero point); --asym applies to "
                             "int schemes")
        if self.scheme == "fp8" and self.method != "rtn":
            raise ValueError("fp8 weights are quantized by rounding (--method rtn); gptq/awq are int methods")
        if self.scheme == "w8a8" and self.method == "awq":
            raise ValueError("w8a8 uses SmoothQuant for activation outliers; use --method rtn or gptq")
        gptq = self.method in ("gptq", AUTO)  # auto: the linears it gives GPTQ
        if self.act_order and not gptq:
            raise ValueError("--act-order applies to --method gptq only")
        if self.act_order is None:
            self.act_order = gptq
        if self.act_order and not self.static_groups and self.format == "compressed-tensors":
            raise ValueError("act-order without static groups needs --format gptq (compressed-tensors no longer "
                             "reads a group index)")
        if self.mse and not gptq:
            raise ValueError("--mse applies to --method gptq only")
        if self.mse is None:
            self.mse = gptq
        if self.calib is not None and self.calib_data:
            raise ValueError("pass either --calib DIR or --calib-data PATH, not both")
        if self.kv_cache_strategy != "tensor" and self.kv_cache != "fp8":
            raise ValueError(f"--kv-cache-strategy {self.kv_cache_strategy} applies to --kv-cache fp8 (int8 KV "
                             "scales are always per head)")
        if self.format == "gptq":
            if self.lm_head is not None:
                raise ValueError(f"--lm-head {self.lm_head} is written as a compressed-tensors group; use --format "
                                 "compressed-tensors")
            if self.kv_cache == "fp8":
                raise ValueError("--kv-cache fp8 is a compressed-tensors kv_cache_scheme; use --format "
                                 "compressed-tensors")
            if self.scheme in ("fp8", "w8a8"):
                raise ValueError(f"the gptq format holds int weight-only schemes (w4a16, w8a16), not {self.scheme}; "
                                 "use --format compressed-tensors")
        return self

    @property
    def needs_data(self) -> bool:
        """GPTQ, AWQ, SmoothQuant and KV-cache scales all need calibration activations."""
        return self.data_need() is not None

    def data_need(self) -> tuple[str, str] | None:
        """What needs calibration activations, and the recipe key that asks for it (None: nothing does)."""
        if self.scheme == AUTO:
            return "--scheme auto", "scheme"
        if self.method != "rtn":
            return "GPTQ/AWQ", "method"
        if self.scheme == "w8a8":
            return "SmoothQuant (w8a8)", "scheme"
        if any(item.rpartition("=")[2] == "w8a8" for item in self.override):
            return "SmoothQuant (an --override to w8a8)", "override"
        if self.kv_cache is not None:
            return "KV-cache scales", "kv_cache"
        return None

    @property
    def main_preset(self) -> str:
        """The preset of every linear no --override names (`auto`: int4, a placeholder until the search)."""
        return "w4a16" if self.scheme == AUTO else self.scheme

    def head_scheme(self) -> ModuleScheme | None:
        """What `--lm-head` makes of the output head, symmetric: int8 with one scale per row, or int4 with one
        per HEAD_INT4_GROUP columns (None: float)."""
        if self.lm_head in (None, "auto"):
            return None
        return HEAD_SCHEMES[self.lm_head]

    def head_candidates(self) -> dict[str, ModuleScheme | None] | None:
        """`--lm-head auto`: what the search may make of the head (bf16: left float), else None."""
        return {"bf16": None, **HEAD_SCHEMES} if self.lm_head == "auto" else None

    def main_scheme(self, group_size: int | None = None) -> ModuleScheme:
        return make_scheme(self.main_preset, self.group_size if group_size is None else group_size, self.symmetric)

    def ignore_patterns(self) -> list[re.Pattern[str]]:
        return [_compile(p) for p in self.ignore]

    def override_rules(self) -> list[tuple[re.Pattern[str], str]]:
        rules = []
        for item in self.override:
            pattern, _, preset = item.rpartition("=")
            rules.append((_compile(pattern), preset))
        return rules
