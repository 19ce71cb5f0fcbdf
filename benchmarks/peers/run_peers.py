"""Peer comparison: llmopt serve vs llama.cpp's llama-server vs vLLM CPU, same requests, matched precision.

    make bench-peers                                     # install llama.cpp (once), then the full run
    python benchmarks/peers/run_peers.py --quick         # a short smoke run: 2 concurrencies, single, prefix
    python benchmarks/peers/run_peers.py --engines llmopt,llamacpp --precisions bf16 --rounds 3
    python benchmarks/peers/run_peers.py --render runs/peers --write-doc   # tables again from saved reports

Servers (pairs at matched precision; models from `llmopt quantize` and `install_llamacpp.sh`):
bf16: llmopt (bf16) / llama.cpp BF16 GGUF / vLLM CPU bf16; int8: llmopt W8A16 / llama.cpp Q8_0;
int4: llmopt W4A16 g32 RTN / llama.cpp Q4_0 / vLLM CPU on the same W4A16 checkpoint (compressed-tensors).

Fairness: every server gets the same threads (--threads, 2), binds loopback and runs alone (started, driven,
stopped before the next); every server gets identical `llmopt bench --url` requests (same seeds, same warm-up
before every level, ignore_eos sent to all: `--send-ignore-eos always`); the servers are started in rounds
(A B C A B C ...), and the tables show the median over rounds and the spread (half the range). Each goal is
a ratio judged with `llmopt bench --ab`'s statistics: mean over the rounds, paired by round, with the seeded
95% bootstrap interval, met by its point and *shown* when the interval clears the target. A cell whose
server produced fewer output tokens than another on the same requests is flagged.

Outputs in --out (default runs/peers): reports/<server>/r<round>-<job>.json (llmopt bench reports), logs/,
results.md (the tables), results.json (rows, medians, bandwidth, versions), peers.png (output tok/s vs p99
TTFT of the mixed workload per server). --write-doc puts results.md into docs/BENCHMARKS.md ("Peers").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

import peers_plan as pp  # noqa: E402
import peers_servers as ps  # noqa: E402

DOC = ROOT / "docs/BENCHMARKS.md"
DRAM_MIB = 2048  # a buffer well past the 480 MiB L3 of the machine this was written on: DRAM bandwidth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--quick", action="store_true", help="short smoke run: concurrencies 2,8, fewer requests")
    ap.add_argument("--concurrency", help="mixed-workload sweep, e.g. 1,2,4,8,16,32 (default: full or --quick's)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 2)")
    ap.add_argument("--warmup", type=int, help="requests discarded before every level, for every server (default 2)")
    ap.add_argument("--mixed-per-slot", type=int, help="mixed requests per level = max(min, this x concurrency)")
    ap.add_argument("--single-prompts", type=int, help="single-stream requests (256 tokens each)")
    ap.add_argument("--prefix-prompts", type=int, help="shared-prefix requests")
    ap.add_argument("--workloads", default="mixed,single,prefix")
    ap.add_argument("--shape", choices=SHAPES, default=SHAPES[0],
                    help="smollm2-135m (the embedded model), 1b (a 1.2B Llama shape) or llama3-8b (16 GB; 45 GB of disk with "
                         "its GGUFs and our checkpoints), each written once into .peers/shapes")
    ap.add_argument("--engines", default=",".join(pp.ENGINES))
    ap.add_argument("--precisions", default=",".join(pp.PRECISIONS))
    ap.add_argument("--servers", help=f"explicit server list: {','.join(pp.SERVERS)}")
    ap.add_argument("--threads", type=int, default=2, help="threads of every server (default 2)")
    ap.add_argument("--lm-head", choices=("int8",),
                    help="llmopt's W8A16/W4A16 checkpoints quantize the head too (llama.cpp's Q8_0/Q4_0 store theirs "
                         "in Q8_0/Q6_K)")
    ap.add_argument("--out", default=str(ROOT / "runs/peers"))
    ap.add_argument("--render", metavar="DIR", help="no run: rebuild the tables from DIR/results.json")
    ap.add_argument("--write-doc", action="store_true", help="write the tables into docs/BENCHMARKS.md (Peers)")
    ap.add_argument("--note", action="append", default=[], help="a line added under the tables (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to become ready")
    return ap.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> pp.Sizes:
    base = pp.QUICK if args.quick else pp.FULL
    conc = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
    return pp.with_sizes(base, concurrencies=conc, rounds=args.rounds, warmup=args.warmup,
                         mixed_per_slot=args.mixed_per_slot, single_prompts=args.single_prompts,
                         prefix_prompts=args.prefix_prompts)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ------------------------------------------------------------------------------------------ models


# the embedded model (cache-resident), the 1.2B Llama shape (DRAM-bound), the Llama-3-8B shape (what people deploy)
SHAPES = ("smollm2-135m", "1b", "llama3-8b")


def shape_models(shape: str) -> tuple[Path, dict[str, Path]]:
    """(the bf16 HF folder, llama.cpp's GGUF per type) of a shape. The 1B and 8B shapes are written once into
    .peers/shapes/SHAPE by big_model.py's writer (seeded random weights, 2.3 / 16.1 GB) and converted and
    quantized by llama.cpp's own tools next to it (BF16, Q8_0, Q4_0: 4.3 / 29 GB more)."""
    if shape == "smollm2-135m":
        return ps.hf_dir(), ps.gguf_models()
    sys.path.insert(0, str(HERE.parent))
    import big_model

    work = ROOT / ".peers/shapes" / shape
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        print(f"writing the {shape} checkpoint into {hf}", file=sys.stderr, flush=True)
        big_model.write_checkpoint(shape, hf)
    ggufs = {q: work / f"{shape}-{q}.gguf" for q in ("bf16", "q8_0", "q4_0")}
    if not ggufs["bf16"].is_file():
        subprocess.run([str(big_model.LLAMACPP_PY), str(ps.LLAMACPP / "bin/convert_hf_to_gguf.py"), str(hf),
                        "--outtype", "bf16", "--outfile", str(ggufs["bf16"])], check=True)
    for q in ("q8_0", "q4_0"):
        if not ggufs[q].is_file():
            subprocess.run([str(ps.LLAMACPP / "bin/llama-quantize"), str(ggufs["bf16"]), str(ggufs[q]), q.upper()],
                           check=True)
    return hf, ggufs


def server_models(names: list[str], shape: str = "smollm2-135m", lm_head: str | None = None) -> dict[str, str]:
    """name -> the model path each server loads (quantizing ours once, into .peers/llmopt-models; with
    `lm_head`, llmopt's quantized checkpoints round the head too, in folders of their own)."""
    hf_path, ggufs = shape_models(shape)
    hf = str(hf_path)
    ours = ROOT / ".peers/llmopt-models"
    head = f"-head-{lm_head}" if lm_head else ""
    out: dict[str, str] = {}
    for n in names:
        if n in ("llmopt-bf16", "vllm-bf16"):
            out[n] = hf
        elif n == "llmopt-w8a16":
            out[n] = str(ps.quantized_checkpoint(ours / f"{shape}-w8a16{head}", "w8a16", model=hf, lm_head=lm_head))
        elif n == "llmopt-w4a16":
            out[n] = str(ps.quantized_checkpoint(ours / f"{shape}-w4a16-g32{head}", "w4a16", group_size=32, model=hf,
                                                 lm_head=lm_head))
        elif n == "vllm-w4a16":
            out[n] = str(ps.quantized_checkpoint(ours / f"{shape}-w4a16-g32", "w4a16", group_size=32, model=hf))
        else:
            gguf = ggufs[n.split("-", 1)[1]]
            if not gguf.is_file():
                raise SystemExit(f"error: {gguf} missing: run benchmarks/peers/install_llamacpp.sh first")
            out[n] = str(gguf)
    return out


def weight_bytes(models: dict[str, str]) -> dict[str, int]:
    """name -> weight bytes one decode step reads (from the tensors each server loads)."""
    out = {}
    for name, path in models.items():
        try:
            tensors = ps.tensor_bytes_gguf(Path(path)) if path.endswith(".gguf") else ps.tensor_bytes_dir(Path(path))
        except Exception as e:  # noqa: BLE001 - a missing reader only loses this column
            print(f"warning: tensor sizes of {path}: {e}", file=sys.stderr)
            continue
        out[name] = pp.bytes_read_per_token(tensors)
    return out


def buffer_mib(nbytes: int) -> int:
    return max(16, round(nbytes / 2**20))


def limits_for(result: dict, sizes: pp.Sizes) -> dict[str, pp.DecodeLimit]:
    """The decode limit of every server: its weights + mean KV per token over the read bandwidth measured on a
    buffer of its weights' size (this CPU's L3 is large enough that a small model's working set can stay in it,
    so a DRAM-sized buffer would understate what decode can reach)."""
    bw = result.get("bandwidth", {})
    out = {}
    for name, w in result.get("weights", {}).items():
        b = bw.get(str(buffer_mib(w)))
        if b:
            out[name] = pp.decode_limit(w, result["kv_per_position"], sizes.single_input, sizes.single_output,
                                        b["read_gbs"])
    return out


def server_for(name: str, model: str, sizes: pp.Sizes, threads: int, logs: Path, round_: int,
               timeout: float) -> ps.Server:
    engine = pp.SERVERS[name][0]
    port = ps.free_port()
    log = logs / f"{name}-r{round_}.log"
    if engine == "llmopt":
        cmd = ps.llmopt_command(model, port, max_seqs=sizes.max_concurrency)
        return ps.Server(name, cmd, ps.thread_env(threads), log, port, timeout)
    if engine == "llamacpp":
        cmd = ps.llamacpp_command(model, port, threads=threads, slots=sizes.max_concurrency,
                                  ctx_per_slot=sizes.context_per_slot)
        return ps.Server(name, cmd, ps.thread_env(threads), log, port, timeout)
    cmd = ps.vllm_command(model, port)
    return ps.Server(name, cmd, ps.vllm_env(threads), log, port, timeout, unset=("LLMOPT_CACHE",))


# --------------------------------------------------------------------------------------------- run


def bench(url: str, job: pp.Job, out: Path, log: Path) -> bool:
    cmd = [sys.executable, "-m", "llmopt", "bench", "--url", url, "--send-ignore-eos", "always", *job.args,
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    with log.open("a") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=3600, check=False)
    return p.returncode == 0 and out.is_file()


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    try:
        from llmopt._version import __version__

        out["llmopt"] = __version__
    except ImportError:
        pass
    info = ps.LLAMACPP / "BUILD_INFO"
    if info.is_file():
        out["llama.cpp"] = info.read_text().strip()
    vpy = ROOT / ".peers/vllm/bin/python"
    if vpy.is_file():
        p = subprocess.run([str(vpy), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           check=False)
        out["vllm"] = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else "?"
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def run(args: argparse.Namespace, sizes: pp.Sizes, names: list[str], out: Path) -> dict:
    workloads = _csv(args.workloads)
    job_list = pp.jobs(sizes, workloads)
    models = server_models(names, args.shape, args.lm_head)
    weights = weight_bytes(models)
    bw = {}
    for mib in sorted({buffer_mib(w) for w in weights.values()} | {DRAM_MIB}):
        print(f"measuring memory bandwidth: {mib} MiB, {args.threads} threads", file=sys.stderr, flush=True)
        bw[str(mib)] = ps.measure_bandwidth(args.threads, mib)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[pp.Row] = []
    events: list[dict] = []
    failed_start: dict[str, str] = {}
    for round_, name in pp.plan(names, sizes.rounds):
        if name in failed_start:
            continue
        load0 = os.getloadavg()
        t0 = time.monotonic()
        print(f"[round {round_}] {name}: starting ({models[name]})", file=sys.stderr, flush=True)
        try:
            srv = server_for(name, models[name], sizes, args.threads, logs, round_, args.start_timeout)
            with srv:
                print(f"[round {round_}] {name}: ready in {srv.ready_s:.1f} s at {srv.url}", file=sys.stderr, flush=True)
                for job in job_list:
                    rep = out / "reports" / name / f"r{round_}-{job.key}.json"
                    rep.parent.mkdir(parents=True, exist_ok=True)
                    ok = bench(srv.url, job, rep, logs / f"bench-{name}-r{round_}.log")
                    if ok:
                        new = pp.load_rows(rep, name, job.workload, round_)
                        rows += new
                        r = new[0]
                        print(f"  {job.key}: {r.output_throughput:.1f} tok/s, TTFT p50 {r.ttft_p50_ms or 0:.0f} ms, "
                              f"p99 {r.ttft_p99_ms or 0:.0f} ms, TPOT p50 {r.tpot_p50_ms or 0:.1f} ms, "
                              f"{r.completed} ok {r.failed} failed", file=sys.stderr, flush=True)
                    else:
                        print(f"  {job.key}: bench FAILED (log {logs / f'bench-{name}-r{round_}.log'})", file=sys.stderr)
                        if srv.proc.poll() is not None:
                            raise RuntimeError(f"{name} died during {job.key}:\n{ps.tail(srv.log)}")
        except RuntimeError as e:
            print(f"[round {round_}] {name}: {e}", file=sys.stderr, flush=True)
            failed_start[name] = str(e).splitlines()[0]
            continue
        events.append({"round": round_, "server": name, "seconds": round(time.monotonic() - t0, 1),
                       "ready_s": round(srv.ready_s or 0, 1), "loadavg_before": load0, "loadavg_after": os.getloadavg()})
    return {"rows": [dataclasses.asdict(r) for r in rows], "events": events, "failed_start": failed_start,
            "models": models, "weights": weights, "kv_per_position": pp.kv_bytes_per_position(ps.model_config(shape_models(args.shape)[0])),
            "bandwidth": bw, "servers": names,
            "sizes": dataclasses.asdict(sizes), "jobs": [dataclasses.asdict(j) for j in job_list]}


# --------------------------------------------------------------------------------------------- render


def plot(cells: dict, servers: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in servers:
        pts = sorted((k[2], c.get("ttft_p99_ms").median, c.get("output_throughput").median) for k, c in cells.items()
                     if k[0] == s and k[1] == "mixed" and c.get("ttft_p99_ms") and c.get("output_throughput"))
        if not pts:
            continue
        style = {"llmopt": "-o", "llamacpp": "--s", "vllm": ":^"}[pp.SERVERS[s][0]]
        ax.plot([p[1] for p in pts], [p[2] for p in pts], style, label=s)
        for c, x, y in pts:
            ax.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("p99 TTFT (ms, log)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Mixed workload (prompts 32-512, outputs 16-256): throughput vs p99 TTFT")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def render(result: dict, out: Path, command: str, notes: list[str], write_doc: bool) -> str:
    sizes = pp.Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["sizes"].items()})
    rows = [pp.Row(**r) for r in result["rows"]]
    cells = pp.aggregate(rows)
    servers = result["servers"]
    limits = limits_for(result, sizes)
    labels = {s: pp.SERVERS[s][2] for s in servers}
    env_notes = [f"Command: `{command}`",
                 f"Machine: {result.get('cpu', cpu_name())}, {result['threads']} threads per server; memory read "
                 f"bandwidth (torch sum, {result['threads']} threads, best of 7) "
                 + ", ".join(f"{b['read_gbs']:.1f} GB/s on {m} MiB" for m, b in sorted(result["bandwidth"].items(),
                                                                                   key=lambda kv: int(kv[0])))
                 + f"; load average {_loads(result)} while measuring.",
                 f"{sizes.rounds} rounds, servers interleaved; warm-up {sizes.warmup} requests before every level; "
                 f"mixed: prompts {sizes.mixed_input}, outputs {sizes.mixed_output} tokens; single: "
                 f"{sizes.single_input}-token prompt, {sizes.single_output} out (tok/s = 1000 / TPOT p50); prefix: "
                 f"{sizes.num_prefixes} prefixes of {sizes.prefix_len} tokens + {sizes.prefix_suffix}-token suffix, "
                 f"{sizes.prefix_output} out, concurrency {sizes.prefix_concurrency}.",
                 "Versions: " + "; ".join(f"{k} {v}" for k, v in result.get("versions", {}).items()
                                          if k != "llama.cpp") + "; llama.cpp "
                 + result.get("versions", {}).get("llama.cpp", "?").replace("\n", "; ")]
    for s, why in result.get("failed_start", {}).items():
        env_notes.append(f"{s} did not run: {why}")
    md = pp.markdown(cells, servers, sizes, labels, limits, [*env_notes, *notes])
    (out / "results.md").write_text(md)
    if plot(cells, servers, out / "peers.png"):
        md_png = out / "peers.png"
        print(f"wrote {out / 'results.md'} and {md_png}", file=sys.stderr)
    if write_doc:
        DOC.write_text(pp.replace_doc_section(DOC.read_text(), md))
        print(f"wrote the Peers section of {DOC}", file=sys.stderr)
    return md


def _loads(result: dict) -> str:
    vals = [e["loadavg_before"][0] for e in result.get("events", [])] + \
        [e["loadavg_after"][0] for e in result.get("events", [])]
    return "?" if not vals else f"{min(vals):.1f}–{max(vals):.1f} (1-min)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # servers run in their own sessions: a SIGTERM (timeout, kill) must unwind through Server.__exit__ too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python benchmarks/peers/run_peers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.render:
        src = Path(args.render)
        result = json.loads((src / "results.json").read_text())
        print(render(result, src, result.get("command", command), args.note, args.write_doc))
        return
    sizes = sizes_from(args)
    try:
        names = pp.select_servers(_csv(args.engines), _csv(args.precisions), _csv(args.servers) if args.servers else None)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not names:
        raise SystemExit("error: no server selected")
    if any(pp.SERVERS[n][0] == "vllm" for n in names) and not (ps.VLLM_BIN / "vllm").is_file():
        raise SystemExit("error: .peers/vllm missing: run benchmarks/peers/install_vllm.sh or drop vllm from --engines")
    if any(pp.SERVERS[n][0] == "llamacpp" for n in names) and not (ps.LLAMACPP / "bin/llama-server").exists():
        raise SystemExit("error: .peers/llama.cpp missing: run benchmarks/peers/install_llamacpp.sh or drop llamacpp "
                         "from --engines")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    result = run(args, sizes, names, out)
    result |= {"command": command, "started": started, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
               "threads": args.threads, "cpu": cpu_name(), "versions": versions()}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(render(result, out, command, args.note, args.write_doc))


if __name__ == "__main__":
    main()
