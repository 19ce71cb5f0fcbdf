"""Which `llmopt bench` flags go together: `BenchOptions.build()` rejects bad combinations up front."""

from __future__ import annotations

import math

import pytest

from llmopt.bench.config import BenchOptions
from llmopt.errors import LlmoptError


def build(**kw):
    return BenchOptions(**kw).build()


def test_offline_defaults():
    cfg = build(model="m")
    assert cfg.http is None and cfg.engine is not None and cfg.engine.model == "m"
    assert cfg.workload.kind == "random" and cfg.workload.token_ids  # exact lengths in-process
    assert cfg.workload.num_requests == 100 and cfg.workload.ignore_eos
    assert len(cfg.loads) == 1 and cfg.loads[0].concurrency is None and math.isinf(cfg.loads[0].request_rate)
    assert cfg.sweep is None and cfg.warmup == 1
    assert build().engine.model is None  # no target at all: the embedded model, in-process


def test_http_and_sweeps():
    cfg = build(url="localhost:8000", concurrency="1,2,inf", input_len="10:20", num_prompts=5,
                ignore_eos=False, endpoint="chat")
    assert cfg.engine is None and cfg.http.base_url == "localhost:8000" and cfg.http.endpoint == "chat"
    assert not cfg.workload.token_ids and not cfg.workload.ignore_eos
    assert cfg.sweep == "concurrency" and [p.concurrency for p in cfg.loads] == [1, 2, None]
    cfg = build(url="h:1", request_rate="1,4", concurrency="8", burstiness=0.5, seed=3)
    assert cfg.sweep == "request_rate" and [p.request_rate for p in cfg.loads] == [1.0, 4.0]
    assert all(p.concurrency == 8 and p.burstiness == 0.5 and p.seed == 3 for p in cfg.loads)


def test_workload_selection(tmp_path):
    data = tmp_path / "w.jsonl"
    data.write_text('{"prompt": "hi", "max_tokens": 3}\n')
    assert build(model="m", dataset=str(data)).workload.kind == "jsonl"
    assert build(model="m", dataset=str(data), output_len="7").workload.default_max_tokens == 7
    assert build(model="m", scenario="prefix-cache").workload.kind == "prefix"
    assert build(model="m", scenario="prefix-cache", workload="random").workload.kind == "random"


def test_scenarios():
    cfg = build(model="m", scenario="static-vs-continuous")
    assert [v.name for v in cfg.scenario.variants] == ["static", "continuous"]
    assert [p.concurrency for p in cfg.loads] == [8] and cfg.sweep is None
    cfg = build(model="m", scenario="static-vs-continuous", static_batch_size=4)
    assert [p.concurrency for p in cfg.loads] == [4]
    cfg = build(model="m", scenario="static-vs-continuous", concurrency="2,4")
    assert cfg.sweep == "concurrency" and [p.concurrency for p in cfg.loads] == [2, 4]
    cfg = build(model="m", scenario="prefix-cache", concurrency="4", gates=["output_throughput_ratio>=1"])
    assert [v.engine_overrides for v in cfg.scenario.variants] == [{"enable_prefix_caching": False},
                                                                   {"enable_prefix_caching": True}]


@pytest.mark.parametrize(("kw", "message"), [
    ({"url": "h:1", "model": "m"}, "--model configure the in-process engine"),
    ({"url": "h:1", "dtype": "bfloat16", "prefix_caching": False}, "--dtype, --no-prefix-caching"),
    ({"model": "m", "endpoint": "chat"}, "--endpoint apply to a server"),
    ({"url": "h:1", "threads": "2"}, "--threads configure the in-process engine"),
    ({"model": "m", "threads": "0"}, "--threads must be a positive count or auto"),
    ({"model": "m", "threads": "two"}, "--threads must be a positive count or auto"),
    ({"model": "m", "tokenizer": "t"}, "--tokenizer is for --url"),
    ({"model": "m", "slo": "ttft=fast"}, "cannot parse SLO item"),
    ({"model": "m", "concurrency": "1,two"}, "'two' is not a number"),
    ({"model": "m", "concurrency": "0,1"}, "must be positive"),
    ({"model": "m", "request_rate": "1,2", "concurrency": "1,2"}, "not a sweep"),
    ({"model": "m", "input_len": "10:5"}, "needs 1 <= LO <= HI"),
    ({"model": "m", "dataset": "/no/such/file.jsonl"}, "dataset file /no/such/file.jsonl not found"),
    ({"model": "m", "workload": "jsonl"}, "needs --dataset"),
    ({"model": "m", "num_prompts": 0}, "--num-prompts must be at least 1"),
    ({"model": "m", "warmup": -1}, "--warmup must be non-negative"),
    ({"model": "m", "burstiness": 0.0}, "--burstiness must be a positive"),
    ({"model": "m", "plot_path": "out.svg"}, "--plot writes a PNG"),
    ({"model": "m", "gates": ["tput>=1"]}, "unknown gate metric 'tput'"),
    ({"model": "m", "gates": ["output_throughput>>1"]}, "cannot parse gate"),
    ({"model": "m", "static_batch_size": 4}, "only applies to --scenario static-vs-continuous"),
    ({"model": "m", "scenario": "medusa"}, "unknown scenario 'medusa'"),
    ({"url": "h:1", "scenario": "prefix-cache"}, "use --model, not --url"),
    ({"model": "m", "scenario": "static-vs-continuous", "request_rate": "4"}, "drop --request-rate"),
    ({"model": "m", "scenario": "static-vs-continuous", "concurrency": "4", "static_batch_size": 4}, "not both"),
    ({"model": "m", "scenario": "static-vs-continuous", "concurrency": "4,inf"}, "finite batch size"),
])
def test_bad_combinations_are_one_line_errors(kw, message):
    with pytest.raises(LlmoptError) as e:
        build(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)
