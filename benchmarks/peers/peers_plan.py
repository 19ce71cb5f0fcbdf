"""The pure half of the peer benchmark (`run_peers.py`): what runs, in which order, and what the reports say.

Nothing here starts a process or touches the network, so CI tests all of it (tests/bench/test_peers_harness.py):

* `Sizes` / `plan`: the workloads (mixed, single-stream decode, shared prefix) as `llmopt bench` arguments,
  and the interleaved order of server starts (A B C A B C ...).
* `rows_from_report`: one `llmopt bench --json` report -> `Row`s; `aggregate`: median and spread over rounds.
* `tensor_bytes_*`, `decode_limit`: bytes read per decoded token (weights + KV) over memory bandwidth.
* `goals`, `markdown`: the verdicts and the Markdown tables; `replace_doc_section`: docs/BENCHMARKS.md.
  A goal is a ratio between two servers, judged as `llmopt bench --ab` judges one (llmopt.bench.ab_stats):
  mean over the interleaved rounds, paired by round, with a seeded bootstrap interval; it is met when the
  interval's bound clears the target, "not shown" when the interval straddles it.
"""

from __future__ import annotations

import json
import math
import statistics
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmopt.bench.ab_stats import RatioEstimate, ratio_interval

# ------------------------------------------------------------------------------------------ servers


@dataclass(frozen=True)
class ServerSpec:
    """One server to benchmark: an engine serving one checkpoint at one precision."""

    name: str        # e.g. llmopt-bf16, llamacpp-q4_0, vllm-w4a16
    engine: str      # llmopt | llamacpp | vllm
    precision: str   # bf16 | int8 | int4: the matched-precision group
    model: str       # what the engine loads: an HF folder, a checkpoint dir or a .gguf
    label: str = ""  # what is served, for the table: "bf16", "W8A16 (per-channel)", "Q8_0", ...


ENGINES = ("llmopt", "llamacpp", "vllm")
PRECISIONS = ("bf16", "int8", "int4")

# name -> (engine, precision, label); the models are filled in by run_peers.py (paths on this machine)
SERVERS: dict[str, tuple[str, str, str]] = {
    "llmopt-bf16": ("llmopt", "bf16", "bf16"),
    "llamacpp-bf16": ("llamacpp", "bf16", "BF16 GGUF"),
    "vllm-bf16": ("vllm", "bf16", "bf16"),
    "llmopt-w8a16": ("llmopt", "int8", "W8A16 per-channel RTN"),
    "llamacpp-q8_0": ("llamacpp", "int8", "Q8_0 (g32)"),
    "llmopt-w4a16": ("llmopt", "int4", "W4A16 g32 RTN"),
    "llamacpp-q4_0": ("llamacpp", "int4", "Q4_0 (g32)"),
    "vllm-w4a16": ("vllm", "int4", "W4A16 g32 RTN (compressed-tensors)"),
}


def select_servers(engines: Iterable[str] = ENGINES, precisions: Iterable[str] = PRECISIONS,
                   names: Iterable[str] | None = None) -> list[str]:
    """Server names in table order, filtered by engine and precision (or given by name)."""
    engines, precisions = set(engines), set(precisions)
    if bad := (engines - set(ENGINES)) | (precisions - set(PRECISIONS)):
        raise ValueError(f"unknown engine/precision {', '.join(sorted(bad))}")
    if names is not None:
        names = list(names)
        if bad := [n for n in names if n not in SERVERS]:
            raise ValueError(f"unknown server {', '.join(bad)}; choose from {', '.join(SERVERS)}")
        return [n for n in SERVERS if n in names]
    return [n for n, (e, p, _) in SERVERS.items() if e in engines and p in precisions]


# ----------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Sizes:
    """How big the run is. `FULL` is the issue's sweep; `QUICK` a smoke run of a few minutes per server."""

    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mixed_per_slot: int = 4          # requests per level = max(mixed_min, mixed_per_slot * concurrency)
    mixed_min: int = 16
    mixed_input: str = "32:512"
    mixed_output: str = "16:256"
    single_prompts: int = 4
    single_input: int = 32
    single_output: int = 256
    prefix_prompts: int = 32
    prefix_concurrency: int = 4
    prefix_len: int = 512
    num_prefixes: int = 4
    prefix_suffix: int = 32
    prefix_output: int = 32
    rounds: int = 2
    warmup: int = 2
    seed: int = 0

    @property
    def max_concurrency(self) -> int:
        return max((*self.concurrencies, self.prefix_concurrency, 1))

    @property
    def context_per_slot(self) -> int:
        """Tokens one request can hold (prompt + output), rounded up to 256: sizes llama.cpp's -c."""
        hi = max(_hi(self.mixed_input) + _hi(self.mixed_output), self.single_input + self.single_output,
                 self.prefix_len + self.prefix_suffix + self.prefix_output + 8)  # +8: the prefix/suffix newline
        return 256 * math.ceil(hi / 256)


FULL = Sizes()
QUICK = Sizes(concurrencies=(2, 8), mixed_per_slot=1, mixed_min=8, single_prompts=2, prefix_prompts=12,
              prefix_concurrency=4, warmup=1)


def _hi(length: str) -> int:
    """Upper bound of an `llmopt bench` length: N, LO:HI or normal:MEAN,STD (mean + 4 std)."""
    s = str(length)
    if s.startswith("normal:"):
        mean, std = (float(x) for x in s.split(":", 1)[1].split(","))
        return int(math.ceil(mean + 4 * std))
    return int(s.split(":")[-1])


@dataclass(frozen=True)
class Job:
    """One `llmopt bench --url` invocation: a workload at one load level."""

    workload: str  # mixed | single | prefix
    concurrency: int
    args: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.workload}-c{self.concurrency}"


def jobs(sizes: Sizes, workloads: Sequence[str] = ("mixed", "single", "prefix")) -> list[Job]:
    """The bench invocations every server gets, identical for all (same requests, seeds and warm-up).

    Each job draws its prompts from its own seed (`sizes.seed` + its index): levels that reused one seed
    sent the same prompts again, so every level after the first measured prompt-cache hits (llama.cpp
    reuses a whole cached prompt, we reuse whole KV blocks), not the prefill a mixed workload is about.
    The prefix workload shares prefixes on purpose, within its own level."""
    common = ("--endpoint", "completions", "--ignore-eos", "--warmup", str(sizes.warmup), "--no-progress")
    out: list[tuple[str, int, tuple[str, ...]]] = []
    if "mixed" in workloads:
        for c in sizes.concurrencies:
            n = max(sizes.mixed_min, sizes.mixed_per_slot * c)
            out.append(("mixed", c, ("--workload", "random", "--input-len", sizes.mixed_input, "--output-len",
                                     sizes.mixed_output, "--num-prompts", str(n), "--concurrency", str(c))))
    if "single" in workloads:
        out.append(("single", 1, ("--workload", "random", "--input-len", str(sizes.single_input), "--output-len",
                                  str(sizes.single_output), "--num-prompts", str(sizes.single_prompts),
                                  "--concurrency", "1")))
    if "prefix" in workloads:
        c = sizes.prefix_concurrency
        out.append(("prefix", c, ("--workload", "prefix", "--prefix-len", str(sizes.prefix_len), "--num-prefixes",
                                  str(sizes.num_prefixes), "--suffix-len", str(sizes.prefix_suffix), "--output-len",
                                  str(sizes.prefix_output), "--num-prompts", str(sizes.prefix_prompts),
                                  "--concurrency", str(c))))
    return [Job(w, c, (*args, *common, "--seed", str(sizes.seed + i))) for i, (w, c, args) in enumerate(out)]


def plan(servers: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in start order: every server once per round, rounds interleaved (A B C A B C).

    Odd rounds run the servers in reverse (A B C C B A ...) would also cancel drift; plain repetition is what
    the issue asks for and keeps every server's neighbours the same in each round.
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    return [(r, s) for r in range(1, rounds + 1) for s in servers]


# --------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """One load level of one report: the numbers the tables use."""

    server: str
    workload: str
    concurrency: int
    round: int
    completed: int
    failed: int
    output_tokens: int
    output_throughput: float   # tok/s
    request_throughput: float  # req/s
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    owned_by: str | None = None

    @property
    def decode_tps(self) -> float | None:
        """Single-stream decode speed: 1000 / median TPOT (excludes the first token, i.e. prefill)."""
        return None if not self.tpot_p50_ms else 1000.0 / self.tpot_p50_ms


def rows_from_report(report: dict[str, Any], server: str, workload: str, round_: int) -> list[Row]:
    """Rows of an `llmopt bench --json` report (the dict as written: BenchReport's JSON)."""
    owned = (report.get("target") or {}).get("server")
    rows = []
    for run in report["runs"]:
        conc = run.get("concurrency")
        rows.append(Row(
            server=server, workload=workload, concurrency=-1 if conc is None else int(conc), round=round_,
            completed=int(run["completed"]), failed=int(run.get("failed", 0)),
            output_tokens=int(run["total_output_tokens"]),
            output_throughput=float(run["output_throughput"]), request_throughput=float(run["request_throughput"]),
            ttft_p50_ms=(run.get("ttft_ms") or {}).get("p50"), ttft_p99_ms=(run.get("ttft_ms") or {}).get("p99"),
            tpot_p50_ms=(run.get("tpot_ms") or {}).get("p50"), itl_p50_ms=(run.get("itl_ms") or {}).get("p50"),
            owned_by=owned))
    return rows


def load_rows(path: Path, server: str, workload: str, round_: int) -> list[Row]:
    return rows_from_report(json.loads(Path(path).read_text()), server, workload, round_)


@dataclass(frozen=True)
class Stat:
    """Median over rounds and the spread: half the range, relative to the median; `by_round` keeps each
    round's value, so that two servers' rounds can be paired for a ratio interval."""

    median: float
    lo: float
    hi: float
    n: int
    by_round: tuple[tuple[int, float], ...] = ()

    @property
    def spread_pct(self) -> float:
        return 0.0 if self.median == 0 else 100.0 * (self.hi - self.lo) / (2 * abs(self.median))

    def fmt(self, digits: int = 1, spread: bool = True) -> str:
        s = f"{self.median:.{digits}f}"
        return f"{s} ±{self.spread_pct:.0f}%" if spread and self.n > 1 else s


def stat(values: Iterable[float | None], rounds: Iterable[int] | None = None) -> Stat | None:
    values = list(values)
    rounds = list(range(1, len(values) + 1)) if rounds is None else list(rounds)
    kept = [(r, float(v)) for r, v in zip(rounds, values, strict=True) if v is not None and math.isfinite(float(v))]
    if not kept:
        return None
    vals = [v for _, v in kept]
    return Stat(statistics.median(vals), min(vals), max(vals), len(vals), tuple(kept))


METRICS = ("output_throughput", "request_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
           "decode_tps")


@dataclass
class Cell:
    """One (server, workload, concurrency) over its rounds."""

    server: str
    workload: str
    concurrency: int
    stats: dict[str, Stat | None]
    rounds: int
    failed: int
    short: bool = False  # generated fewer tokens than another server on the same requests (EOS honoured?)
    output_tokens: list[int] = field(default_factory=list)

    def get(self, metric: str) -> Stat | None:
        return self.stats.get(metric)


def aggregate(rows: Sequence[Row]) -> dict[tuple[str, str, int], Cell]:
    """Group rows by (server, workload, concurrency): median and spread of every metric over the rounds.

    A cell is `short` when some round produced fewer output tokens than the most any server produced on the
    same requests (same workload, level and seed): a server that stopped at EOS despite ignore_eos would
    otherwise look faster per request.
    """
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.server, r.workload, r.concurrency), []).append(r)
    most: dict[tuple[str, int], int] = {}
    for r in rows:
        if r.failed == 0:
            k = (r.workload, r.concurrency)
            most[k] = max(most.get(k, 0), r.output_tokens)
    cells = {}
    for key, rs in groups.items():
        stats = {m: stat((getattr(r, m) for r in rs), (r.round for r in rs)) for m in METRICS}
        toks = [r.output_tokens for r in rs]
        short = any(r.failed == 0 and r.output_tokens < most.get((r.workload, r.concurrency), 0) for r in rs)
        cells[key] = Cell(*key, stats=stats, rounds=len(rs), failed=sum(r.failed for r in rs), short=short,
                          output_tokens=toks)
    return cells


# ------------------------------------------------------------------------------ physical decode limit

_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT = {"F64", "F32", "F16", "BF16"}
EMBED_NAMES = ("model.embed_tokens.weight", "token_embd.weight", "transformer.wte.weight")
HEAD_NAMES = ("lm_head.weight", "output.weight")


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def tensor_bytes_safetensors(paths: Iterable[Path], float_bytes: int | None = 2) -> dict[str, int]:
    """name -> bytes of every tensor in safetensors files; float tensors counted at `float_bytes` each (the
    serving dtype: 2 for bf16, so an fp32 checkpoint served in bf16 counts half its file size), None: as stored.
    """
    out: dict[str, int] = {}
    for p in paths:
        for name, info in safetensors_header(Path(p)).items():
            numel = math.prod(info["shape"])
            size = float_bytes if float_bytes is not None and info["dtype"] in _FLOAT else _ST_BYTES[info["dtype"]]
            out[name] = numel * size
    return out


def bytes_read_per_token(tensors: dict[str, int]) -> int:
    """Weight bytes one decode step reads: every tensor, except that an embedding table is only gathered (one row)
    when the model has a separate output head (float, or quantized: `lm_head.weight_packed` and its scales); with
    tied embeddings the table *is* the head and is read whole."""
    total = sum(tensors.values())
    has_head = any(t.startswith(HEAD_NAMES) for t in tensors)  # lm_head.weight, or .weight_packed and scales
    if has_head:
        embed = tuple(n.rsplit(".", 1)[0] + "." for n in EMBED_NAMES)
        total -= sum(v for t, v in tensors.items() if t.startswith(embed))
    return total


def kv_bytes_per_position(config: dict[str, Any], elem_bytes: int = 2) -> int:
    """K and V bytes one cached position holds over all layers (HF config.json keys)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * elem_bytes


@dataclass(frozen=True)
class DecodeLimit:
    weight_bytes: int
    kv_bytes: int          # KV read per token at the mean context of the single-stream run
    bandwidth_gbs: float   # GB/s (1e9)

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 / self.bytes_per_token

    def share(self, measured_tps: float | None) -> float | None:
        return None if measured_tps is None else measured_tps / self.tokens_per_s


def decode_limit(weight_bytes: int, kv_per_position: int, prompt_len: int, output_len: int,
                 bandwidth_gbs: float) -> DecodeLimit:
    """Upper bound on single-stream decode speed: each token reads all weights and the KV so far; over the run
    the context grows from prompt_len to prompt_len + output_len, so the mean KV read is at its midpoint."""
    mean_ctx = prompt_len + output_len / 2
    return DecodeLimit(weight_bytes, int(kv_per_position * mean_ctx), bandwidth_gbs)


# -------------------------------------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    text: str
    measured: str
    met: bool | None  # None: not measured (a server missing)
    shown: bool | None = None  # met with the interval's bound past the target (True), or only by its point


def ratio(cells: dict, num: str, den: str, workload: str, conc: int, metric: str) -> RatioEstimate | None:
    """num / den for one metric: mean over the rounds both servers ran, paired by round, with the interval that
    `llmopt bench --ab` reports (servers are started in interleaved rounds, so a slow round slows both)."""
    a, b = cells.get((den, workload, conc)), cells.get((num, workload, conc))
    sa, sb = (a.get(metric) if a else None), (b.get(metric) if b else None)
    if sa is None or sb is None:
        return None
    da, db = dict(sa.by_round), dict(sb.by_round)
    common = sorted(set(da) & set(db))
    if not common:
        return None
    est = ratio_interval([da[r] for r in common], [db[r] for r in common], paired=True)
    return None if est.ratio is None else est


def _judge(est: RatioEstimate, need: float, at_least: bool) -> tuple[bool, bool]:
    """(met by the point estimate, shown by the interval: its low bound >= need, or its high bound <= need)."""
    if at_least:
        return est.ratio >= need, est.low is not None and est.low >= need
    return est.ratio <= need, est.high is not None and est.high <= need


def _txt(est: RatioEstimate) -> str:
    if est.low is None or est.high is None:
        return f"{est.ratio:.2f}x ({est.rounds} round{'s' if est.rounds != 1 else ''}, no interval)"
    return f"{est.ratio:.2f}x [{est.low:.2f}, {est.high:.2f}]"


def goals(cells: dict[tuple[str, str, int], Cell], sizes: Sizes) -> list[Goal]:
    """The issue's targets at every matched precision measured, each a ratio of means over paired rounds with
    its 95% bootstrap interval (`ratio`): met when the point reaches the target, shown when the interval does."""
    out: list[Goal] = []
    pairs = [("bf16", "llmopt-bf16", "llamacpp-bf16", "vllm-bf16"), ("int8", "llmopt-w8a16", "llamacpp-q8_0", None),
             ("int4", "llmopt-w4a16", "llamacpp-q4_0", "vllm-w4a16")]

    def goal(text: str, checks: list[tuple[str, RatioEstimate | None, float, bool]]) -> Goal:
        parts, mets, showns = [], [], []
        for label, est, need, at_least in checks:
            if est is None:
                continue
            met, shown = _judge(est, need, at_least)
            parts.append(f"{label}{_txt(est)}")
            mets.append(met)
            showns.append(shown)
        if not mets:
            return Goal(text, "not measured", None)
        return Goal(text, "; ".join(parts), all(mets), all(showns))

    for prec, ours, lcpp, vllm in pairs:
        for peer, need, name in ((lcpp, 2.0, "llama.cpp"), (vllm, 1.5, "vLLM CPU")):
            if peer is None:
                continue
            checks = []
            for c in sizes.concurrencies:
                tput = ratio(cells, ours, peer, "mixed", c, "output_throughput")
                if tput is None:
                    continue
                checks.append((f"c{c} ", tput, need, True))
                if peer == lcpp:
                    checks.append((f"c{c} p99 TTFT ", ratio(cells, ours, peer, "mixed", c, "ttft_p99_ms"), 1.0, False))
            ttft = " with p99 TTFT no worse" if peer == lcpp else ""
            out.append(goal(f"{prec} mixed: output tok/s >= {need:g}x {name}{ttft}", checks))
        need = 1.2 if prec == "bf16" else 1.0
        out.append(goal(f"{prec} single-stream decode >= {need:g}x llama.cpp",
                        [("", ratio(cells, ours, lcpp, "single", 1, "decode_tps"), need, True)]))
        c = sizes.prefix_concurrency
        out.append(goal(f"{prec} shared-prefix TTFT p50 <= llama.cpp's",
                        [("", ratio(cells, ours, lcpp, "prefix", c, "ttft_p50_ms"), 1.0, False)]))
    return out


# ----------------------------------------------------------------------------------------- markdown


def _rate(tokens_per_s: float) -> str:
    """A decode limit: whole tokens a second, a decimal below 10 (an 8B model's 2.0 is not "2")."""
    return f"{tokens_per_s:.1f}" if tokens_per_s < 10 else f"{tokens_per_s:.0f}"


def _fmt(s: Stat | None, digits: int = 1, spread: bool = True) -> str:
    return "—" if s is None else s.fmt(digits, spread)


def markdown(cells: dict[tuple[str, str, int], Cell], servers: Sequence[str], sizes: Sizes,
             labels: dict[str, str] | None = None, limits: dict[str, DecodeLimit] | None = None,
             notes: Sequence[str] = ()) -> str:
    """The results as Markdown: a summary table (one row per server), the concurrency sweep, the goals."""
    labels = labels or {}
    limits = limits or {}
    servers = [s for s in servers if any(k[0] == s for k in cells)]
    peak = {}
    for s in servers:
        levels = [(c.get("output_throughput").median, k[2]) for k, c in cells.items()
                  if k[0] == s and k[1] == "mixed" and c.get("output_throughput")]
        peak[s] = max(levels) if levels else None
    lines = ["| server | serves | mixed peak tok/s (at c) | its p99 TTFT ms | single-stream tok/s | share of "
             "bandwidth limit | prefix TTFT p50 ms |", "|---|---|---|---|---|---|---|"]
    for s in servers:
        p = peak[s]
        mixed = cells.get((s, "mixed", p[1])) if p else None
        single = cells.get((s, "single", 1))
        prefix = cells.get((s, "prefix", sizes.prefix_concurrency))
        dec = single.get("decode_tps") if single else None
        lim = limits.get(s)
        share = lim.share(dec.median) if lim and dec else None
        mine = [c for k, c in cells.items() if k[0] == s]
        flags = " ⚠short" if any(c.short for c in mine) else ""
        if failed := sum(c.failed for c in mine):
            flags += f" ⚠{failed} failed"
        lines.append(f"| {s}{flags} | {labels.get(s, '')} | "
                     f"{_fmt(mixed.get('output_throughput')) + f' (c{p[1]})' if mixed else '—'} | "
                     f"{_fmt(mixed.get('ttft_p99_ms'), 0) if mixed else '—'} | {_fmt(dec)} | "
                     f"{'—' if share is None else f'{100 * share:.0f}% of {_rate(lim.tokens_per_s)}'} | "
                     f"{_fmt(prefix.get('ttft_p50_ms'), 0) if prefix else '—'} |")
    concs = sorted({k[2] for k in cells if k[1] == "mixed"})
    if concs:
        lines += ["", "Mixed workload, output tok/s / p99 TTFT ms (median ± half-range over rounds) by concurrency:", "",
                  "| server | " + " | ".join(f"c{c}" for c in concs) + " |", "|---|" + "---|" * len(concs)]
        for s in servers:
            row = []
            for c in concs:
                cell = cells.get((s, "mixed", c))
                row.append("—" if cell is None else
                           f"{_fmt(cell.get('output_throughput'))} / {_fmt(cell.get('ttft_p99_ms'), 0, False)}")
            lines.append(f"| {s} | " + " | ".join(row) + " |")
    if limits:
        lines += ["", "Physical limit of single-stream decode: weight bytes + mean KV bytes read per decoded token "
                  "over the memory read bandwidth measured on a buffer of the weights' size:", "",
                  "| server | weights MB/token | KV MB/token | read GB/s | limit tok/s | measured tok/s | share |",
                  "|---|---|---|---|---|---|---|"]
        for s in servers:
            if (lim := limits.get(s)) is not None:
                single = cells.get((s, "single", 1))
                dec = single.get("decode_tps") if single else None
                share = lim.share(dec.median) if dec else None
                lines.append(f"| {s} | {lim.weight_bytes / 1e6:.1f} | {lim.kv_bytes / 1e6:.2f} | {lim.bandwidth_gbs:.1f} | "
                             f"{_rate(lim.tokens_per_s)} | {_fmt(dec)} | {'—' if share is None else f'{100 * share:.0f}%'} |")
    gl = goals(cells, sizes)
    if any(g.met is not None for g in gl):
        lines += ["", "Goals: ours / the peer's, mean over paired interleaved rounds with the 95% bootstrap interval "
                  "of `llmopt bench --ab` (expanded for few rounds); *met* by the point, *shown* when the interval "
                  "clears the target too.", "", "| goal | measured | met |", "|---|---|---|"]
        for g in gl:
            if g.met is not None:
                verdict = ("yes" if g.shown else "yes (not shown)") if g.met else "**no**"
                lines.append(f"| {g.text} | {g.measured} | {verdict} |")
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- peers:begin (written by benchmarks/peers/run_peers.py --write-doc) -->", "<!-- peers:end -->"


def replace_doc_section(doc: str, block: str, heading: str = "## Peers", markers: tuple[str, str] = (BEGIN, END)) -> str:
    """`doc` with the text between the `markers` replaced by `block`; the markers are appended to the
    `heading` section (created at the end when missing) the first time. Nothing else in the file changes."""
    begin, end_marker = markers
    body = f"{begin}\n{block.rstrip()}\n{end_marker}"
    if begin in doc and end_marker in doc:
        head, rest = doc.split(begin, 1)
        return head + body + rest.split(end_marker, 1)[1]
    lines = doc.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.strip() == heading or ln.startswith(heading + " ")), None)
    if start is None:
        return doc.rstrip("\n") + f"\n\n{heading}\n\n{body}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return "\n".join(lines[:end] + ["", body] + lines[end:]).rstrip("\n") + "\n"


def with_sizes(base: Sizes, **overrides: Any) -> Sizes:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
