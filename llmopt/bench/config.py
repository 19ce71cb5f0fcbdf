"""`llmopt bench` configuration: the CLI's flat options (`BenchOptions`) and the typed plan they become
(`BenchConfig`).

Every rule about which flags go together lives in `BenchOptions.build()`, not in the CLI, so that bad
input fails here, before any model is loaded or any request is sent, as one-line `LlmoptError`s (exit 2),
and so that Python callers and recipes get the same checks as the command line. Nothing in this module
imports torch: `llmopt bench --slo nonsense` answers in a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.bench.ab_config import DEFAULT_AB_ROUNDS, AbConfig, AbOrder, AbSide, parse_side
from llmopt.bench.ab_gates import BenchGate, parse_bench_gates
from llmopt.bench.conversations import ConversationWorkload
from llmopt.bench.http_target import HttpTargetConfig
from llmopt.bench.load import LoadPattern, parse_sweep
from llmopt.bench.metrics import Slo, parse_slo
from llmopt.bench.report import LatencyMetric, Percentile, SweepKind
from llmopt.bench.scenarios import DEFAULT_STATIC_BATCH_SIZE, Scenario, ScenarioParams, build_scenario
from llmopt.bench.trace_workload import MOONCAKE_BLOCK_SIZE, TraceWorkload
from llmopt.bench.workload_spec import AnyWorkload
from llmopt.bench.workloads import JsonlWorkload, PrefixWorkload, RandomWorkload, parse_length
from llmopt.engine.config import COMMAND_DEFAULT, EngineConfig, parse_threads
from llmopt.errors import LlmoptError
from llmopt.gates import Gate
from llmopt.io import check_output_file
from llmopt.report.html import check_html_path

DEFAULT_NUM_PROMPTS = 100


class BenchConfig(BaseModel):
    """Everything one `llmopt bench` invocation does. Exactly one of `http` and `engine` is set."""

    model_config = ConfigDict(extra="forbid")

    http: HttpTargetConfig | None = Field(None, description="Benchmark this OpenAI-compatible server.")
    engine: EngineConfig | None = Field(None, description="Benchmark our engine in-process (offline).")
    tokenizer: str | None = Field(None, description="HTTP: model whose tokenizer builds prompts (alias or dir).")
    workload: AnyWorkload
    loads: list[LoadPattern] = Field(min_length=1, description="One run per load level, in order.")
    sweep: SweepKind | None = Field(None, description="What varies between loads; None for a single level.")
    warmup: int = Field(1, ge=0, description="Requests sent (and discarded) before each load level.")
    slo: Slo | None = None
    knee_metric: LatencyMetric = "ttft"
    knee_percentile: Percentile = "p99"
    scenario: Scenario | None = Field(None, description="Offline only: compare engine variants.")
    gates: list[Gate] = Field(default_factory=list)
    rounds: int = Field(1, ge=1, description="Each load level this many times, pooled; rounds kept.")
    ab: AbConfig | None = Field(None, description="Compare two targets in interleaved rounds.")
    ab_gates: list[BenchGate] = Field(default_factory=list, description="--ab: gates, with optional @CONFIDENCE.")
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    html_path: str | None = Field(None, description="A self-contained HTML report (llmopt.bench.html_report).")
    progress: bool = True
    keep_samples: bool = Field(True, description="Keep per-request latencies in the JSON (plots, re-analysis).")
    temperature: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        if (self.http is None) == (self.engine is None):
            raise LlmoptError("benchmark exactly one target: a server (--url) or the in-process engine (--model)")
        if self.scenario is not None and self.engine is None:
            raise LlmoptError("--scenario compares engine variants in-process; use --model, not --url")
        from llmopt.bench.gate_metrics import validate_gates

        validate_gates(self.gates, scenario=self.scenario is not None)
        validate_gates([g.gate for g in self.ab_gates], scenario=True)
        for g in self.ab_gates:
            if g.confidence is not None and not g.gate.metric.endswith("_ratio"):
                raise LlmoptError(f"gate {g.expression!r}: a confidence (@) applies to a ratio (METRIC_ratio), "
                                  "whose interval the rounds give")
        return self


class BenchOptions(BaseModel):
    """The command line as data: every `llmopt bench` flag, unvalidated strings included."""

    model_config = ConfigDict(extra="forbid")

    # target
    url: str | None = None
    endpoint: Literal["auto", "completions", "chat"] | None = None
    served_model: str | None = None
    api_key: str | None = None
    request_timeout: float | None = None
    send_ignore_eos: Literal["auto", "always", "never"] | None = None  # None = auto
    tokenizer: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: str | None = None
    kv_cache_dtype: Literal["auto", "int8", "fp8"] | None = None
    prefix_caching: bool = True
    threads: str | None = None  # N or auto (llmopt.engine.threads); None: the engine's default
    # workload
    workload: Literal["random", "prefix", "jsonl", "trace", "conversation"] | None = None
    input_len: str = "512"
    output_len: str = "128"
    num_prompts: int | None = None
    prefix_len: int = 512
    num_prefixes: int = 4
    suffix_len: str = "64"
    dataset: str | None = None
    seed: int = 0
    ignore_eos: bool = True
    users: int | None = None
    turns: int | None = None
    message_len: str | None = None
    think_time: str | None = None
    trace_block_size: int | None = None
    trace_time_unit: Literal["ms", "s"] | None = None
    trace_time_scale: float | None = None
    # load
    concurrency: str | None = None
    request_rate: str | None = None
    burstiness: float = 1.0
    warmup: int = 1
    # analysis and output
    slo: str | None = None
    knee_metric: LatencyMetric = "ttft"
    knee_percentile: Percentile = "p99"
    scenario: str | None = None
    static_batch_size: int | None = None
    gates: list[str] = Field(default_factory=list)
    rounds: int | None = None
    ab: list[str] = Field(default_factory=list)
    ab_order: AbOrder | None = None
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    html_path: str | None = None
    progress: bool = True

    def build(self) -> BenchConfig:
        """Check the combination of flags and produce the typed plan (one-line LlmoptError otherwise)."""
        ab = self._ab()
        offline = self.url is None if ab is None else ab.sides[0].http is None
        scenario = self._scenario()
        loads, sweep = self._loads(scenario)
        gates = parse_bench_gates(self.gates)
        if ab is None and (conf := [g for g in gates if g.confidence is not None]):
            raise LlmoptError(f"gate {conf[0].expression!r}: a confidence (@) needs the rounds of --ab")
        rounds = self._rounds(ab)
        return BenchConfig(
            http=(ab.sides[0].http if ab else self._http()) if not offline else None,
            engine=(ab.sides[0].engine if ab else self._engine()) if offline else None,
            tokenizer=self._tokenizer(offline),
            workload=self._workload(offline, scenario),
            loads=loads,
            sweep=sweep,
            warmup=self._non_negative("--warmup", self.warmup),
            slo=parse_slo(self.slo) if self.slo is not None else None,
            knee_metric=self.knee_metric,
            knee_percentile=self.knee_percentile,
            scenario=scenario,
            gates=[g.gate for g in gates] if ab is None else [],
            rounds=rounds,
            ab=ab,
            ab_gates=gates if ab is not None else [],
            json_path=self._output("--json", self.json_path),
            markdown_path=self._output("--markdown", self.markdown_path),
            plot_path=self._output("--plot", self._plot_path()),
            html_path=str(check_html_path(self.html_path)) if self.html_path is not None else None,
            progress=self.progress,
        )

    # ------------------------------------------------------------------------------------- target

    def _engine_flags(self) -> list[str]:
        flags = {"--model": self.model, "--dtype": self.dtype, "--device": self.device,
                 "--max-num-seqs": self.max_num_seqs, "--max-num-batched-tokens": self.max_num_batched_tokens,
                 "--kv-cache-memory": self.kv_cache_memory, "--kv-cache-dtype": self.kv_cache_dtype,
                 "--no-prefix-caching": None if self.prefix_caching else True, "--threads": self.threads}
        return [f for f, v in flags.items() if v is not None]

    def _http(self) -> HttpTargetConfig:
        if engine_flags := self._engine_flags():
            raise LlmoptError(f"{', '.join(engine_flags)} configure the in-process engine and cannot be used "
                              "with --url")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise LlmoptError(f"--request-timeout must be positive, got {self.request_timeout:g}")
        assert self.url is not None
        timeout = {} if self.request_timeout is None else {"timeout_s": self.request_timeout}
        send = {"always": True, "never": False}.get(self.send_ignore_eos or "auto")
        return HttpTargetConfig(base_url=self.url, model=self.served_model, endpoint=self.endpoint or "auto",
                                api_key=self.api_key, send_ignore_eos=send, **timeout)

    def _engine(self) -> EngineConfig:
        http_flags = {"--endpoint": self.endpoint, "--served-model": self.served_model, "--api-key": self.api_key,
                      "--request-timeout": self.request_timeout, "--send-ignore-eos": self.send_ignore_eos}
        if used := [f for f, v in http_flags.items() if v is not None]:
            raise LlmoptError(f"{', '.join(used)} apply to a server (--url), not to the in-process engine")
        args: dict[str, object] = {"model": self.model, "enable_prefix_caching": self.prefix_caching}
        for name in ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                     "kv_cache_dtype"):
            if (v := getattr(self, name)) is not None:
                args[name] = v
        try:
            args["num_threads"] = COMMAND_DEFAULT if self.threads is None else parse_threads(self.threads)
        except ValueError as e:
            raise LlmoptError(f"--{e}") from None
        for flag, n in (("--max-num-seqs", self.max_num_seqs), ("--max-num-batched-tokens",
                                                                self.max_num_batched_tokens)):
            if n is not None and n < 1:
                raise LlmoptError(f"{flag} must be at least 1, got {n}")
        return EngineConfig(**args)

    def _ab(self) -> AbConfig | None:
        """The two sides of `--ab A --ab B`, each the command line's target with its overrides."""
        if not self.ab:
            if self.ab_order is not None:
                raise LlmoptError("--ab-order applies to --ab")
            return None
        if len(self.ab) != 2:
            raise LlmoptError(f"--ab takes two sides (--ab A --ab B), got {len(self.ab)}")
        if self.scenario is not None:
            raise LlmoptError("--ab and --scenario both compare; use one")
        if self.plot_path is not None:
            raise LlmoptError("--plot is not written for --ab; use --json and --markdown")
        sides = []
        for i, text in enumerate(self.ab):
            upd = parse_side(text)
            name = upd.pop("name", "AB"[i])
            opts = self.model_copy(update={**upd, "ab": []})
            http, engine = (opts._http(), None) if opts.url is not None else (None, opts._engine())
            sides.append(AbSide(name=name, spec=text, http=http, engine=engine))
        if self.rounds is not None and self.rounds < 2:
            raise LlmoptError(f"--ab needs at least 2 rounds for an interval, got --rounds {self.rounds}")
        return AbConfig(sides=sides, rounds=self.rounds or DEFAULT_AB_ROUNDS, order=self.ab_order or "abba")

    def _rounds(self, ab: AbConfig | None) -> int:
        if ab is not None:
            return 1  # the A/B runner does its own rounds
        if self.rounds is not None and self.rounds < 1:
            raise LlmoptError(f"--rounds must be at least 1, got {self.rounds}")
        return self.rounds or 1

    def _tokenizer(self, offline: bool) -> str | None:
        if offline and self.tokenizer is not None:
            raise LlmoptError("--tokenizer is for --url; the in-process engine uses its own tokenizer")
        return self.tokenizer

    # ----------------------------------------------------------------------------------- workload

    def _workload(self, offline: bool, scenario: Scenario | None) -> AnyWorkload:
        kind = self.workload or ("jsonl" if self.dataset else scenario.default_workload if scenario else "random")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise LlmoptError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        self._check_kind_flags(kind)
        if kind == "trace":
            if self.dataset is None:
                raise LlmoptError("--workload trace needs --dataset TRACE.jsonl")
            if not Path(self.dataset).is_file():
                raise LlmoptError(f"trace file {self.dataset} not found")
            if self.trace_block_size is not None and self.trace_block_size < 1:
                raise LlmoptError(f"--trace-block-size must be at least 1, got {self.trace_block_size}")
            if self.trace_time_scale is not None and not (self.trace_time_scale > 0 and
                                                          math.isfinite(self.trace_time_scale)):
                raise LlmoptError(f"--trace-time-scale must be positive, got {self.trace_time_scale:g}")
            return TraceWorkload(path=self.dataset, block_size=self.trace_block_size or MOONCAKE_BLOCK_SIZE,
                                 time_unit=self.trace_time_unit or "ms", time_scale=self.trace_time_scale or 1.0,
                                 num_requests=self.num_prompts, seed=self.seed, token_ids=offline,
                                 ignore_eos=self.ignore_eos)
        if kind == "conversation":
            if self.num_prompts is not None:
                raise LlmoptError("the conversation workload sends --users x --turns requests; drop --num-prompts")
            for flag, n in (("--users", self.users), ("--turns", self.turns)):
                if n is not None and n < 1:
                    raise LlmoptError(f"{flag} must be at least 1, got {n}")
            return ConversationWorkload(num_users=self.users or 4, turns=self.turns or 4, first_len=self.input_len,
                                        message_len=self.message_len or "64", output_len=self.output_len,
                                        think_time=self.think_time or "1", seed=self.seed, token_ids=offline,
                                        ignore_eos=self.ignore_eos)
        if kind == "jsonl":
            if self.dataset is None:
                raise LlmoptError("--workload jsonl needs --dataset FILE.jsonl")
            if not Path(self.dataset).is_file():
                raise LlmoptError(f"dataset file {self.dataset} not found")
            out = parse_length(self.output_len)
            return JsonlWorkload(path=self.dataset, num_requests=self.num_prompts, ignore_eos=self.ignore_eos,
                                 default_max_tokens=out.lo if out.kind == "fixed" else None)
        if self.dataset is not None:
            raise LlmoptError(f"--dataset is for --workload jsonl, not {kind}")
        n = self.num_prompts or DEFAULT_NUM_PROMPTS
        # offline, prompts are token ids: exact lengths, and no decode/encode round trip to distort them
        if kind == "prefix":
            if self.prefix_len < 1 or self.num_prefixes < 1:
                raise LlmoptError("--prefix-len and --num-prefixes must be at least 1")
            return PrefixWorkload(num_requests=n, num_prefixes=self.num_prefixes, prefix_len=self.prefix_len,
                                  suffix_len=self.suffix_len, output_len=self.output_len, seed=self.seed,
                                  token_ids=offline, ignore_eos=self.ignore_eos)
        return RandomWorkload(num_requests=n, input_len=self.input_len, output_len=self.output_len, seed=self.seed,
                              token_ids=offline, ignore_eos=self.ignore_eos)

    def _check_kind_flags(self, kind: str) -> None:
        """Flags of one workload kind are an error with another (a silent no-op would mislead)."""
        own = {"conversation": {"--users": self.users, "--turns": self.turns, "--message-len": self.message_len,
                                "--think-time": self.think_time},
               "trace": {"--trace-block-size": self.trace_block_size, "--trace-time-unit": self.trace_time_unit,
                         "--trace-time-scale": self.trace_time_scale}}
        for other, flags in own.items():
            if other != kind and (used := [f for f, v in flags.items() if v is not None]):
                raise LlmoptError(f"{', '.join(used)} apply to --workload {other}, not {kind}")

    # --------------------------------------------------------------------------------------- load

    def _scenario(self) -> Scenario | None:
        if self.scenario is None:
            if self.static_batch_size is not None:
                raise LlmoptError("--static-batch-size only applies to --scenario static-vs-continuous")
            return None
        if self.url is not None:
            raise LlmoptError("--scenario compares engine variants in-process; use --model, not --url")
        if self.static_batch_size is not None and self.static_batch_size < 1:
            raise LlmoptError(f"--static-batch-size must be at least 1, got {self.static_batch_size}")
        if self.static_batch_size is not None and self.scenario != "static-vs-continuous":
            raise LlmoptError("--static-batch-size only applies to --scenario static-vs-continuous")
        params = ScenarioParams(static_batch_size=self.static_batch_size or DEFAULT_STATIC_BATCH_SIZE)
        return build_scenario(self.scenario, params)

    def _loads(self, scenario: Scenario | None) -> tuple[list[LoadPattern], SweepKind | None]:
        if not self.burstiness > 0 or not math.isfinite(self.burstiness):
            raise LlmoptError(f"--burstiness must be a positive number, got {self.burstiness:g}")
        static = scenario is not None and any(v.batching == "static" for v in scenario.variants)
        if static and self.workload == "conversation":
            raise LlmoptError("static batches need independent requests; conversations wait for their answers "
                              "(use --scenario prefix-cache or speculation)")
        if static:
            if self.request_rate is not None:
                raise LlmoptError("static batching admits fixed batches, not arrivals: drop --request-rate")
            if self.concurrency is not None and self.static_batch_size is not None:
                raise LlmoptError("give --static-batch-size or a --concurrency sweep (each level is then the "
                                  "static batch size), not both")
            text = self.concurrency or str(self.static_batch_size or DEFAULT_STATIC_BATCH_SIZE)
            loads = parse_sweep(text, "concurrency", seed=self.seed)
            if any(p.concurrency is None for p in loads):
                raise LlmoptError("static batching needs a finite batch size: drop 'inf' from --concurrency")
            return loads, "concurrency" if len(loads) > 1 else None
        kind = self.workload or ("jsonl" if self.dataset else "random")
        if kind == "conversation" and (self.request_rate is not None or self.concurrency is not None):
            raise LlmoptError("the conversation workload's load is its users (--users); drop --concurrency and "
                              "--request-rate")
        if kind == "trace" and self.request_rate is not None:
            raise LlmoptError("a trace brings its own arrival times; drop --request-rate (--trace-time-scale "
                              "speeds it up or slows it down)")
        if self.request_rate is not None:
            max_conc = None
            if self.concurrency is not None:
                caps = parse_sweep(self.concurrency, "concurrency")
                if len(caps) != 1:
                    raise LlmoptError("with --request-rate, --concurrency is one cap on requests in flight, "
                                      "not a sweep; sweep one or the other")
                max_conc = caps[0].concurrency
            loads = parse_sweep(self.request_rate, "request_rate", burstiness=self.burstiness, seed=self.seed,
                                max_concurrency=max_conc)
            return loads, "request_rate" if len(loads) > 1 else None
        if self.concurrency is not None:
            loads = parse_sweep(self.concurrency, "concurrency", seed=self.seed)
            return loads, "concurrency" if len(loads) > 1 else None
        return [LoadPattern(seed=self.seed)], None

    # ------------------------------------------------------------------------------------- output

    @staticmethod
    def _output(flag: str, path: str | None) -> str | None:
        """A file the results go to, checked before anything runs (`io.check_output_file`)."""
        return None if path is None else str(check_output_file(path, flag))

    def _plot_path(self) -> str | None:
        if self.plot_path is not None and not self.plot_path.lower().endswith(".png"):
            raise LlmoptError(f"--plot writes a PNG; give a file name ending in .png, not {self.plot_path!r}")
        return self.plot_path

    @staticmethod
    def _non_negative(flag: str, v: int) -> int:
        if v < 0:
            raise LlmoptError(f"{flag} must be non-negative, got {v}")
        return v
