"""Where a checkpoint runs: the one table of which tools and vLLM backends load each scheme we write.

`llmopt quantize` puts the answer for its plan into the printed summary, `--json` and
quantization_report.json (`deployment`), and docs/QUANTIZE.md shows the same table. Each cell says
whether the tool runs the scheme (True, False, or None: not measured and not known), how (kernel or
loader) or why not, and whether that was measured (transformers 5.24 + compressed-tensors 0.20 and
vLLM CPU 0.32 on real checkpoints, greedy fp32 / bf16) or read from vLLM's scheme selection.

A plan with several schemes (`--override`) runs where all of them run (`combine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmopt.quant.recipe import ModuleScheme

TOOLS = ("transformers", "vllm_cuda", "vllm_cpu")
TOOL_NAMES = {"transformers": "transformers", "vllm_cuda": "vLLM CUDA", "vllm_cpu": "vLLM CPU"}


@dataclass(frozen=True)
class Cell:
    runs: bool | None
    how: str
    measured: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"runs": self.runs, "how": self.how, "measured": self.measured}


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    transformers: Cell
    vllm_cuda: Cell
    vllm_cpu: Cell

    def cell(self, tool: str) -> Cell:
        return getattr(self, tool)


_CT = "compressed-tensors (decompresses on load)"
_CPU_WNA16 = "CPUWNA16 takes only uint4 / uint4b8"

TABLE: dict[str, Row] = {r.key: r for r in (
    Row("ct-w8a16", "w8a16, compressed-tensors (int8 weight-only, sym)",
        Cell(True, _CT + "; greedy equals llmopt", True),
        Cell(True, "Marlin / Machete (uint8b128, sm80+)"),
        Cell(False, f"no CPU kernel for uint8b128: {_CPU_WNA16}", True)),
    Row("ct-w8a16-asym", "w8a16 --asym, compressed-tensors",
        Cell(False, "transformers 5.24 allocates weight_zero_point unpacked and rejects the packed tensor "
                    "(the compressed-tensors library itself reads it)", True),
        Cell(None, "vLLM's int8 weight-only kernels take symmetric uint8b128; asymmetric int8 is untested"),
        Cell(False, f"no CPU kernel for 8-bit weights: {_CPU_WNA16}")),
    Row("ct-w4a16", "w4a16, compressed-tensors (int4 weight-only, sym)",
        Cell(True, _CT + "; greedy equals llmopt", True),
        Cell(True, "Marlin / Machete (uint4b8, sm80+)"),
        Cell(True, "CPUWNA16 (uint4b8); perplexity within 0.06% of llmopt with VLLM_CPU_INT4_W4A8=0 (vLLM's "
                   "default on AMX CPUs quantizes activations to int8: +3.8%)", True)),
    Row("ct-w4a16-asym", "w4a16 --asym, compressed-tensors",
        Cell(False, "transformers 5.24 allocates weight_zero_point unpacked and rejects the packed tensor "
                    "(the compressed-tensors library itself reads it)", True),
        Cell(True, "Marlin (uint4 with zero points, sm80+)"),
        Cell(True, "CPUWNA16 (uint4 with zero points)")),
    Row("ct-fp8", "fp8, compressed-tensors (float8 e4m3 weight-only, per channel)",
        Cell(True, _CT + "; greedy equals llmopt", True),
        Cell(True, "FP8 Marlin weight-only (W8A16-FP8 scheme: fp8 weights without input_activations, sm80+)"),
        Cell(False, "no ScaledMM kernel for fp8 on CPU", True)),
    Row("ct-w8a8", "w8a8, compressed-tensors (int8 weights, dynamic per-token int8 activations)",
        Cell(True, "compressed-tensors: int8 weights decompressed, activations fake-quantized per token; "
                   "same rounding as llmopt (absmax/127.5)", True),
        Cell(True, "CUTLASS int8 scaled_mm (sm75+); activations rounded with absmax/127, one step off on "
                   "some codes"),
        Cell(True, "loads (oneDNN int8 scaled_mm); activations rounded with absmax/127", True)),
    Row("gptq-w4", "w4a16, gptq format",
        Cell(True, "needs optimum + gptqmodel (pin gptqmodel<7.7: newer pulls a CUDA torch); greedy equals "
                   "llmopt", True),
        Cell(True, "gptq_marlin (sm80+), exllama / gptq kernels below"),
        Cell(True, "loads", True)),
    Row("gptq-w8", "w8a16, gptq format",
        Cell(True, "needs optimum + gptqmodel (pin gptqmodel<7.7)"),
        Cell(True, "gptq_marlin (uint8b128, sm80+)"),
        Cell(None, f"{_CPU_WNA16}, so expect no kernel")),
)}

# `--lm-head int8|int4`: the head as a compressed-tensors weight-only group (int8 per row, int4 per 32 columns),
# named in its targets
HEAD_TABLE: dict[str, Row] = {r.key: r for r in (
    Row("head-int8", "--lm-head int8, untied head (lm_head as an int8 linear)",
        Cell(True, _CT + "; logits equal llmopt's", True),
        Cell(True, "vLLM's ParallelLMHead takes the lm_head group as a linear scheme (WNA16 uint8b128, Marlin)"),
        Cell(False, f"no CPU kernel for uint8b128: {_CPU_WNA16}")),
    Row("head-int8-tied", "--lm-head int8, tied head (the shared embedding as int8)",
        Cell(False, "transformers 5.24 cannot initialize a compressed-tensors Embedding (its _init_weights "
                    "reads the weight that compression replaced); llmopt's engine runs it", True),
        Cell(False, "vLLM 0.32 looks up a quantized embedding (CompressedTensorsEmbeddingWNA16Int) but cannot "
                    "compute a tied head with it (its apply raises; vLLM PR #45535 is open)"),
        Cell(False, "vLLM 0.32's quantized embedding gathers with a Triton kernel, and cannot compute a tied "
                    "head with it")),
    Row("head-int4", "--lm-head int4, untied head (lm_head as an int4 linear, groups of 32)",
        Cell(True, _CT + "; logits equal llmopt's", True),
        Cell(True, "vLLM's ParallelLMHead takes the lm_head group as a linear scheme (WNA16 uint4b8, Marlin)"),
        Cell(None, "CPUWNA16 takes uint4b8 groups, so the head may run there")),
    Row("head-int4-tied", "--lm-head int4, tied head (the shared embedding as int4, groups of 32)",
        Cell(False, "transformers 5.24 cannot initialize a compressed-tensors Embedding (its _init_weights "
                    "reads the weight that compression replaced); llmopt's engine runs it", True),
        Cell(False, "vLLM 0.32 looks up a quantized embedding but cannot compute a tied head with it (vLLM PR "
                    "#45535 is open)"),
        Cell(False, "vLLM 0.32's quantized embedding gathers with a Triton kernel, and cannot compute a tied "
                    "head with it")),
)}

KV_NOTES = {
    "int8": ("INT8 KV-cache scales are in kv_cache_scales.json, read by llmopt only; transformers and vLLM load "
             "the weights and run their own KV cache (vLLM: --kv-cache-dtype auto or fp8)"),
    "fp8": ("FP8 KV-cache scales are a compressed-tensors kv_cache_scheme (per layer k_scale/v_scale), as "
            "llm-compressor writes them: vLLM runs an fp8 cache from them (CPU 0.32 measured: it turns the fp8 "
            "cache on by itself, at +4.4% perplexity against +0.5% in llmopt); llmopt's engine runs an fp8 "
            "cache with them by default"),
    "fp8-attn_head": ("FP8 KV-cache scales are a compressed-tensors kv_cache_scheme with one k_scale/v_scale per "
                      "KV head (strategy attn_head), as llm-compressor writes them: vLLM 0.32 on CUDA runs them on "
                      "FlashAttention 3 only (Hopper; no other backend takes per-head scales), vLLM CPU with each "
                      "layer's largest; llmopt's engine runs an fp8 cache with them by default"),
}


def row_key(scheme: ModuleScheme, fmt: str) -> str:
    """The TABLE key of one module scheme written in `fmt`."""
    w = scheme.weights
    if fmt == "gptq":
        return f"gptq-w{w.bits}"
    if w.kind == "fp8":
        return "ct-fp8"
    if scheme.int8_activations:
        return "ct-w8a8"
    return f"ct-w{w.bits}a16" + ("" if w.symmetric else "-asym")


def combine(cells: list[Cell]) -> Cell:
    """One cell for a checkpoint mixing schemes: it runs only where every scheme runs."""
    if any(c.runs is False for c in cells):
        bad = [c for c in cells if c.runs is False]
        return Cell(False, "; ".join(dict.fromkeys(c.how for c in bad)), all(c.measured for c in bad))
    if any(c.runs is None for c in cells):
        return Cell(None, "; ".join(dict.fromkeys(c.how for c in cells if c.runs is None)))
    return Cell(True, "; ".join(dict.fromkeys(c.how for c in cells)), all(c.measured for c in cells))


MOE_NOTE = ("Mixture-of-Experts: the table was measured on dense llama-family models. transformers 5 loads "
            "the compressed-tensors MoE export into fused fp16 expert tensors (same weights; logits within "
            "5e-3 of llmopt on the tiny test models, tests/models/test_moe_quant.py); vLLM's MoE kernels on "
            "these checkpoints were not measured")


def deployment(schemes: list[ModuleScheme], fmt: str, kv_cache: str | None = None, moe: bool = False,
               head: str | None = None, kv_strategy: str = "tensor") -> dict[str, Any]:
    """The report's `deployment` entry for a checkpoint holding `schemes` in format `fmt` (`moe`: the
    model has experts, whose deployment was not measured like the dense rows; `head`: a HEAD_TABLE key when
    `--lm-head` quantized the head; `kv_strategy`: an fp8 KV cache's scales per layer or per KV head)."""
    keys = list(dict.fromkeys(row_key(s, fmt) for s in schemes))
    rows = [TABLE[k] for k in keys]
    if head is not None:
        keys.append(head)
        rows.append(HEAD_TABLE[head])
    out: dict[str, Any] = {"schemes": keys}
    for tool in TOOLS:
        out[tool] = combine([r.cell(tool) for r in rows]).to_json()
    kv_key = kv_cache if kv_strategy == "tensor" else f"{kv_cache}-{kv_strategy}"
    out["notes"] = ([KV_NOTES[kv_key]] if kv_cache else []) + ([MOE_NOTE] if moe else [])
    return out


def describe(dep: dict[str, Any]) -> list[tuple[str, str]]:
    """(tool name, 'yes — how' / 'no — why' / 'unknown — ...') lines for the printed summary."""
    word = {True: "yes", False: "no", None: "unknown"}
    lines = []
    for tool in TOOLS:
        c = dep[tool]
        tag = "measured" if c["measured"] else "not measured"
        lines.append((TOOL_NAMES[tool], f"{word[c['runs']]}: {c['how']} ({tag})"))
    return lines
