"""A model of the size people deploy, end to end, with each stage's peak memory (issue #30).

    python benchmarks/big_model.py [--shape 1b|llama2-7b|llama3-8b] [--workdir DIR]
                                   [--stages quantize,generate,eval,llamacpp]
    make bench-big [BIG_ARGS="--shape 1b"]        # the Llama-3-8B shape by default

1. Writes a seeded random checkpoint of a real architecture through transformers itself (`save_pretrained`,
   bf16, HF shards of 5 GB): `1b` is a 1.2B Llama (hidden 2048, 22 layers, intermediate 5632, GQA 32/4,
   SmolLM2's 49,152-token vocabulary), `llama3-8b` Llama-3-8B's shape (16 GB in bf16; 128,256 tokens).
   Speed and memory do not depend on the values.
2. Runs each stage as its own `python -m llmopt ...` process and samples its /proc status every 20 ms:
   peak RssAnon (anonymous memory: what the process allocated, without the page cache of the mapped
   checkpoint) and peak VmRSS, and its wall time.
   - quantize: W8A16 RTN, W4A16 RTN g128, W4A16 GPTQ g128 (16 windows of 512 tokens); `w4a16-awq` (AWQ g128, the
     same windows), `w4a16-rtn-head4` (RTN g128 with `--lm-head int4`), `--schemes auto-gptq`
     (or `auto-rtn`): `--scheme auto --target-bits 4.5 --method gptq` (`rtn`) on the same windows;
   - generate: 64 tokens, greedy, bf16 on the source checkpoint and on each quantized one;
   - eval: perplexity, KL and top-1 of the W8A16 checkpoint against the bf16 model (`--eval-tokens` of
     WikiText-2 when ../shared/data has it, else the shipped calibration prose), one model after the other.
   - llamacpp (when `make bench-peers` has built .peers/llama.cpp): the same bf16 checkpoint through
     llama.cpp's own `convert_hf_to_gguf.py` (BF16) and `llama-quantize` (Q8_0, Q4_0), each served by
     `llama-server` with the same thread count and asked for the same 64 greedy tokens (`ignore_eos`); its
     decode speed is the server's own `timings.predicted_per_second`. llama.cpp maps the GGUF, so its
     weights show in VmRSS, not RssAnon.
   The machine's DRAM read bandwidth is measured first (a sum over a 2 GB tensor, torch's threads), and each
   decode speed is given as the share of it that its weight bytes per token use.
3. Prints a Markdown table (docs/BENCHMARKS.md keeps it with the command) and deletes each artifact once
   its stages are measured (`--keep` leaves them). Checks free disk first.

Not part of `make test`: the 1B shape takes minutes on 2 cores, the 8B one much longer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMACPP = Path(os.environ.get("LLAMACPP_DIR", REPO / ".peers" / "llama.cpp"))
LLAMACPP_PY = Path(os.environ.get("LLAMACPP_PYENV", REPO / ".peers" / "llamacpp-py")) / "bin" / "python"
PROMPT = "The capital of France is"
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
import peers_servers as ps  # noqa: E402

CALIB = [REPO / "calibration_data" / "general_prose.jsonl", REPO / "calibration_data" / "kb_calibration.jsonl"]

SHAPES = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 22, "intermediate_size": 5632, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 49152, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "max_position_embeddings": 2048},
    # Llama-2-7B's shape (the seed recipe's stand-in) with SmolLM2's 49,152-token vocabulary instead of 32,000,
    # so the offline tokenizer's ids fit: 6.9B parameters instead of 6.7B
    "llama2-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 49152,
                  "tie_word_embeddings": False, "rope_theta": 10000.0, "max_position_embeddings": 4096},
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 8192},
}


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files, from the embedded model llmopt converts (no download)."""
    from llmopt.models.resolve import resolve_model, weights_dir

    return weights_dir(resolve_model("smollm2-135m"))


def write_checkpoint(shape: str, out: Path, seed: int = 0) -> float:
    """A seeded random bf16 checkpoint written by transformers' save_pretrained; returns its size in bytes.
    Parameters are filled one at a time after an uninitialized build (no float32 copy of the model)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    cfg = LlamaConfig(**SHAPES[shape], torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    with no_init_weights():
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    model.save_pretrained(str(out), max_shard_size="5GB")
    AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir())).save_pretrained(str(out))
    del model
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def measure(cmd: list[str], during=None) -> dict:
    """Run `cmd`, sampling its peak RssAnon and VmRSS (kB in /proc/PID/status) every 20 ms. With `during`
    (a server), call during(proc) once it runs, then stop the process; its return value is kept as "result"."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak = {"RssAnon": 0, "VmRSS": 0}
    status = Path(f"/proc/{proc.pid}/status")
    done = threading.Event()

    def sample() -> None:
        while not done.is_set() and proc.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    key = line.split(":", 1)[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]) * 1024)
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = None
    if during is not None:
        try:
            result = during(proc)
        finally:
            done.set()
            proc.terminate()
    out = proc.communicate()[0] or ""
    done.set()
    sampler.join()
    if during is None and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"seconds": time.perf_counter() - t0, "peak_anon": peak["RssAnon"], "peak_rss": peak["VmRSS"],
            "output": out, "result": result}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--stages", default="quantize,generate,eval,llamacpp",
                    help="quantize,generate,eval,llamacpp (llamacpp is skipped, with a note, until `make "
                         "bench-peers` has built it); or `write`: only write the checkpoint into --workdir and keep it")
    ap.add_argument("--gptq-windows", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--schemes", default="w8a16-rtn,w4a16-rtn,w4a16-gptq")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="llmopt-big-"))
    work.mkdir(parents=True, exist_ok=True)
    need = {"1b": 8e9, "llama2-7b": 36e9, "llama3-8b": 40e9}[args.shape]
    # what an earlier --keep left in the workdir is already on disk and is deleted as its stages finish
    need -= sum(f.stat().st_size for f in work.rglob("*.safetensors"))
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"{work}: {gb(free)} free, this shape needs {gb(need)}")
    stages = set(args.stages.split(","))
    bandwidth = read_bandwidth() if stages != {"write"} else 0.0
    if bandwidth:
        print(f"DRAM read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    py = [sys.executable, "-m", "llmopt"]
    src = work / f"{args.shape}-bf16"
    rows: list[tuple[str, dict, float]] = []
    if not src.exists():
        t0 = time.perf_counter()
        size = write_checkpoint(args.shape, src)
        print(f"wrote {src}: {gb(size)} in {time.perf_counter() - t0:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    if stages == {"write"}:
        print(f"{src}: {gb(size)}")
        return
    shape = SHAPES[args.shape]
    embedding = shape["vocab_size"] * shape["hidden_size"] * 2  # bf16 in every checkpoint, one row read a token
    calibration = ["--num-samples", str(args.gptq_windows), "--seq-len", "512",
                   *[a for c in CALIB for a in ("--calib-data", str(c))]]
    quantized = {
        "w8a16-rtn": ["--scheme", "w8a16"],
        "w4a16-rtn": ["--scheme", "w4a16", "--group-size", "128"],
        "w4a16-gptq": ["--scheme", "w4a16", "--group-size", "128", "--method", "gptq", *calibration],
        "w4a16-awq": ["--scheme", "w4a16", "--group-size", "128", "--method", "awq", *calibration],
        # the head in int4 groups of 32 too, as llama.cpp's Q4 types quantize theirs: its export and load
        "w4a16-rtn-head4": ["--scheme", "w4a16", "--group-size", "128", "--lm-head", "int4"],
        # each linear's precision chosen under the bits of uniform W4A16 g32 (docs/QUANTIZE.md, "Automatic precision")
        "auto-gptq": ["--scheme", "auto", "--target-bits", "4.5", "--method", "gptq", *calibration],
        # the same search with each candidate rounded to nearest: what a user can afford at 8B on 2 cores
        "auto-rtn": ["--scheme", "auto", "--target-bits", "4.5", "--method", "rtn", *calibration],
    }
    gen = ["generate", "--max-tokens", "64", "--prompt", PROMPT, "--json"]
    if "generate" in stages:
        r = measure([*py, *gen[:1], str(src), "--dtype", "bfloat16", *gen[1:]])
        rows.append(("generate bf16", r, size))
        print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", flush=True)
    unknown = set(args.schemes.split(",")) - set(quantized)
    if unknown:
        raise SystemExit(f"--schemes: unknown {sorted(unknown)}; choose from {sorted(quantized)}")
    for name, opts in quantized.items():
        if name not in args.schemes.split(","):
            continue
        out = work / name
        if "quantize" in stages:
            shutil.rmtree(out, ignore_errors=True)
            r = measure([*py, "quantize", str(src), *opts, "--device", "cpu", "-o", str(out)])
            rows.append((f"quantize {name}", r, size))
            print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", flush=True)
        if "generate" in stages and out.exists():
            qsize = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            r = measure([*py, *gen[:1], str(out), "--dtype", "bfloat16", *gen[1:]])
            rows.append((f"generate {name}", r, qsize))
            print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", flush=True)
        if "eval" in stages and name == "w8a16-rtn" and out.exists():
            r = measure([*py, "eval", str(out), "--baseline", str(src), "--ppl-data", str(eval_text()),
                         "--max-tokens", str(args.eval_tokens), "--seq-len", "512", "--json"])
            rows.append(("eval W8A16 against bf16", r, size))
            print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", _eval_summary(r["output"]), flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if "llamacpp" in stages:
        if (LLAMACPP / "bin" / "llama-server").exists() and LLAMACPP_PY.exists():
            rows += run_llamacpp(src, work, keep=args.keep)  # deletes src once converted, unless keep
        else:
            print(f"llamacpp: skipped, {LLAMACPP}/bin has no llama-server (run `make bench-peers` first)", flush=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    print(f"\n{args.shape}: bf16 checkpoint {gb(size)}, CPU {cpu()}, torch threads {os.environ.get('OMP_NUM_THREADS', 'all')}")
    print(f"DRAM read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over a 2 GB tensor)")
    print("| stage | peak RssAnon | vs the bf16 checkpoint | peak VmRSS | time | decode / result |")
    print("|---|---|---|---|---|---|")
    for name, r, stage_bytes in rows:
        if name.startswith("generate"):
            result = _decode_rate(_json(r["output"]).get("decode_tok_s"), stage_bytes - embedding, bandwidth)
        elif r.get("result"):  # llama-server's decode speed; stage_bytes is already without token_embd
            result = _decode_rate(r["result"], stage_bytes, bandwidth)
        else:
            result = _eval_summary(r["output"]) if name.startswith("eval") else ""
        print(f"| {name} | {gb(r['peak_anon'])} | {r['peak_anon'] / size:.2f}x | {gb(r['peak_rss'])} "
              f"| {r['seconds']:.0f} s | {result} |")


def run_llamacpp(src: Path, work: Path, keep: bool) -> list[tuple[str, dict, float]]:
    """llama.cpp on the same weights: convert to a BF16 GGUF, quantize to Q8_0 and Q4_0, and serve each with
    llama-server for one 64-token greedy completion. Each GGUF is deleted once measured (unless `keep`)."""
    rows: list[tuple[str, dict, float]] = []
    bf16 = work / "llamacpp-bf16.gguf"
    if not bf16.exists():
        r = measure([str(LLAMACPP_PY), str(LLAMACPP / "bin" / "convert_hf_to_gguf.py"), str(src),
                     "--outtype", "bf16", "--outfile", str(bf16)])
        rows.append(("llama.cpp convert_hf_to_gguf BF16", r, bf16.stat().st_size))
        print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", flush=True)
    if not keep:  # the safetensors are no longer needed: 16 GB less on disk while the GGUFs exist
        shutil.rmtree(src, ignore_errors=True)
    rows.append(("llama.cpp BF16", serve_llamacpp(bf16), gguf_bytes_per_token(bf16)))
    print(rows[-1][0], rows[-1][1]["result"], flush=True)
    for q in ("Q8_0", "Q4_0"):
        out = work / f"llamacpp-{q.lower()}.gguf"
        r = measure([str(LLAMACPP / "bin" / "llama-quantize"), str(bf16), str(out), q, str(threads())])
        rows.append((f"llama.cpp llama-quantize {q}", r, bf16.stat().st_size))
        print(rows[-1][0], gb(r["peak_anon"]), f"{r['seconds']:.0f} s", flush=True)
        rows.append((f"llama.cpp {q}", serve_llamacpp(out), gguf_bytes_per_token(out)))
        print(rows[-1][0], rows[-1][1]["result"], flush=True)
        if not keep:
            out.unlink()
    if not keep:
        bf16.unlink()
    return rows


def gguf_bytes_per_token(gguf: Path) -> int:
    """The GGUF's tensor bytes less token_embd (one row of it is read a token), by llama.cpp's own gguf-py."""
    sys.path.insert(0, str(LLAMACPP / "bin" / "gguf-py"))
    from gguf import GGUFReader

    tensors = GGUFReader(gguf).tensors
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")


def serve_llamacpp(gguf: Path, port: int = 18590) -> dict:
    """llama-server on `gguf` with our thread count; one warm-up then one measured 64-token completion."""
    cmd = ps.llamacpp_command(str(gguf), port, threads=threads(), slots=1, ctx_per_slot=512,
                              binary=LLAMACPP / "bin" / "llama-server")
    base = f"http://127.0.0.1:{port}"

    def ask(proc: subprocess.Popen) -> float:
        try:
            ps.wait_healthy(base, proc, 600)
        except RuntimeError as e:
            raise SystemExit(f"llama-server on {gguf}: {e}") from None
        ps.llamacpp_decode_rate(base, PROMPT, 4)  # warm-up
        return round(ps.llamacpp_decode_rate(base, PROMPT, 64), 2)

    return measure(cmd, during=ask)


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def _json(output: str) -> dict:
    """The JSON object a --json command printed (progress lines may come before it)."""
    m = re.search(r"^\{.*\}", output, re.S | re.M)
    try:
        return json.loads(m.group(0)) if m else {}
    except json.JSONDecodeError:
        return {}


def _decode_rate(rate: float | None, weight_bytes: float, bandwidth: float) -> str:
    """A decode speed, and the share of the read bandwidth its weight bytes per token use (every weight is
    read once a token; the KV and the embedding row are noise at this size)."""
    return f"{rate} tok/s, {rate * weight_bytes / bandwidth:.0%} of the bandwidth" if rate else ""


def _eval_summary(output: str) -> str:
    ppl = _json(output).get("perplexity") or {}
    if "baseline" not in ppl:
        return ""
    b, c = ppl["baseline"]["ppl"], ppl["candidate"]["ppl"]
    return (f"ppl {b:.4g} -> {c:.4g} ({100 * (c / b - 1):+.2f}%), KL {ppl['kl_div']:.2e}, "
            f"top-1 {ppl['top1_agreement']:.3f}, {ppl['candidate']['tokens']} tokens")


def eval_text() -> Path:
    """WikiText-2 when the shared data is here, else the shipped calibration prose."""
    wiki = REPO.parent / "shared" / "data" / "wikitext2-valid.txt"
    return wiki if wiki.is_file() else CALIB[0]


def read_bandwidth(gbytes: float = 2.0, rounds: int = 5) -> float:
    """DRAM read bandwidth in bytes/s: the best of `rounds` sums over a tensor far larger than the caches."""
    import torch

    x = torch.ones(int(gbytes * 1e9) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
