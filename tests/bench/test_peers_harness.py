"""The peer-comparison harness (benchmarks/peers/run_peers.py): its pure parts, and the path from
`llmopt bench --url --send-ignore-eos always` to its rows. Nothing here builds or starts llama.cpp or vLLM."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
from cli_helpers import run_bench_cli

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/peers"))

import peers_plan as pp  # noqa: E402
import peers_servers as ps  # noqa: E402
import run_peers  # noqa: E402

# --------------------------------------------------------------------------------------------- plan


def _opt(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_full_jobs_are_the_issues_workloads_identical_for_every_server():
    jobs = pp.jobs(pp.FULL)
    mixed = [j for j in jobs if j.workload == "mixed"]
    assert [j.concurrency for j in mixed] == [1, 2, 4, 8, 16, 32]
    for j in mixed:
        assert _opt(j.args, "--input-len") == "32:512" and _opt(j.args, "--output-len") == "16:256"
        assert int(_opt(j.args, "--num-prompts")) == max(16, 4 * j.concurrency)
        assert _opt(j.args, "--concurrency") == str(j.concurrency)
    (single,) = [j for j in jobs if j.workload == "single"]
    assert (_opt(single.args, "--input-len"), _opt(single.args, "--output-len"), _opt(single.args, "--concurrency")) \
        == ("32", "256", "1")
    (prefix,) = [j for j in jobs if j.workload == "prefix"]
    assert _opt(prefix.args, "--workload") == "prefix" and _opt(prefix.args, "--prefix-len") == "512"
    for j in jobs:  # same warm-up, ignore_eos and endpoint for all
        assert "--ignore-eos" in j.args and _opt(j.args, "--warmup") == "2"
        assert _opt(j.args, "--endpoint") == "completions"
    assert len({j.key for j in jobs}) == len(jobs)
    # each level its own prompts: a level that repeated another's would measure prompt-cache hits
    assert sorted(int(_opt(j.args, "--seed")) for j in jobs) == list(range(len(jobs)))
    assert pp.jobs(pp.FULL) == jobs  # and the same for every server


def test_quick_is_two_concurrencies_and_sizes_are_overridable():
    assert [j.concurrency for j in pp.jobs(pp.QUICK) if j.workload == "mixed"] == [2, 8]
    assert [j.workload for j in pp.jobs(pp.QUICK, ["single"])] == ["single"]
    s = run_peers.sizes_from(run_peers.parse_args(["--quick", "--concurrency", "1,4", "--rounds", "3", "--warmup", "3"]))
    assert s.concurrencies == (1, 4) and s.rounds == 3 and s.warmup == 3 and s.single_prompts == pp.QUICK.single_prompts
    assert run_peers.sizes_from(run_peers.parse_args([])) == pp.FULL


def test_context_per_slot_and_max_concurrency():
    assert pp.FULL.max_concurrency == 32 and pp.QUICK.max_concurrency == 8
    assert pp.FULL.context_per_slot == 768  # 512 + 256 is the longest request
    assert pp.with_sizes(pp.FULL, prefix_len=1000).context_per_slot == 1280
    assert pp._hi("normal:100,10") == 140 and pp._hi("7") == 7


def test_plan_interleaves_rounds():
    assert pp.plan(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]
    with pytest.raises(ValueError):
        pp.plan(["a"], 0)


def test_select_servers():
    assert pp.select_servers() == list(pp.SERVERS)
    assert pp.select_servers(["llmopt", "llamacpp"], ["bf16"]) == ["llmopt-bf16", "llamacpp-bf16"]
    assert pp.select_servers(names=["vllm-w4a16", "llmopt-bf16"]) == ["llmopt-bf16", "vllm-w4a16"]
    assert "vllm-w8a16" not in pp.SERVERS  # no vLLM CPU kernel for W8A16 (docs/QUANTIZE.md)
    with pytest.raises(ValueError):
        pp.select_servers(["sglang"])
    with pytest.raises(ValueError):
        pp.select_servers(names=["nope"])


def test_server_commands_match_threads_and_slots():
    cmd = ps.llamacpp_command("m.gguf", 9001, threads=2, slots=32, ctx_per_slot=768, binary="llama-server")
    assert _opt(tuple(cmd), "-t") == "2" and _opt(tuple(cmd), "-tb") == "2"
    assert _opt(tuple(cmd), "--parallel") == "32" and _opt(tuple(cmd), "-c") == str(32 * 768)
    assert "--cache-prompt" in cmd and _opt(tuple(cmd), "--host") == "127.0.0.1"
    cmd = ps.llmopt_command("dir", 9002, max_seqs=8)
    assert cmd[1:4] == ["-m", "llmopt", "serve"] and _opt(tuple(cmd), "--dtype") == "bfloat16"
    assert _opt(tuple(cmd), "--max-num-seqs") == "64" and _opt(tuple(cmd), "--host") == "127.0.0.1"
    cmd = ps.vllm_command("dir", 9003)
    assert cmd[1:3] == ["serve", "dir"] and _opt(tuple(cmd), "--dtype") == "bfloat16"
    env = ps.vllm_env(2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_INT4_W4A8"] == "0"
    assert env["OMP_NUM_THREADS"] == "2"


# ------------------------------------------------------------------------------------ rows and stats


def _report(tput: float, ttft50: float, ttft99: float, tpot: float, conc: int = 4, out_tokens: int = 100,
            failed: int = 0, owner: str = "llamacpp") -> dict:
    lat = {"count": 4, "mean": ttft50, "std": 0, "min": ttft50, "max": ttft99}
    return {"target": {"kind": "http", "server": owner}, "runs": [{
        "label": f"concurrency={conc}", "concurrency": conc, "completed": 4, "failed": failed,
        "total_output_tokens": out_tokens, "output_throughput": tput, "request_throughput": tput / 25,
        "ttft_ms": {**lat, "p50": ttft50, "p99": ttft99}, "tpot_ms": {**lat, "p50": tpot, "p99": tpot},
        "itl_ms": {**lat, "p50": tpot, "p99": tpot}}]}


def test_rows_from_report_and_decode_speed():
    (row,) = pp.rows_from_report(_report(120.0, 50.0, 90.0, 20.0), "llamacpp-bf16", "mixed", 2)
    assert (row.server, row.workload, row.concurrency, row.round) == ("llamacpp-bf16", "mixed", 4, 2)
    assert row.output_throughput == 120.0 and row.ttft_p99_ms == 90.0 and row.owned_by == "llamacpp"
    assert row.decode_tps == pytest.approx(50.0)
    rep = _report(1, 1, 1, 0)
    rep["runs"][0]["concurrency"] = None
    rep["runs"][0]["tpot_ms"] = {"count": 0}
    (row,) = pp.rows_from_report(rep, "x", "mixed", 1)
    assert row.concurrency == -1 and row.decode_tps is None


def test_median_and_spread():
    s = pp.stat([10.0, 20.0, 12.0, None])
    assert (s.median, s.lo, s.hi, s.n) == (12.0, 10.0, 20.0, 3)
    assert s.spread_pct == pytest.approx(100 * 10 / 24)
    assert s.fmt() == "12.0 ±42%" and pp.stat([5.0]).fmt() == "5.0"
    assert pp.stat([None, float("nan")]) is None


def _rows(server: str, workload: str, conc: int, values: list[tuple[float, float, float, float]],
          out_tokens: int = 100) -> list[pp.Row]:
    return [r for i, v in enumerate(values, 1)
            for r in pp.rows_from_report(_report(*v, conc=conc, out_tokens=out_tokens), server, workload, i)]


def test_aggregate_groups_rounds_and_flags_short_output():
    rows = _rows("llmopt-bf16", "mixed", 4, [(100, 10, 20, 5), (110, 12, 30, 5)]) \
        + _rows("llamacpp-bf16", "mixed", 4, [(50, 10, 20, 5), (50, 10, 20, 5)], out_tokens=90)
    cells = pp.aggregate(rows)
    ours = cells[("llmopt-bf16", "mixed", 4)]
    assert ours.rounds == 2 and ours.get("output_throughput").median == 105 and not ours.short
    assert cells[("llamacpp-bf16", "mixed", 4)].short  # stopped early on the same requests


def _cells(ours_mixed, peer_mixed, ours_single, peer_single, ours_prefix, peer_prefix, vllm_mixed=None):
    rows = _rows("llmopt-bf16", "mixed", 8, [ours_mixed]) + _rows("llamacpp-bf16", "mixed", 8, [peer_mixed]) \
        + _rows("llmopt-bf16", "single", 1, [(0, 1, 1, ours_single)]) \
        + _rows("llamacpp-bf16", "single", 1, [(0, 1, 1, peer_single)]) \
        + _rows("llmopt-bf16", "prefix", 4, [(0, ours_prefix, ours_prefix, 1)]) \
        + _rows("llamacpp-bf16", "prefix", 4, [(0, peer_prefix, peer_prefix, 1)])
    if vllm_mixed:
        rows += _rows("vllm-bf16", "mixed", 8, [vllm_mixed])
    return pp.aggregate(rows)


def test_goals_met_and_missed():
    sizes = pp.with_sizes(pp.FULL, concurrencies=(8,))
    # ours 2.5x llama.cpp with a lower p99 TTFT, 1.25x vLLM; decode 1000/8=125 vs 1000/10=100 tok/s = 1.25x
    g = {x.text: x for x in pp.goals(_cells((250, 10, 100, 1), (100, 10, 200, 1), 8.0, 10.0, 30, 40,
                                            vllm_mixed=(200, 1, 1, 1)), sizes)}
    assert g["bf16 mixed: output tok/s >= 2x llama.cpp with p99 TTFT no worse"].met is True
    assert g["bf16 mixed: output tok/s >= 1.5x vLLM CPU"].met is False
    assert "1.25x" in g["bf16 mixed: output tok/s >= 1.5x vLLM CPU"].measured
    assert g["bf16 single-stream decode >= 1.2x llama.cpp"].met is True
    assert g["bf16 shared-prefix TTFT p50 <= llama.cpp's"].met is True
    assert g["int8 single-stream decode >= 1x llama.cpp"].met is None  # not measured
    # fast enough, but p99 TTFT worse than llama.cpp's: the mixed goal is missed
    g = {x.text: x for x in pp.goals(_cells((250, 10, 300, 1), (100, 10, 200, 1), 9.0, 10.0, 50, 40), sizes)}
    assert g["bf16 mixed: output tok/s >= 2x llama.cpp with p99 TTFT no worse"].met is False
    assert g["bf16 single-stream decode >= 1.2x llama.cpp"].met is False
    assert g["bf16 shared-prefix TTFT p50 <= llama.cpp's"].met is False


def test_markdown_table():
    sizes = pp.with_sizes(pp.FULL, concurrencies=(8,))
    cells = _cells((250, 10, 100, 1), (100, 10, 200, 1), 8.0, 10.0, 30, 40)
    lim = pp.decode_limit(270_000_000, 23040, 32, 256, 27.0)
    md = pp.markdown(cells, ["llmopt-bf16", "llamacpp-bf16", "vllm-bf16"], sizes, {"llmopt-bf16": "bf16"},
                     {"llmopt-bf16": lim}, ["a note"])
    lines = md.splitlines()
    ours = next(ln for ln in lines if ln.startswith("| llmopt-bf16 | bf16 |"))
    assert "250.0 (c8)" in ours and f"{100 * 125 / lim.tokens_per_s:.0f}% of {lim.tokens_per_s:.0f}" in ours
    assert "| 30 |" in ours  # prefix TTFT p50
    assert not any(ln.startswith("| vllm-bf16") for ln in lines)  # not measured: no row
    assert "| c8 |" in md and "| goal | measured | met |" in md and "* a note" in md
    assert f"| llmopt-bf16 | 270.0 | 3.69 | 27.0 | {lim.tokens_per_s:.0f} | 125.0 |" in md
    assert all(ln.count("|") == lines[0].count("|") for ln in lines[:4])


# --------------------------------------------------------------------------------- bandwidth limit


def test_decode_limit_arithmetic():
    lim = pp.decode_limit(weight_bytes=200_000_000, kv_per_position=20_000, prompt_len=32, output_len=256,
                          bandwidth_gbs=16.0)
    assert lim.kv_bytes == 20_000 * (32 + 128)
    assert lim.bytes_per_token == 200_000_000 + 3_200_000
    assert lim.tokens_per_s == pytest.approx(16e9 / 203_200_000)
    assert lim.share(lim.tokens_per_s / 2) == pytest.approx(0.5) and lim.share(None) is None


def test_kv_bytes_of_smollm2_config():
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}
    assert pp.kv_bytes_per_position(cfg) == 2 * 30 * 3 * 64 * 2


def test_bytes_read_per_token_tied_and_untied():
    tied = {"model.embed_tokens.weight": 1000, "model.layers.0.mlp.up_proj.weight": 500}
    assert pp.bytes_read_per_token(tied) == 1500  # the table is the head: read whole
    untied = {**tied, "lm_head.weight": 1000}
    assert pp.bytes_read_per_token(untied) == 1500  # the table is only gathered
    assert pp.bytes_read_per_token({"token_embd.weight": 10, "output.weight": 10, "blk.0.ffn_up.weight": 4}) == 14
    # `--lm-head int8`: an untied head stored packed with its scales is still a head; a tied one is the table
    packed = {**tied, "lm_head.weight_packed": 500, "lm_head.weight_scale": 4}
    assert pp.bytes_read_per_token(packed) == 1004
    tied_packed = {"model.embed_tokens.weight_packed": 500, "model.embed_tokens.weight_scale": 4,
                   "model.layers.0.mlp.up_proj.weight": 500}
    assert pp.bytes_read_per_token(tied_packed) == 1004


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, off = {}, 0
    size = {"F32": 4, "BF16": 2, "I32": 4, "I8": 1}
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * off)


def test_tensor_bytes_from_safetensors_at_serving_dtype(tmp_path):
    f = tmp_path / "model.safetensors"
    _write_safetensors(f, {"a.weight": ("F32", [4, 8]), "b.weight_packed": ("I32", [4, 1]),
                           "b.weight_scale": ("BF16", [4, 2])})
    assert pp.tensor_bytes_safetensors([f]) == {"a.weight": 64, "b.weight_packed": 16, "b.weight_scale": 16}
    assert pp.tensor_bytes_safetensors([f], float_bytes=None)["a.weight"] == 128
    assert ps.tensor_bytes_dir(tmp_path) == pp.tensor_bytes_safetensors([f])


# ---------------------------------------------------------------------------------------- the doc


def test_replace_doc_section_keeps_everything_else():
    doc = "# Benchmarks\n\n## Engine\n\nrows\n\n## Peers\n\nHow to run.\n\n## Recipes\n\nr\n"
    once = pp.replace_doc_section(doc, "| table 1 |")
    assert once.startswith("# Benchmarks\n\n## Engine\n\nrows\n\n## Peers\n\nHow to run.\n\n" + pp.BEGIN)
    assert once.endswith(pp.END + "\n\n## Recipes\n\nr\n") and "| table 1 |" in once
    twice = pp.replace_doc_section(once, "| table 2 |")
    assert "| table 1 |" not in twice and twice == once.replace("| table 1 |", "| table 2 |")
    appended = pp.replace_doc_section("# B\n\n## Other\n", "| t |")
    assert appended == f"# B\n\n## Other\n\n## Peers\n\n{pp.BEGIN}\n| t |\n{pp.END}\n"
    last = pp.replace_doc_section("# B\n\n## Peers (issue #17)\n\ntext\n", "| t |")
    assert last == f"# B\n\n## Peers (issue #17)\n\ntext\n\n{pp.BEGIN}\n| t |\n{pp.END}\n"
    assert pp.replace_doc_section("## Peersx\n", "t").startswith("## Peersx\n\n## Peers\n")


def test_render_writes_table_png_and_doc(tmp_path, monkeypatch):
    rows = _rows("llmopt-bf16", "mixed", 2, [(100, 10, 20, 5), (110, 12, 30, 5)]) \
        + _rows("llamacpp-bf16", "mixed", 2, [(50, 10, 20, 5), (52, 10, 22, 5)])
    result = {"rows": [r.__dict__ for r in rows], "servers": ["llmopt-bf16", "llamacpp-bf16"], "models": {},
              "sizes": {**pp.QUICK.__dict__, "concurrencies": [2]},
              "bandwidth": {"2048": {"read_gbs": 20.0}, "257": {"read_gbs": 40.0}},
              "weights": {"llmopt-bf16": 269_000_000}, "kv_per_position": 23040, "threads": 2, "events": [{"loadavg_before": [3.0], "loadavg_after": [4.5]}],
              "versions": {"llmopt": "0", "llama.cpp": "build: native\nsmoke: ok"}, "failed_start": {"vllm-bf16": "x"}}
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Peers\n\nprose\n")
    monkeypatch.setattr(run_peers, "DOC", doc)
    md = run_peers.render(result, tmp_path, "python benchmarks/peers/run_peers.py --quick", ["loaded machine"], True)
    assert (tmp_path / "results.md").read_text() == md and (tmp_path / "peers.png").stat().st_size > 1000
    assert "| llmopt-bf16 | bf16 | 105.0 ±5% (c2)" in md and "vllm-bf16 did not run: x" in md and "load average 3.0–4.5" in md
    assert "`python benchmarks/peers/run_peers.py --quick`" in md and "* loaded machine" in md
    assert "40.0 GB/s on 257 MiB" in md and "| llmopt-bf16 | 269.0 | 3.69 | 40.0 | 147 |" in md
    assert doc.read_text().startswith("# Benchmarks\n\n## Peers\n\nprose\n\n" + pp.BEGIN)


# --------------------------------------------------------------- llmopt bench -> report -> rows


def test_ignore_eos_is_sent_to_every_server_when_asked(monkeypatch, capsys):
    from llmopt.bench.config import BenchOptions

    assert BenchOptions(url="http://x")._http().send_ignore_eos is None  # auto: only for our server
    assert BenchOptions(url="http://x", send_ignore_eos="always")._http().send_ignore_eos is True
    assert BenchOptions(url="http://x", send_ignore_eos="never")._http().send_ignore_eos is False
    code, _, err = run_bench_cli(monkeypatch, capsys, "--send-ignore-eos", "always", "--num-prompts", "1")
    assert code == 2 and "--send-ignore-eos apply to a server (--url)" in err
    code, _, err = run_bench_cli(monkeypatch, capsys, "--url", "http://127.0.0.1:9", "--send-ignore-eos", "yes")
    assert code == 2 and "send_ignore_eos" in err and len(err.strip().splitlines()) == 1


def test_harness_jobs_through_llmopt_bench_to_rows(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    """The harness's own job arguments, run by the real `llmopt bench --url` CLI (as run_peers.py runs it)
    against an OpenAI-compatible server, parsed back into rows and a table."""
    sizes = pp.Sizes(concurrencies=(1, 2), mixed_per_slot=1, mixed_min=2, mixed_input="4:8", mixed_output="2:4",
                     single_prompts=2, single_input=4, single_output=3, prefix_prompts=4, prefix_concurrency=2,
                     prefix_len=6, num_prefixes=2, prefix_suffix=2, prefix_output=2, warmup=1, rounds=1)
    fake_server.bodies.clear()
    rows = []
    for job in pp.jobs(sizes):
        out = tmp_path / f"{job.key}.json"
        code, _, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, "--send-ignore-eos", "always",
                                     "--tokenizer", str(tiny_llama), *job.args, "--json", str(out))
        assert code == 0, err
        rows += pp.load_rows(out, "llmopt-bf16", job.workload, 1)
    assert [(r.workload, r.concurrency) for r in rows] == [("mixed", 1), ("mixed", 2), ("single", 1), ("prefix", 2)]
    assert all(r.failed == 0 and r.completed > 0 and r.ttft_p50_ms > 0 and r.owned_by == "llmopt" for r in rows)
    assert rows[2].output_tokens == 2 * 3 and rows[2].decode_tps > 0
    assert all(b["ignore_eos"] is True for b in fake_server.bodies)
    md = pp.markdown(pp.aggregate(rows), ["llmopt-bf16"], sizes)
    assert md.splitlines()[2].startswith("| llmopt-bf16 |")


@pytest.mark.slow
def test_server_class_drives_llmopt_serve(tiny_llama, tmp_path):
    """ps.Server starts `llmopt serve` (tiny model), waits for it, run_peers.bench runs one job, Server stops it."""
    port = ps.free_port()
    cmd = ps.llmopt_command(str(tiny_llama), port, max_seqs=2, kv_memory="16MiB", dtype="float32")
    job = pp.Job("single", 1, ("--input-len", "4", "--output-len", "3", "--num-prompts", "2", "--concurrency", "1",
                               "--warmup", "0", "--no-progress", "--tokenizer", str(tiny_llama)))
    with ps.Server("llmopt-tiny", cmd, ps.thread_env(1), tmp_path / "serve.log", port, timeout_s=120) as srv:
        assert run_peers.bench(srv.url, job, tmp_path / "r.json", tmp_path / "bench.log"), \
            (tmp_path / "bench.log").read_text()[-2000:]
        proc = srv.proc
    assert proc.poll() is not None  # stopped on exit
    (row,) = pp.load_rows(tmp_path / "r.json", "llmopt-tiny", "single", 1)
    assert row.completed == 2 and row.output_tokens == 6 and row.owned_by == "llmopt"


def test_failures_anywhere_are_flagged_on_the_servers_row():
    rows = _rows("llamacpp-q4_0", "mixed", 8, [(60, 1, 1, 1)])
    rep = _report(40, 1, 1, 1, conc=2, failed=2)
    rows += pp.rows_from_report(rep, "llamacpp-q4_0", "mixed", 1)
    md = pp.markdown(pp.aggregate(rows), ["llamacpp-q4_0"], pp.with_sizes(pp.FULL, concurrencies=(2, 8)))
    assert "| llamacpp-q4_0 ⚠2 failed | " in md and "60.0 (c8)" in md  # the peak level itself had none


def test_goals_pair_rounds_and_show_their_interval():
    """A goal is a ratio over interleaved rounds with the `bench --ab` interval: met by its point, shown only
    when the interval clears the target too."""
    sizes = pp.with_sizes(pp.FULL, concurrencies=(8,))

    def cells(ours, peer):
        return pp.aggregate(_rows("llmopt-bf16", "mixed", 8, [(t, 10, 100, 1) for t in ours])
                            + _rows("llamacpp-bf16", "mixed", 8, [(t, 10, 200, 1) for t in peer]))

    name = "bf16 mixed: output tok/s >= 2x llama.cpp with p99 TTFT no worse"
    clear = {g.text: g for g in pp.goals(cells([250, 262, 241, 255], [100, 104, 97, 101]), sizes)}[name]
    assert clear.met and clear.shown
    assert "c8 2.51x [" in clear.measured and "p99 TTFT 0.50x" in clear.measured
    # the same mean ratio 2.0 (point meets the target) with rounds too noisy to show it
    edge = {g.text: g for g in pp.goals(cells([230, 170, 210, 190], [100, 100, 100, 100]), sizes)}[name]
    assert edge.met and not edge.shown
    md = pp.markdown(cells([230, 170, 210, 190], [100, 100, 100, 100]), ["llmopt-bf16", "llamacpp-bf16"], sizes)
    assert "yes (not shown)" in md
    # a peer round missing: only the rounds both servers ran are paired
    est = pp.ratio(cells([200, 300], [100]), "llmopt-bf16", "llamacpp-bf16", "mixed", 8, "output_throughput")
    assert est.rounds == 1 and est.ratio == 2.0 and est.low is None
