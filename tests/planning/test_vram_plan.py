"""vram-plan: exact anchors for real architectures, the documented formulas, fit search, the parallel
plan, the recommendation order, and the CLI's JSON and one-line errors."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from llmopt.errors import LlmoptError
from llmopt.models.spec import ModelSpec
from llmopt.planning.memory import GiB, MiB
from llmopt.planning.parallel import pipeline_partition, tp_problem
from llmopt.planning.vram import VramPlan, VramPlanOptions, plan_vram, render_vram_plan

# ---- configs (the architecture facts of the public config.json files) ----------------------------

LLAMA2_7B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
}
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}
MODELS = {"llama2-7b": LLAMA2_7B, "llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}
# (params, KV bytes/token at the checkpoint dtype, a group size that divides every quantized input)
ANCHORS = {
    "llama2-7b": (6_738_415_616, 524_288, 128),
    "llama3-8b": (8_030_261_248, 131_072, 128),
    "smollm2-135m": (134_515_008, 23_040, 64),
}


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(MODELS[name])


def plan(name: str, **opts: Any) -> VramPlan:
    return plan_vram(spec_of(name), VramPlanOptions(**opts), model_name=name)


def split_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(quantized Linear params, params kept 16-bit, number of Linears): the tests' own restatement
    of the documented weight formula, independent of the planner's per-shard code."""
    linear = spec.num_layers * spec.layer_linear_params()
    return linear, spec.num_params() - linear, spec.num_layers * len(spec.linear_shapes())


def groups(spec: ModelSpec, g: int) -> int:
    per_layer = sum(o * (1 if g == -1 else i // g) for o, i in spec.linear_shapes().values())
    return spec.num_layers * per_layer


# ---- anchors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_param_count_and_kv_per_token_anchors(name: str) -> None:
    params, kv_per_token, _ = ANCHORS[name]
    p = plan(name)
    assert p.params == params
    assert p.kv_bytes_per_token == kv_per_token


def test_llama2_kv_per_sequence_is_1_gib_not_2() -> None:
    p = plan("llama2-7b", seq_len=2048, batch=3)
    assert p.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 524_288
    assert p.kv_bytes_per_sequence == 2 * 32 * 2048 * 4096 * 2 == 1_073_741_824
    assert p.kv_bytes_total == 3 * 1_073_741_824


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("dtype", "nbytes"), [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_float_weights_are_params_times_bytes(name: str, dtype: str, nbytes: int) -> None:
    p = plan(name, weight_dtype=dtype)
    assert p.gpu.weights.total == nbytes * ANCHORS[name][0]
    assert p.dtypes.weight == dtype


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("g_choice", ["model", -1])
def test_int8_weights_formula(name: str, g_choice: Any) -> None:
    """int8: 1 B/param + one fp16 scale per group (per output row at -1); the rest stays 16-bit."""
    g = ANCHORS[name][2] if g_choice == "model" else -1
    s = spec_of(name)
    linear, rest, _ = split_params(s)
    p = plan(name, weight_dtype="int8", group_size=g)
    assert p.gpu.weights.total == linear + 2 * groups(s, g) + 2 * rest
    assert p.dtypes.group_size == g


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("g_choice", ["model", -1])
def test_int4_weights_formula(name: str, g_choice: Any) -> None:
    """int4 asym: 4 bits/param + per group a 16-bit scale and a 4-bit zero; the rest stays 16-bit."""
    g = ANCHORS[name][2] if g_choice == "model" else -1
    s = spec_of(name)
    linear, rest, _ = split_params(s)
    p = plan(name, weight_dtype="int4", group_size=g)
    assert p.gpu.weights.total == (4 * linear + 20 * groups(s, g)) // 8 + 2 * rest


def test_int4_llama2_worked_example() -> None:
    """The docs' worked example: 3,238,002,688 packed + 126,484,480 scales/zeros + 524,820,480 16-bit."""
    assert plan("llama2-7b", weight_dtype="int4", group_size=128).gpu.weights.total == 3_889_307_648


@pytest.mark.parametrize("name", MODELS)
def test_fp8_weights_formula(name: str) -> None:
    s = spec_of(name)
    linear, rest, n_linear = split_params(s)
    assert plan(name, weight_dtype="fp8").gpu.weights.total == linear + 4 * n_linear + 2 * rest


def test_tied_embeddings_counted_once() -> None:
    w = plan("smollm2-135m", weight_dtype="bf16").gpu.weights
    assert w.lm_head == 0 and w.embedding == 49152 * 576 * 2


# ---- KV dtypes and auto resolution ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "per_token"),
    [("fp32", 2 * 524_288), ("fp16", 524_288), ("bf16", 524_288), ("fp8", 262_144),
     ("int8", 2 * 32 * 32 * (128 + 2))],
)
def test_kv_dtypes(kv: str, per_token: int) -> None:
    assert plan("llama2-7b", kv_dtype=kv).kv_bytes_per_token == per_token


@pytest.mark.parametrize(
    ("cfg_dtype", "weight", "want"),
    [
        ("bfloat16", "auto", ("bf16", "bf16", "bf16")),
        ("float32", "auto", ("fp32", "fp32", "fp32")),
        ("float16", "auto", ("fp16", "fp16", "fp16")),
        ("float32", "int4", ("int4", "fp16", "fp16")),
        ("bfloat16", "int8", ("int8", "bf16", "bf16")),
        ("float16", "fp8", ("fp8", "fp16", "fp16")),
        ("bfloat16", "fp16", ("fp16", "fp16", "fp16")),
    ],
)
def test_auto_dtypes(cfg_dtype: str, weight: str, want: tuple[str, str, str]) -> None:
    s = ModelSpec.from_hf_config({**SMOLLM2_135M, "torch_dtype": cfg_dtype})
    p = plan_vram(s, VramPlanOptions(weight_dtype=weight, group_size=64))
    assert (p.dtypes.weight, p.dtypes.kv, p.dtypes.compute) == want


def test_dtype_aliases_are_normalized() -> None:
    o = VramPlanOptions(weight_dtype="BFloat16", kv_dtype="fp8_e4m3")
    assert (o.weight_dtype, o.kv_dtype) == ("bf16", "fp8")


# ---- activations, reserve, fits -------------------------------------------------------------------


def test_activation_and_reserve_formulas() -> None:
    p = plan("llama2-7b", seq_len=1024, batch=4)
    act = p.gpu.activation
    tokens = min(1024 * 4, 2048)
    assert act.prefill_chunk_tokens == tokens
    assert act.layer_peak == tokens * 2 * (2 * 4096 + max(3 * 4096 + 4096, 3 * 11008))
    assert act.logits == 4 * 32000 * (2 + 4 + 4)
    used = p.gpu.weights.total + p.kv_bytes_total + act.total
    assert p.gpu.reserve == GiB + math.ceil(used * 5 / 100)
    assert p.total_bytes == used + p.gpu.reserve


def test_fits_boundary_is_inclusive() -> None:
    total = plan("smollm2-135m").total_bytes
    assert plan("smollm2-135m", gpu_memory_bytes=total).fits
    assert not plan("smollm2-135m", gpu_memory_bytes=total - 1).fits


@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("llama2-7b", {"gpu_memory_bytes": 24 * GiB, "seq_len": 4096}),
        ("llama3-8b", {"gpu_memory_bytes": 80 * GiB, "seq_len": 8192, "kv_dtype": "fp8", "batch": 3}),
        ("smollm2-135m", {"gpu_memory_bytes": 4 * GiB, "seq_len": 8192, "weight_dtype": "int4",
                          "group_size": 64}),
    ],
)
def test_max_concurrency_and_length_are_tight(name: str, opts: dict[str, Any]) -> None:
    p = plan(name, **opts)
    n, length = p.max_concurrent_sequences, p.max_seq_len_at_batch
    assert n >= 1 and length >= 1
    assert plan(name, **{**opts, "batch": n}).fits
    assert not plan(name, **{**opts, "batch": n + 1}).fits
    assert plan(name, **{**opts, "seq_len": length}).fits
    assert not plan(name, **{**opts, "seq_len": length + 1}).fits


def test_nothing_fits_on_a_tiny_gpu() -> None:
    p = plan("llama2-7b", gpu_memory_bytes=8 * GiB)
    assert not p.fits and p.max_concurrent_sequences == 0 and p.max_seq_len_at_batch == 0


def test_seq_len_past_context_is_a_warning() -> None:
    p = plan("llama2-7b", seq_len=8192, gpu_memory_bytes=80 * GiB)
    assert p.fits and any("max_position_embeddings 4096" in w for w in p.warnings)
    assert plan("llama2-7b").warnings == []


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"weight_dtype": "int3"}, "unknown --weight-dtype 'int3'"),
        ({"kv_dtype": "int4"}, "unknown --kv-dtype 'int4'"),
        ({"seq_len": 0}, "--seq-len must be at least 1"),
        ({"batch": 0}, "--batch must be at least 1"),
        ({"num_gpus": 0}, "--num-gpus must be at least 1"),
        ({"group_size": 0}, "--group-size must be -1"),
    ],
)
def test_bad_options_raise_llmopt_error(opts: dict[str, Any], needle: str) -> None:
    with pytest.raises(LlmoptError, match=re.escape(needle)):
        VramPlanOptions(**opts)


def test_group_size_must_divide_and_lists_valid_sizes() -> None:
    with pytest.raises(LlmoptError) as e:
        plan("smollm2-135m", weight_dtype="int4", group_size=128)
    msg = str(e.value)
    assert "hidden 576" in msg and "valid group sizes: 8, 16, 24, 32, 48, 64, 96, 192 " in msg
    assert "(multiples of 32 for the int4 kernels: 32, 64, 96, 192), or -1 (per channel)" in msg
    assert "\n" not in msg
    plan("smollm2-135m", weight_dtype="int4", group_size=-1)
    plan("smollm2-135m", weight_dtype="fp16", group_size=128)  # unused for float weights: no error


# ---- parallel -------------------------------------------------------------------------------------


def test_pipeline_partition_matches_vllm() -> None:
    assert pipeline_partition(32, 8) == [4] * 8
    assert pipeline_partition(30, 4) == [7, 8, 8, 7]  # remainder before the last (lm_head) stage
    assert sum(pipeline_partition(30, 7)) == 30


def test_llama2_on_2_gpus() -> None:
    p = plan("llama2-7b", num_gpus=2, gpu_memory_bytes=16 * GiB, seq_len=4096, batch=2)
    par = p.parallel
    assert par is not None and par.valid_tp_degrees == (1, 2)
    tp1, tp2 = par.tensor_parallel
    norms = (2 * 4096 * 32 + 4096) * 2  # replicated RMSNorm weights
    w1, w2 = tp1.largest_stage.gpu.weights, tp2.largest_stage.gpu.weights
    assert w2.total == (p.gpu.weights.total - norms) // 2 + norms
    assert w2.embedding * 2 == w1.embedding and w2.lm_head * 2 == w1.lm_head
    assert tp2.largest_stage.gpu.kv * 2 == p.kv_bytes_total
    assert tp2.kv_heads_per_gpu == 16 and not tp2.kv_heads_replicated
    assert not tp1.fits and tp2.fits and par.min_tp_that_fits == 2
    pp = par.pipeline_parallel
    assert [s.num_layers for s in pp.stages] == [16, 16]
    assert pp.stages[0].gpu.weights.embedding > 0 and pp.stages[0].gpu.weights.lm_head == 0
    assert pp.stages[1].gpu.weights.lm_head > 0 and pp.stages[1].gpu.kv * 2 == p.kv_bytes_total
    dp = par.to_json()["data_parallel"]
    assert dp["tp"] == 2 and dp["pp"] == 1 and dp["replicas"] == 1


def test_llama2_on_8_gpus() -> None:
    p = plan("llama2-7b", num_gpus=8, gpu_memory_bytes=24 * GiB)
    par = p.parallel
    assert par is not None
    assert par.valid_tp_degrees == (1, 2, 4, 8)
    assert set(par.invalid_tp_degrees) == {3, 5, 6, 7}
    tp8 = par.tensor_parallel[-1]
    assert tp8.tp == 8 and tp8.kv_heads_per_gpu == 4
    assert tp8.largest_stage.gpu.kv * 8 == p.kv_bytes_total
    assert [s.num_layers for s in par.pipeline_parallel.stages] == [4] * 8
    assert par.min_tp_that_fits == 1  # fits on one 24 GiB GPU: replicate instead
    dp = par.to_json()["data_parallel"]
    assert dp["gpus_per_replica"] == 1 and dp["replicas"] == 8
    assert dp["max_concurrent_sequences_total"] == 8 * p.max_concurrent_sequences
    assert any("data-parallel" in a for a in par.advice)


def test_kv_heads_replicate_past_num_kv_heads() -> None:
    p = plan("llama3-8b", num_gpus=16, gpu_memory_bytes=80 * GiB)
    par = p.parallel
    assert par is not None and par.valid_tp_degrees == (1, 2, 4, 8, 16)
    by_tp = {lay.tp: lay for lay in par.tensor_parallel}
    assert by_tp[16].kv_heads_per_gpu == 1 and by_tp[16].kv_heads_replicated
    assert by_tp[16].largest_stage.gpu.kv == by_tp[8].largest_stage.gpu.kv  # stops shrinking
    assert any("replicated" in a for a in par.advice)
    # SmolLM2: 9 heads and 3 KV heads split 3 ways; 2 splits no heads, 9 no MLP (1536 / 9).
    smol = spec_of("smollm2-135m")
    assert tp_problem(smol, 3) is None
    assert "num_attention_heads" in (tp_problem(smol, 2) or "")
    assert "intermediate_size" in (tp_problem(smol, 9) or "")


def test_quantized_tp_keeps_whole_groups() -> None:
    s = spec_of("llama2-7b")  # down_proj input 11008 / 8 = 1376 = 10.75 groups of 128
    assert "down_proj" in (tp_problem(s, 8, 128) or "")
    assert tp_problem(s, 8, 32) is None


def test_parallel_is_null_on_one_gpu() -> None:
    assert plan("smollm2-135m").to_json()["parallel"] is None


# ---- recommendations -------------------------------------------------------------------------------


def kinds(p: VramPlan) -> list[str]:
    return [r.kind for r in p.recommendations]


def test_no_recommendations_with_headroom() -> None:
    assert plan("smollm2-135m", gpu_memory_bytes=24 * GiB).recommendations == []


def test_recommendations_follow_the_oom_checklist() -> None:
    p = plan("llama2-7b", gpu_memory_bytes=16 * GiB, seq_len=2048, batch=4)  # weights 12.6 GiB > KV 4 GiB
    assert not p.fits
    assert kinds(p) == ["weights_int8", "weights_int4", "kv_fp8", "cap_seq_len", "cap_batch", "tensor_parallel"]
    for r in p.recommendations:
        assert r.saves_bytes == p.total_bytes - r.total_bytes_after > 0
    by = {r.kind: r for r in p.recommendations}
    assert by["weights_int4"].saves_bytes > by["weights_int8"].saves_bytes
    assert str(p.max_seq_len_at_batch) in by["cap_seq_len"].action and by["cap_seq_len"].fits_after
    assert by["cap_batch"].fits_after and "--max-num-seqs 1" in by["cap_batch"].action
    assert "--tensor-parallel-size 2" in by["tensor_parallel"].action


def test_kv_dominated_plans_skip_weight_quantization() -> None:
    p = plan("llama3-8b", seq_len=131072, gpu_memory_bytes=24 * GiB)
    assert kinds(p)[0] == "kv_fp8" and not any(k.startswith("weights") for k in kinds(p))


def test_fp32_checkpoint_is_served_16bit_first() -> None:
    s = ModelSpec.from_hf_config({**SMOLLM2_135M, "torch_dtype": "float32"})
    p = plan_vram(s, VramPlanOptions(gpu_memory_bytes=1 * GiB + 600 * MiB))
    assert kinds(p)[:3] == ["weights_16bit", "weights_int8", "weights_int4"]
    assert "per channel" in p.recommendations[1].action  # int8 defaults to per-channel scales (W8A16)
    assert "group size 64" in p.recommendations[2].action  # 128 does not divide 576: a valid one is used


# ---- JSON and rendering ----------------------------------------------------------------------------

REQUIRED_KEYS = {
    "model", "params", "weights_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_total",
    "activation_bytes", "total_bytes", "gpu_memory_bytes", "fits", "max_concurrent_sequences", "parallel",
    "recommendations", "max_seq_len_at_batch", "reserve_bytes", "weight_dtype", "kv_dtype", "warnings",
}


def test_json_shape() -> None:
    d = json.loads(json.dumps(plan("llama2-7b", num_gpus=2, gpu_memory_bytes=16 * GiB, batch=4).to_json()))
    assert REQUIRED_KEYS <= d.keys()
    assert d["total_bytes"] == d["weights_bytes"] + d["kv_bytes_total"] + d["activation_bytes"] + d["reserve_bytes"]
    assert all({"action", "saves_bytes"} <= r.keys() for r in d["recommendations"]) and d["recommendations"]
    assert {"tensor_parallel", "pipeline_parallel", "data_parallel", "valid_tp_degrees", "advice"} <= d["parallel"].keys()


def test_render_shows_table_fit_line_parallel_and_recommendations() -> None:
    console = Console(record=True, width=100, color_system=None)
    render_vram_plan(plan("llama2-7b", num_gpus=2, gpu_memory_bytes=16 * GiB, batch=4), console)
    text = console.export_text()
    for needle in ("weights", "KV cache", "activations", "reserve", "does not fit", "Parallel plan", "TP=2",
                   "Recommendations", "1. quantize weights to int8"):
        assert needle in text


# ---- CLI ------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmopt", "vram-plan", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    for name, cfg in MODELS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    return tmp_path


def test_cli_json(config_dir: Path) -> None:
    r = run_cli(str(config_dir / "llama2-7b.json"), "--seq-len", "2048", "--gpu-memory", "24GiB", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert REQUIRED_KEYS <= d.keys()
    assert d["params"] == 6_738_415_616 and d["kv_bytes_per_sequence"] == 1_073_741_824
    assert d["gpu_memory_bytes"] == 24 * GiB and d["parallel"] is None


def test_cli_table(config_dir: Path) -> None:
    r = run_cli(str(config_dir / "llama3-8b.json"), "--num-gpus", "2", "--gpu-memory", "16GiB")
    assert r.returncode == 0, r.stderr
    assert "does not fit on one GPU" in r.stdout and "Parallel plan on 2 GPUs" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--weight-dtype", "int3"], "unknown --weight-dtype 'int3'"),
        (["--kv-dtype", "fp4"], "unknown --kv-dtype 'fp4'"),
        (["--seq-len", "0"], "--seq-len must be at least 1"),
        (["--num-gpus", "0"], "--num-gpus must be at least 1"),
        (["--weight-dtype", "int4", "--group-size", "128"], "valid group sizes: 8, 16, 24, 32"),
    ],
)
def test_cli_errors_are_one_line(config_dir: Path, args: list[str], needle: str) -> None:
    r = run_cli(str(config_dir / "smollm2-135m.json"), *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
