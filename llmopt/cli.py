"""The `llmopt` command line. Thin by design: each command parses options and calls one library function."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console

from llmopt._version import __version__
from llmopt.errors import LlmoptError

app = typer.Typer(
    name="llmopt",
    help="Make LLMs cheaper and faster to run without making them dumber.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
THREADS_DEFAULT = "auto"  # llmopt.engine.config.COMMAND_DEFAULT, without importing pydantic for --help
FIXED_THREADS_HELP = ("CPU threads for the whole run (default: torch's, the cores or OMP_NUM_THREADS). A fixed "
                      "count: GPTQ rounds differently with another, so the report records it.")
THREADS_HELP = ("CPU threads: N, or auto (the cores other processes leave free, followed while running; "
                "OpenMP threads on a core another process holds make decode several times slower).")
err_console = Console(stderr=True)
DECODE_STEP_HELP = ("native: a bf16 CPU decode step runs all its layers in one native call (llmopt.step); eager: "
                    "layer by layer in Python (same kernels, same tokens; for A/B runs).")


def _version(value: bool) -> None:
    if value:
        console.print(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """llmopt: memory plans, calibration, quantization, eval gates, serving and benchmarks."""


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command("vram-plan")
def vram_plan(
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir, config.json or .gguf."),
    weight_dtype: str = typer.Option("auto", help="auto|fp32|fp16|bf16|fp8|int8|int4"),
    group_size: Optional[int] = typer.Option(
        None, help="Group size of int4/int8 scales; -1 per channel. Default: -1 for int8, 128 for int4 (64 or 32 "
        "when 128 does not divide the model, else -1)."),
    kv_dtype: str = typer.Option("auto", help="auto|fp32|fp16|bf16|fp8|int8"),
    seq_len: int = typer.Option(2048, help="Tokens per sequence (prompt + output)."),
    batch: int = typer.Option(1, help="Concurrent sequences."),
    gpu_memory: str = typer.Option("24GiB", help="Memory per GPU: 24GiB, 24GB, 24G or bytes."),
    num_gpus: int = typer.Option(1, help="GPUs available; adds a tensor/pipeline/data-parallel plan."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The memory bill for weights, KV cache and activations, and how many requests fit."""
    from llmopt.models import resolve_model
    from llmopt.planning.vram import VramPlanOptions, plan_vram, render_vram_plan
    from llmopt.units import parse_bytes

    resolved = resolve_model(model)
    opts = VramPlanOptions(
        weight_dtype=weight_dtype,
        group_size=group_size,
        kv_dtype=kv_dtype,
        seq_len=seq_len,
        batch=batch,
        gpu_memory_bytes=parse_bytes(gpu_memory),
        num_gpus=num_gpus,
    )
    plan = plan_vram(resolved.spec, opts, model_name=resolved.source)
    if as_json:
        _print_json(plan.to_json())
    else:
        render_vram_plan(plan, console)


@app.command()
def generate(
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir or .gguf."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    chat: bool = typer.Option(False, help="Apply the model's chat template (one user turn)."),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    dtype: str = typer.Option("auto", help="auto|float32|bfloat16|float16"),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    kv_cache_dtype: str = typer.Option("auto", help="auto|int8|fp8 (e4m3)"),
    threads: str = typer.Option(THREADS_DEFAULT, help=THREADS_HELP),
    decode_step: str = typer.Option("native", help=DECODE_STEP_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate one completion through the llmopt engine, streaming it to the terminal."""
    from llmopt.engine.llm import LLM, stream_text
    from llmopt.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, max_num_seqs=1, num_threads=threads,
              decode_step=decode_step)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    final = None
    for piece in stream_text(llm, prompt, params, chat=chat):
        if isinstance(piece, str):
            if not as_json:
                console.out(piece, end="", highlight=False)
        else:
            final = piece
    out = final.outputs[0]
    m = final.metrics
    n = len(out.token_ids)
    decode_s = (m.finished_time - m.first_token_time) if n > 1 else 0.0
    summary = {"text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": len(final.prompt_token_ids),
               "output_tokens": n, "ttft_ms": round(m.ttft * 1000, 1),
               "decode_tok_s": round((n - 1) / decode_s, 1) if decode_s > 0 else None,
               "dtype": str(llm.engine.dtype).replace("torch.", ""), "device": str(llm.engine.device),
               "threads": llm.engine.threads.threads, "decode_step": llm.engine.decode_step_kind}
    if as_json:
        _print_json(summary)
    else:
        console.out("")
        err_console.print(f"[dim]{n} tokens · finish {out.finish_reason} · TTFT {summary['ttft_ms']} ms · "
                          f"decode {summary['decode_tok_s']} tok/s · {summary['dtype']} on {summary['device']} · "
                          f"{llm.engine.threads.describe()} · {summary['decode_step']} decode step[/]")


@app.command()
def bench(
    files: Optional[list[str]] = typer.Argument(None, help="With --compare: the JSON reports to compare.",
                                                show_default=False),
    url: Optional[str] = typer.Option(None, help="Benchmark an OpenAI-compatible server, e.g. http://HOST:PORT.",
                                      rich_help_panel="Target"),
    endpoint: Optional[str] = typer.Option(None, help="--url: completions|chat (default auto: chat for message "
                                           "prompts).", rich_help_panel="Target"),
    served_model: Optional[str] = typer.Option(None, help="--url: model name to send (default: /v1/models).",
                                               rich_help_panel="Target"),
    api_key: Optional[str] = typer.Option(None, help="--url: bearer token.", rich_help_panel="Target"),
    request_timeout: Optional[float] = typer.Option(None, help="--url: seconds per request (default 600).",
                                                    rich_help_panel="Target"),
    send_ignore_eos: Optional[str] = typer.Option(
        None, help="--url: send the ignore_eos extension: auto (only to llmopt servers; strict servers reject "
        "unknown fields) | always (vLLM and llama.cpp accept it: the same work for every server) | never.",
        rich_help_panel="Target"),
    tokenizer: Optional[str] = typer.Option(None, help="--url: model whose tokenizer builds the prompts "
                                            "(default: the embedded model).", rich_help_panel="Target"),
    model: Optional[str] = typer.Option(None, help="Benchmark our engine in-process on MODEL (alias, HF dir, "
                                        ".gguf); the default target.", rich_help_panel="Target"),
    dtype: Optional[str] = typer.Option(None, help="auto|float32|bfloat16|float16", rich_help_panel="Engine"),
    device: Optional[str] = typer.Option(None, help="auto|cpu|cuda", rich_help_panel="Engine"),
    max_num_seqs: Optional[int] = typer.Option(None, help="Engine: sequences per step (default 64).",
                                               rich_help_panel="Engine"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="Engine: tokens per step (default 2048).",
                                                         rich_help_panel="Engine"),
    kv_cache_memory: Optional[str] = typer.Option(None, help="Engine: KV pool size, e.g. 2GiB.",
                                                  rich_help_panel="Engine"),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="Engine: auto|int8|fp8", rich_help_panel="Engine"),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                        help="Engine: automatic prefix caching.", rich_help_panel="Engine"),
    threads: Optional[str] = typer.Option(None, help=f"Engine: {THREADS_HELP} (default {THREADS_DEFAULT}).",
                                          rich_help_panel="Engine"),
    workload: Optional[str] = typer.Option(None, help="random|prefix|jsonl|trace|conversation (default random; "
                                           "jsonl with --dataset; prefix for --scenario prefix-cache).",
                                           rich_help_panel="Workload"),
    input_len: str = typer.Option("512", help="Prompt tokens: N, LO:HI or normal:MEAN,STD.",
                                  rich_help_panel="Workload"),
    output_len: str = typer.Option("128", help="Output tokens (max_tokens): N, LO:HI or normal:MEAN,STD.",
                                   rich_help_panel="Workload"),
    num_prompts: Optional[int] = typer.Option(None, help="Requests per load level (default 100; jsonl: the "
                                              "file).", rich_help_panel="Workload"),
    prefix_len: int = typer.Option(512, help="prefix: shared prefix tokens.", rich_help_panel="Workload"),
    num_prefixes: int = typer.Option(4, help="prefix: distinct prefixes.", rich_help_panel="Workload"),
    suffix_len: str = typer.Option("64", help="prefix: unique suffix tokens per request.",
                                   rich_help_panel="Workload"),
    dataset: Optional[str] = typer.Option(None, help="jsonl: one {prompt|messages, max_tokens} per line; trace: "
                                          "one {timestamp, input_length, output_length, hash_ids} per line.",
                                          rich_help_panel="Workload"),
    users: Optional[int] = typer.Option(None, help="conversation: concurrent users (default 4).",
                                        rich_help_panel="Workload"),
    turns: Optional[int] = typer.Option(None, help="conversation: turns per user (default 4); the first message "
                                        "is --input-len tokens, answers --output-len.", rich_help_panel="Workload"),
    message_len: Optional[str] = typer.Option(None, help="conversation: tokens of each later message (default "
                                              "64).", rich_help_panel="Workload"),
    think_time: Optional[str] = typer.Option(None, help="conversation: seconds between an answer and the next "
                                             "message, S or LO:HI (default 1).", rich_help_panel="Workload"),
    trace_block_size: Optional[int] = typer.Option(None, help="trace: tokens per hash id (default 512, "
                                                   "Mooncake's).", rich_help_panel="Workload"),
    trace_time_unit: Optional[str] = typer.Option(None, help="trace: ms|s of the timestamps (default ms).",
                                                  rich_help_panel="Workload"),
    trace_time_scale: Optional[float] = typer.Option(None, help="trace: multiply arrival offsets (0.5: twice "
                                                     "as fast).", rich_help_panel="Workload"),
    seed: int = typer.Option(0, help="Seed of prompts, lengths and arrivals.", rich_help_panel="Workload"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Generate exactly max_tokens per request.", rich_help_panel="Workload"),
    concurrency: Optional[str] = typer.Option(None, help="Max requests in flight; a sweep: 1,2,4,8 (inf: no "
                                              "cap).", rich_help_panel="Load"),
    request_rate: Optional[str] = typer.Option(None, help="Arrivals per second; a sweep: 1,2,4,inf.",
                                               rich_help_panel="Load"),
    burstiness: float = typer.Option(1.0, help="Gamma shape of arrivals: 1 Poisson, <1 burstier.",
                                     rich_help_panel="Load"),
    warmup: int = typer.Option(1, help="Requests sent and discarded before each load level.",
                                rich_help_panel="Load"),
    slo: Optional[str] = typer.Option(None, help="Per-request SLO for goodput and the knee, e.g. "
                                      "ttft=1000ms,tpot=50ms.", rich_help_panel="Analysis"),
    knee_metric: str = typer.Option("ttft", help="Latency of the knee: ttft|tpot|itl|e2el.",
                                    rich_help_panel="Analysis"),
    knee_percentile: str = typer.Option("p99", help="mean|p50|p90|p99", rich_help_panel="Analysis"),
    scenario: Optional[str] = typer.Option(None, help="In-process comparison: static-vs-continuous | "
                                           "prefix-cache | speculation.", rich_help_panel="Analysis"),
    static_batch_size: Optional[int] = typer.Option(None, help="static-vs-continuous: batch size = slots "
                                                    "(default 8).", rich_help_panel="Analysis"),
    gate: Optional[list[str]] = typer.Option(None, "--gate", help="Exit 1 unless e.g. \"output_throughput>=150\" "
                                             "or \"ttft_p99_ms<=1000\" holds (repeatable); with --ab also "
                                             "\"output_throughput_ratio>=0.95@95\" (the 95% interval's bound).",
                                             rich_help_panel="Analysis"),
    ab: Optional[list[str]] = typer.Option(None, "--ab", help="A/B in interleaved rounds: --ab A --ab B, each a "
                                           "URL, a model, or KEY=VALUE,... over the target flags (url, model, "
                                           "max-num-seqs, dtype, prefix-caching, name, ...).",
                                           rich_help_panel="Analysis"),
    rounds: Optional[int] = typer.Option(None, help="Run each level this many times, kept per round for "
                                         "intervals (--ab: default 6).", rich_help_panel="Analysis"),
    ab_order: Optional[str] = typer.Option(None, help="--ab: abba (default: A B, B A, ... cancels drift) | "
                                           "abab.", rich_help_panel="Analysis"),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report as JSON.",
                                            rich_help_panel="Output"),
    markdown_path: Optional[str] = typer.Option(None, "--markdown", help="Write the report as Markdown.",
                                                rich_help_panel="Output"),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write throughput-vs-latency plots (PNG).",
                                            rich_help_panel="Output"),
    html_path: Optional[str] = typer.Option(None, "--html", help="Write a self-contained HTML report: latency "
                                            "CDFs, the throughput-latency curve and its knee, gates, A/B ratio "
                                            "intervals (inline SVG).", rich_help_panel="Output"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress bars.",
                                  rich_help_panel="Output"),
    compare: bool = typer.Option(False, "--compare", help="Compare JSON reports given as arguments (ratios vs "
                                 "the first); no benchmark runs.", rich_help_panel="Output"),
) -> None:
    """Measure TTFT, TPOT, ITL, throughput and goodput of a server or the in-process engine; find the knee."""
    from llmopt.bench.config import BenchOptions
    from llmopt.bench.runner import BenchInterrupted, run_bench, show_comparison
    from llmopt.errors import GateFailed

    if compare or files:
        if not compare:
            raise LlmoptError(f"unexpected argument {files[0]!r}: report files go with --compare")
        show_comparison(files or [], console)
        return
    cfg = BenchOptions(
        url=url, endpoint=endpoint, served_model=served_model, api_key=api_key, request_timeout=request_timeout,
        send_ignore_eos=send_ignore_eos, tokenizer=tokenizer, model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
        kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching, threads=threads, workload=workload,
        input_len=input_len,
        output_len=output_len, num_prompts=num_prompts, prefix_len=prefix_len, num_prefixes=num_prefixes,
        suffix_len=suffix_len, dataset=dataset, seed=seed, ignore_eos=ignore_eos, users=users, turns=turns,
        message_len=message_len, think_time=think_time, trace_block_size=trace_block_size,
        trace_time_unit=trace_time_unit, trace_time_scale=trace_time_scale, concurrency=concurrency,
        request_rate=request_rate, burstiness=burstiness, warmup=warmup, slo=slo, knee_metric=knee_metric,
        knee_percentile=knee_percentile, scenario=scenario, static_batch_size=static_batch_size, gates=gate or [],
        rounds=rounds, ab=ab or [], ab_order=ab_order,
        json_path=json_path, markdown_path=markdown_path, plot_path=plot_path, html_path=html_path,
        progress=progress,
    ).build()
    try:
        outcome = run_bench(cfg, console)
    except KeyboardInterrupt:
        raise BenchInterrupted("interrupted before any load level finished") from None
    if outcome.interrupted:  # partial results are printed and written by now
        raise BenchInterrupted("interrupted; the partial results are above")
    if outcome.gate_failure:
        raise GateFailed(outcome.gate_failure)


@app.command()
def serve(
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir or .gguf."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server (use --api-key)."),
    port: int = typer.Option(8000, min=0, max=65535),
    served_model_name: Optional[str] = typer.Option(None, help="Model name in the API; default: MODEL as given."),
    dtype: str = typer.Option("auto", help="auto|float32|bfloat16|float16"),
    device: str = typer.Option("auto", help="auto|cpu|cuda|cuda:N"),
    max_num_seqs: Optional[int] = typer.Option(None, min=1, help="Sequences per batch (default 64)."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, min=1, help="Token budget of one engine step (default 2048)."),
    max_model_len: Optional[int] = typer.Option(None, min=2, help="Tokens per sequence (prompt + output)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV pool size: 2GiB, 512MiB or bytes."),
    kv_cache_dtype: str = typer.Option("auto", help="auto|int8|fp8 (e4m3)"),
    kv_cache_scales: str = typer.Option("checkpoint", "--kv-cache-scales",
                                        help="checkpoint|dynamic: run a checkpoint's calibrated KV scales (what vLLM "
                                        "reads), or scale each token and head by its own absmax (less or equal damage, measured)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable the prefix cache."),
    threads: str = typer.Option(THREADS_DEFAULT, help=THREADS_HELP),
    enforce_eager: bool = typer.Option(False, "--enforce-eager",
                                       help="Plain eager torch on CPU: no compiled bf16/fp16 prefill kernels, "
                                       "no oneDNN-packed bf16/fp16 weights and none of our C kernels."),
    decode_step: str = typer.Option("native", help=DECODE_STEP_HELP),
    speculative: Optional[str] = typer.Option(None, help="Speculative decoding: ngram (prompt lookup), "
                                              "layer_skip (self-draft) or draft (--draft-model); turned off "
                                              "while degraded."),
    num_speculative_tokens: int = typer.Option(4, min=1, max=16, help="Draft tokens per step (k)."),
    draft_model: Optional[str] = typer.Option(None, help="--speculative draft: the draft model (same tokenizer), "
                                              "e.g. a W4A16 copy of MODEL from llmopt quantize."),
    api_key: list[str] = typer.Option([], "--api-key", help="Require 'Authorization: Bearer KEY' (repeatable)."),
    api_key_priority: list[str] = typer.Option(
        [], "--api-key-priority", help="KEY=PRIO: the key's priority class, default and ceiling (repeatable)."),
    max_waiting: int = typer.Option(256, min=1, help="Requests waiting beyond what the engine can start at once; beyond: 429."),
    max_queued_tokens: int = typer.Option(262144, min=1, help="Their prompt tokens; beyond: 429."),
    request_timeout: float = typer.Option(630.0, min=0.001, help="Server-side deadline per request, seconds."),
    drain_timeout: float = typer.Option(30.0, min=0, help="On SIGTERM, seconds in-flight requests may finish."),
    scheduling_policy: str = typer.Option("priority", help="priority|fcfs (fcfs refuses the priority field)."),
    priority_aging: float = typer.Option(10.0, min=0.001, help="Seconds of waiting that raise a request one class."),
    degrade_waiting: Optional[int] = typer.Option(
        None, min=1, help="At this many waiting requests admit only priority >= --degrade-min-priority."),
    degrade_min_priority: int = typer.Option(1),
    max_body: str = typer.Option("4MiB", help="Largest request body; beyond: 413."),
    warmup: bool = typer.Option(True, help="Run warm-up requests before /health turns 200."),
    semantic_cache: str = typer.Option(
        "off", help="off|exact|similar: answer repeated greedy prompts from memory (similar: cosine >= 0.95)."),
    semantic_cache_ttl: float = typer.Option(300.0, min=0.001, help="Seconds a cached answer stays valid."),
    log_level: str = typer.Option("info", help="critical|error|warning|info|debug"),
    engine: str = typer.Option("llmopt", help="llmopt|vllm: vllm prints (--dry-run) or runs `vllm serve`."),
    tensor_parallel_size: Optional[int] = typer.Option(None, min=1, help="--engine vllm; default: memory plan."),
    pipeline_parallel_size: Optional[int] = typer.Option(None, min=1, help="--engine vllm; default: memory plan."),
    gpu_memory: str = typer.Option("24GiB", help="--engine vllm: memory per GPU for the plan."),
    num_gpus: int = typer.Option(1, min=1, help="--engine vllm: GPUs for the plan."),
    dry_run: bool = typer.Option(False, "--dry-run", help="--engine vllm: print the command, do not run it."),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (or hand it to vLLM with --engine vllm)."""
    from llmopt.units import parse_bytes

    if engine == "vllm":
        from llmopt.serve.vllm_handoff import VllmOptions, exec_vllm, vllm_handoff

        if kv_cache_scales != "checkpoint":
            raise LlmoptError("--kv-cache-scales applies to --engine llmopt (vLLM runs a checkpoint's own scales)")

        opts = VllmOptions(host=host, port=port, served_model_name=served_model_name, dtype=dtype,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype,
                           enable_prefix_caching=not no_prefix_caching, api_keys=api_key,
                           tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                           gpu_memory_bytes=parse_bytes(gpu_memory), num_gpus=num_gpus)
        cmd = vllm_handoff(model, opts, dry_run)
        for note in cmd.notes:
            err_console.print(f"# note: {note}", highlight=False, soft_wrap=True)
        if dry_run:
            sys.stdout.write(cmd.shell() + "\n")
            return
        err_console.print(f"# running: {cmd.shell()}", highlight=False, soft_wrap=True)
        sys.stderr.flush()
        exec_vllm(cmd)
    if engine != "llmopt":
        raise LlmoptError(f"unknown --engine {engine!r}; choose llmopt or vllm")
    from llmopt.engine.config import EngineConfig
    from llmopt.serve import ServerConfig, run_server

    priorities = {}
    for item in api_key_priority:
        key, sep, prio = item.rpartition("=")
        if not sep or not key or not prio.lstrip("-").isdigit():
            raise LlmoptError(f"--api-key-priority expects KEY=PRIO (an integer), got {item!r}")
        priorities[key] = int(prio)
    sizes = {k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens))
             if v is not None}
    engine_config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                                 kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                                 kv_cache_scales=kv_cache_scales,
                                 enable_prefix_caching=not no_prefix_caching, scheduling_policy=scheduling_policy,
                                 enforce_eager=enforce_eager, num_threads=threads, decode_step=decode_step,
                                 speculative=(_speculative(speculative, num_speculative_tokens, draft_model)
                                              if speculative else None),
                                 **sizes)
    config = ServerConfig(host=host, port=port, served_model_name=served_model_name, api_keys=api_key,
                          api_key_priorities=priorities, max_waiting=max_waiting, max_queued_tokens=max_queued_tokens,
                          request_timeout_s=request_timeout, drain_timeout_s=drain_timeout,
                          enable_priorities=scheduling_policy == "priority", priority_aging_s=priority_aging,
                          degrade_waiting=degrade_waiting, degrade_min_priority=degrade_min_priority,
                          max_body_bytes=parse_bytes(max_body), warmup=warmup, log_level=log_level,
                          semantic_cache=semantic_cache, semantic_cache_ttl_s=semantic_cache_ttl)
    run_server(engine_config, config, model)


def _one_flag_per_source(flag: str, given: list[str], model: str | None, extra: list[str]) -> None:
    """`FLAG A B` parses B as an extra argument (or as MODEL when none is given): say to repeat the flag."""
    from llmopt.calibrate.sources import looks_like_data

    stray = extra[0] if extra else (model if model is not None and given and looks_like_data(model) else None)
    if stray is None:
        return
    if not given:
        raise LlmoptError(f"unexpected extra argument {stray!r} (one MODEL at most)")
    raise LlmoptError(f"unexpected extra argument {stray!r}: {flag} takes one source; repeat the flag for "
                      f"several ({flag} {given[-1]} {flag} {stray})")


@app.command(context_settings={"allow_extra_args": True})
def calibrate(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir or .gguf."),
    data: list[str] = typer.Option(..., "--data", help="PATH[:WEIGHT]: text/jsonl/csv/parquet file, directory or "
                                   "datasets name; repeat to mix sources by weight."),
    num_samples: int = typer.Option(128, help="Token windows to sample."),
    seq_len: int = typer.Option(512, help="Tokens per window."),
    observer: str = typer.Option("minmax", help="minmax|ema|percentile|mse: per-tensor activation range."),
    percentile: float = typer.Option(99.9, help="Percentile for --observer percentile."),
    seed: int = typer.Option(0, help="Sampling seed (same data + seed = same windows)."),
    chat_template: bool = typer.Option(False, "--chat-template", help="Render each text as a chat user turn."),
    eval_data: list[str] = typer.Option([], "--eval-data", help="Eval files the windows must not overlap (8-grams)."),
    allow_overlap: bool = typer.Option(False, "--allow-overlap", help="Warn instead of failing on eval overlap."),
    output: str = typer.Option(..., "--output", "-o", help="CALIB_DIR to write (stats.safetensors, manifest.json)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing CALIB_DIR."),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    threads: Optional[int] = typer.Option(None, help=FIXED_THREADS_HELP),
) -> None:
    """Measure activation statistics on calibration data (for quantize --calib)."""
    from pathlib import Path

    from llmopt.calibrate import CalibrateConfig, run_calibration

    _one_flag_per_source("--data", data, model, ctx.args)
    cfg = CalibrateConfig(model=model, data=data, num_samples=num_samples, seq_len=seq_len, observer=observer,
                          percentile=percentile, seed=seed, chat_template=chat_template, eval_data=eval_data,
                          allow_overlap=allow_overlap, output=Path(output), overwrite=overwrite, device=device,
                          threads=threads)
    m = run_calibration(cfg, err_console)
    console.print(f"calibrated on {m.num_windows} windows × {m.seq_len} tokens → {output}")


@app.command(context_settings={"allow_extra_args": True})
def quantize(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, help="Alias (smollm2-135m), HF model dir or .gguf."),
    scheme: str = typer.Option(..., "--scheme", help="w8a16|w4a16|fp8|w8a8, or auto: each linear's precision "
                               "chosen under --target-bits."),
    target_bits: Optional[float] = typer.Option(None, "--target-bits", help="--scheme auto: average stored bits "
                                                "per weight of the quantized linears (scales included), e.g. 4.5."),
    candidates: Optional[str] = typer.Option(None, "--candidates", help="--scheme auto: comma list of what a "
                                             "linear may become (default w4a16-g128,w4a16-g64,w4a16-g32,w8a16,bf16)."),
    auto_tokens: Optional[int] = typer.Option(None, "--auto-tokens", help="--scheme auto: calibration tokens each "
                                              "candidate's damage is measured on (default 2048; more costs time, "
                                              "and may choose better for text unlike the calibration set)."),
    gate: list[str] = typer.Option([], "--gate", help="--scheme auto: the smallest checkpoint that passes this eval "
                                   "gate on --eval-data (e.g. ppl_increase_pct<=3); repeatable."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="--gate: held-out text (.txt, .jsonl) to "
                                            "score each budget on, against the source model."),
    eval_seq_len: int = typer.Option(512, "--eval-seq-len", help="--gate: tokens per perplexity window."),
    eval_max_tokens: Optional[int] = typer.Option(None, "--eval-max-tokens", help="--gate: only the first N "
                                                  "tokens of --eval-data."),
    method: str = typer.Option("rtn", help="rtn|gptq|awq, or auto with --scheme auto: GPTQ or AWQ per linear, "
                               "whichever the search measures less damage for."),
    group_size: Optional[int] = typer.Option(None, help="Columns per scale; -1 per channel. Default: w4a16 128 "
                                             "(64 or 32 when 128 does not divide the model), others per channel."),
    sym: bool = typer.Option(True, "--sym/--asym", help="Symmetric (no zero points) or asymmetric int weights."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order",
                                             help="GPTQ: columns by decreasing activation energy (default: on "
                                             "for --method gptq; --no-act-order is the old, worse order)."),
    static_groups: bool = typer.Option(True, "--static-groups/--no-static-groups",
                                       help="--act-order: fix group scales up front (identity g_idx); without "
                                       "them the checkpoint has a g_idx (needs --format gptq)."),
    mse: Optional[bool] = typer.Option(None, "--mse/--no-mse",
                                       help="GPTQ: pick each group's range by a shrink search of the squared error "
                                       "weighted as llama.cpp weighs it (each input's E[x^2] x sqrt(sigma^2 + w^2); "
                                       "default: on for --method gptq); "
                                       "--no-mse: min/max."),
    calib: Optional[str] = typer.Option(None, "--calib", help="CALIB_DIR from `llmopt calibrate`."),
    calib_data: list[str] = typer.Option([], "--calib-data", help="PATH[:WEIGHT] to sample calibration data from; "
                                         "repeat the flag to mix sources (--calib-data A --calib-data B)."),
    num_samples: int = typer.Option(128, help="Windows for --calib-data."),
    seq_len: int = typer.Option(512, help="Tokens per window for --calib-data."),
    ignore: list[str] = typer.Option([], "--ignore", help="REGEX over HF module names to leave unquantized "
                                     "(lm_head and embeddings always are)."),
    override: list[str] = typer.Option([], "--override", help="REGEX=SCHEME for matching modules."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="int8|fp8: calibrated KV-cache scales (fp8: "
                                    "compressed-tensors kv_cache_scheme, which vLLM loads)."),
    kv_cache_strategy: str = typer.Option("tensor", "--kv-cache-strategy", help="tensor|attn_head: --kv-cache fp8 "
                                          "with one scale per layer (every vLLM backend reads it) or one per KV "
                                          "head (closer to a dynamic cache; vLLM CUDA needs FlashAttention 3)."),
    lm_head: Optional[str] = typer.Option(None, "--lm-head", help="int8|int4|auto: the output head (a tied one: "
                                          "the embedding it shares) as int8 with a scale per row, or int4 in "
                                          "groups of 32; auto (--scheme auto): bf16, int8 or int4, chosen inside "
                                          "the budget."),
    float_dtype: str = typer.Option("bf16", "--float-dtype", help="bf16|source: how float32 tensors outside "
                                    "the layers (embedding, final norm, head) are stored; bf16 is what they run in."),
    fmt: str = typer.Option("compressed-tensors", "--format", help="gptq|compressed-tensors"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUT_DIR."),
    output: str = typer.Option(..., "--output", "-o", help="OUT_DIR to write."),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    threads: Optional[int] = typer.Option(None, help=FIXED_THREADS_HELP),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size",
                                       help="Largest safetensors shard (5GB, 500MB, 2GiB): past it the checkpoint "
                                       "is model-0000i-of-0000N.safetensors + model.safetensors.index.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a summary."),
) -> None:
    """Quantize a model (RTN, GPTQ, AWQ, SmoothQuant W8A8, FP8) into a GPTQ or compressed-tensors checkpoint."""
    from pathlib import Path

    from llmopt.quant.recipe import QuantizeConfig
    from llmopt.tune.gate_search import quantize as run_quantize

    _one_flag_per_source("--calib-data", calib_data, model, ctx.args)
    cfg = QuantizeConfig(model=model, scheme=scheme, method=method, group_size=group_size, symmetric=sym,
                         act_order=act_order, static_groups=static_groups, mse=mse,
                         calib=Path(calib) if calib else None, calib_data=calib_data,
                         num_samples=num_samples, seq_len=seq_len, ignore=ignore, override=override,
                         kv_cache=kv_cache, kv_cache_strategy=kv_cache_strategy, lm_head=lm_head,
                         float_dtype=float_dtype, format=fmt, output=Path(output),
                         overwrite=overwrite, device=device, threads=threads, max_shard_size=max_shard_size,
                         target_bits=target_bits, gate=gate,
                         auto_tokens=auto_tokens,
                         eval_data=Path(eval_data) if eval_data else None, eval_seq_len=eval_seq_len,
                         eval_max_tokens=eval_max_tokens,
                         **({"candidates": [c.strip() for c in candidates.split(",")]} if candidates else {}))
    report = run_quantize(cfg, err_console)
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        report.render(console)


@app.command("eval")
def eval_(
    model: Optional[str] = typer.Argument(None, help="Candidate: alias (smollm2-135m), HF/quantized model dir or .gguf."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Reference model to compare against."),
    ppl_data: Optional[str] = typer.Option(None, "--ppl-data", help="Text for perplexity/KL: .txt, or .jsonl/.json "
                                           "with `text` fields (joined with a blank line)."),
    seq_len: int = typer.Option(2048, help="Tokens per perplexity window."),
    stride: Optional[int] = typer.Option(None, help="Sliding windows: score only the last STRIDE tokens of each "
                                         "(default: seq-len, non-overlapping)."),
    max_tokens: Optional[int] = typer.Option(None, help="Use only the first N tokens of the eval text."),
    task: list[str] = typer.Option([], "--task", help="lm-eval task YAML (multiple_choice or generate_until); "
                                   "repeatable."),
    limit: Optional[int] = typer.Option(None, help="Only the first N documents of each task."),
    harness: str = typer.Option("llmopt", help="llmopt|lm-eval: who runs the tasks (lm-eval: transformers "
                                "model through lm-eval's HFLM, a cross-check)."),
    gate: list[str] = typer.Option([], "--gate", help="METRIC OP NUMBER, e.g. ppl_increase_pct<=5, "
                                   "top1_agreement>=0.9; on a comparison, METRIC OP NUMBER@95 reads the paired 95% "
                                   "interval's bound instead (acc_drop<=3@95: non-inferiority); repeatable."),
    dtype: str = typer.Option("auto", help="auto (each checkpoint's own, as vLLM)|float32|bfloat16|float16 for "
                              "both models."),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    kv_cache_dtype: str = typer.Option("auto", help="Candidate KV cache: auto|int8|fp8."),
    kv_cache_scales: str = typer.Option("checkpoint", "--kv-cache-scales", help="Candidate's calibrated KV scales: "
                                        "checkpoint (run them) or dynamic (per token, as `serve --kv-cache-scales`)."),
    baseline_dtype: Optional[str] = typer.Option(None, help="Baseline dtype (default: --dtype)."),
    baseline_kv_cache_dtype: str = typer.Option("auto", help="Baseline KV cache: auto|int8|fp8."),
    max_batch_tokens: Optional[int] = typer.Option(None, help="Tokens per scoring forward (default: a few windows)."),
    kl_top_k: int = typer.Option(256, help="Baseline log-probs kept per token for KL and top-1 (8 bytes each; "
                                 "KL over the top-k plus one bucket for the rest, a lower bound)."),
    report: Optional[str] = typer.Option(None, "--report", help="Write a Markdown report here (atomically)."),
    html: Optional[str] = typer.Option(None, "--html", help="Write a self-contained HTML report here (gates with "
                                       "their intervals, metrics, bisect's per-layer sensitivity; inline SVG)."),
    bisect: bool = typer.Option(False, "--bisect", help="Attribute the candidate's drop to its optimizations and "
                                "layers (needs --baseline and --ppl-data)."),
    bisect_plot: Optional[str] = typer.Option(None, "--bisect-plot", help="PNG of the per-layer sensitivity."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity, KL/top-1 vs a baseline and lm-eval task accuracy through the engine, with CI gates."""
    from llmopt.eval.command import eval_command
    from llmopt.eval.options import EvalOptions

    opts = EvalOptions(model=model, baseline=baseline, ppl_data=ppl_data, seq_len=seq_len, stride=stride,
                       max_tokens=max_tokens, tasks=task, limit=limit, harness=harness, gates=gate, dtype=dtype,
                       device=device, kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales,
                       baseline_dtype=baseline_dtype,
                       baseline_kv_cache_dtype=baseline_kv_cache_dtype, max_batch_tokens=max_batch_tokens,
                       kl_top_k=kl_top_k, report=report, html=html, bisect=bisect, bisect_plot=bisect_plot)
    eval_command(opts, as_json=as_json, console=console, err_console=err_console)


def _error(message: str) -> None:
    """One line on stderr; the message is printed literally (brackets in it are not rich markup)."""
    err_console.print("[bold red]error:[/] ", end="")
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


@app.command("run")
def run(
    recipe: str = typer.Argument(..., help="Recipe YAML (see recipes/ and docs/RECIPES.md)."),
    out: Optional[str] = typer.Option(None, "--out", help="Run directory (default: runs/RECIPE_NAME)."),
    stages: Optional[str] = typer.Option(None, "--stages", help="Only these stages, comma-separated: vram_plan, "
                                         "calibrate, quantize, eval, serve, bench."),
    set_: list[str] = typer.Option([], "--set", help="KEY.PATH=VALUE (a YAML value) applied before validation, e.g. "
                                   "quantize.scheme=w4a16; repeatable."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print which stages would run or be skipped."),
    force: bool = typer.Option(False, "--force", help="Rerun the selected stages even when their inputs are unchanged."),
    skip_gate: list[str] = typer.Option([], "--skip-gate", help="Leave out the gates on this metric (or this whole "
                                        "gate expression), named in the summary; e.g. on a random-weight stand-in. "
                                        "Repeatable."),
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as one JSON object on stdout."),
) -> None:
    """Run a recipe: memory plan, calibrate, quantize, eval, serve smoke test, bench; exit 1 when a gate fails."""
    from llmopt.recipe.command import run_command
    from llmopt.recipe.runner import RunRequest

    run_command(RunRequest(recipe=recipe, out=out, stages=stages, overrides=set_, dry_run=dry_run, force=force,
                           skip_gates=skip_gate),
                as_json=as_json, console=console, err_console=err_console)


recipe_app = typer.Typer(help="Check recipes and print their JSON Schema.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
def recipe_validate(
    recipe: str = typer.Argument(..., help="Recipe YAML."),
    set_: list[str] = typer.Option([], "--set", help="KEY.PATH=VALUE applied before validation; repeatable."),
    stages: Optional[str] = typer.Option(None, "--stages", help="Check that these stages can be selected."),
) -> None:
    """Check a recipe without running it: every problem on one line with file:line and key (exit 2)."""
    from llmopt.recipe.command import validate_command

    rc = validate_command(recipe, set_, stages, console=console, err_console=err_console)
    if rc:
        raise typer.Exit(rc)


@recipe_app.command("schema")
def recipe_schema() -> None:
    """Print the JSON Schema of a recipe (for editors and linters)."""
    from llmopt.recipe.command import schema_text

    sys.stdout.write(schema_text())


def _speculative(method: str, k: int, draft_model: str | None) -> dict:
    spec: dict = {"method": method, "num_speculative_tokens": k}
    if draft_model:
        spec["draft_model"] = draft_model
    return spec


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2 (1 for failed gates)."""
    from pydantic import ValidationError

    try:
        rc = app(standalone_mode=False)
    except LlmoptError as e:
        _error(str(e))
        sys.exit(e.exit_code)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        _error(f"invalid {loc or 'input'}: {first.get('msg')}")
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:
        # typer ships its own copy of click, so usage errors are recognised by shape, not by class
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(2)
        if type(e).__name__ == "Abort":
            err_console.print("aborted")
            sys.exit(130)
        if isinstance(getattr(e, "exit_code", None), int):  # typer.Exit / click Exit
            sys.exit(e.exit_code)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
