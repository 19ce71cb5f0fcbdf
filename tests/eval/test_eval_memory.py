"""`eval` at size: a baseline and its candidate are never in memory together, and a float32 upcast says what
it costs before it loads."""

from __future__ import annotations

import pytest

from llmopt.eval.compare import run_eval
from llmopt.eval.options import EvalOptions
from llmopt.testing.live_bytes import LiveTensorBytes
from llmopt.testing.tiny_model import write_tiny_llama

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 10


def _peak(opts: EvalOptions) -> tuple[int, object]:
    with LiveTensorBytes() as m:
        report = run_eval(opts)
    return m.peak, report


def test_a_comparison_needs_the_memory_of_one_model(tiny_llama, tmp_path):
    """Live tensor bytes (torch's own accounting): comparing two models peaks where scoring one does, plus
    the baseline's top-k record, not at the sum of two engines (weights and KV pools)."""
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    run_eval(EvalOptions(model=str(tiny_llama), ppl_data=data, seq_len=64))  # warm: kernels, caches
    one, _ = _peak(EvalOptions(model=str(tiny_llama), ppl_data=data, seq_len=64))
    both, report = _peak(EvalOptions(model=str(tiny_llama), baseline=str(tiny_llama), ppl_data=data, seq_len=64))
    assert report.models["candidate"]["weight_bytes"] > 0
    assert report.text.divergence.kl_div == pytest.approx(0.0, abs=1e-6)
    record = report.text.divergence.tokens * min(report.text.protocol["kl_top_k"], 512) * 8  # the saved top-k
    assert both <= one * 1.05 + record, f"comparison peaked at {both} live bytes, one model at {one}"  # both: ~2x


def test_float32_upcast_is_announced_before_loading(tmp_path):
    d = write_tiny_llama(tmp_path / "bf16", dtype="bfloat16")
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    lines: list[str] = []
    report = run_eval(EvalOptions(model=str(d), ppl_data=data, seq_len=64, dtype="float32"), notify=lines.append)
    assert len(lines) == 1 and "2x its bfloat16 checkpoint" in lines[0] and "GB" in lines[0]
    assert report.models["candidate"]["dtype"] == "float32"
    lines.clear()
    report = run_eval(EvalOptions(model=str(d), ppl_data=data, seq_len=64), notify=lines.append)
    assert lines == [] and report.models["candidate"]["dtype"] == "bfloat16"  # auto: the checkpoint's own


def test_weight_bytes_counts_packed_weights_without_unpacking(tmp_path):
    """A bf16 model's linears are packed on a CPU (no parameter, no buffer): they are counted, and counting
    allocates nothing (state_dict() would unpack every weight)."""
    from llmopt.eval.engines import EngineOptions, build_llm, weight_bytes

    d = write_tiny_llama(tmp_path / "bf16", dtype="bfloat16")
    llm = build_llm(str(d), EngineOptions(device="cpu"))
    model = llm.engine.model
    with LiveTensorBytes() as m:
        counted = weight_bytes(model)
    assert m.peak == 0
    s = model.spec
    assert counted >= 2 * s.num_params() * 0.99  # every weight, in bf16 (packed or not)


def test_generation_room_is_capped_in_bytes():
    """A generate_until task's pool room is 16k tokens, but at most 2 GiB of KV: for Llama-2-7B (no GQA,
    512 KiB a token in bf16) 16k tokens would be 8 GiB, which with the 13.8 GB model ran a 24 GiB machine
    out of memory in the seed recipe's eval."""
    from pathlib import Path

    from llmopt.eval.engines import EngineOptions, generation_tokens

    llama2 = str(Path(__file__).resolve().parents[2] / "recipes" / "configs" / "llama-2-7b.config.json")
    opts = EngineOptions(dtype="bfloat16", device="cpu")
    assert generation_tokens(llama2, opts) == 4096
    assert generation_tokens(llama2, opts.model_copy(update={"kv_cache_dtype": "int8"})) == 8192
    assert generation_tokens(llama2, opts.model_copy(update={"generation_tokens": 0})) == 0
    assert generation_tokens("smollm2-135m", opts) == 16384  # 22.5 KiB a token: the full room
