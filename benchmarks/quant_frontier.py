"""The quality frontier: whole-checkpoint bytes against held-out perplexity, for our quantizers and llama.cpp's.

    make quant-frontier      # llama.cpp's tools (benchmarks/peers/install_llamacpp.sh), then SmolLM2 and Gemma 3
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quant_frontier.py --model smollm2-135m \\
        [--tokens 8192] [--num-samples 16] [--budgets 4.5,5,6] [--only LABEL,...] [--reuse] [--write-doc]
        [--no-llmcompressor]

One protocol for every point (issue #32, part 6):

* Calibration: `llmopt calibrate` draws --num-samples windows of 512 tokens once (the shipped
  general_prose.jsonl and kb_calibration.jsonl mixed 1:1, seed 0). Our GPTQ, AWQ and `--scheme auto` use
  those windows (`--calib`); llama.cpp's `llama-imatrix` reads the same windows, decoded back to text, in
  chunks of 512 tokens, and every llama.cpp type is quantized with that importance matrix.
* llama.cpp starts from the same float32 weights our quantizers load (the model's HF folder, converted by
  its own `convert_hf_to_gguf.py --outtype f32`); its ladder is --ladder (Q3_K_M ... Q8_0).
* Ours: RTN, GPTQ (act-order, the default) and AWQ at every group size of 32/64/128 that divides the model's
  linear widths, W8A16, and `--scheme auto` with GPTQ at each of --budgets (bits per weight of the linears)
  and with AWQ at the first; the GPTQ, auto, W8A16 and smallest-group points again with `--lm-head int8` (the
  head, and the embedding it is tied to, in int8 per row), the auto points again with `--lm-head auto` (the
  head inside the budget), RTN and AWQ with asymmetric smallest groups (`--asym`) and the int8 head, and
  `--scheme auto --asym` GPTQ|AWQ at the first budget with the int8 head. Checkpoints are compressed-tensors as
  `llmopt quantize` writes them by default: the float32 tensors outside the layers (embedding, final norm) in bf16.
* llm-compressor (in its own venv, benchmarks/peers/install_llmcompressor.sh; through
  benchmarks/peers/llmcompressor_worker.py): RTN, GPTQ (its default actorder "static") and AWQ at the same
  group sizes, and W8A16 per channel, on the same windows as token ids, from the same float32 folder loaded in
  bf16 as its examples do (so what it leaves unquantized, the embedding and head, is stored in bf16 as ours is;
  it quantizes no embedding). Its checkpoints are compressed-tensors too and are scored by our engine like ours.
* Bytes: every tensor the checkpoint stores (safetensors files; a GGUF's tensor data, without its tokenizer
  metadata), embedding and head included.
* Scoring: the same code for every point, our engine in float32 as `llmopt eval --ppl-data F --seq-len 512
  --max-tokens N` scores (the text tokenized by the source model's tokenizer once, non-overlapping windows).
  A GGUF is dequantized by transformers (as `llmopt` loads any .gguf). Two held-out texts, never the
  calibration text: the first --tokens tokens of ../shared/data/wikitext2-valid.txt and of
  tinyshakespeare.txt. Beside perplexity, each point's KL(unquantized || point) per token on the same
  tokens, as `llmopt eval --baseline` measures it (the unquantized model's top-256 log-probs kept once):
  perplexity can order two points of nearly equal damage either way, KL measures the damage itself
  (docs/QUANTIZE.md, "A third reason").

Results go to runs/quant-frontier/<model>/frontier.json after each point (--reuse keeps finished points),
the table to stdout and the plot to runs/quant-frontier/<model>/quant-frontier-<model>.png; with --write-doc
the plot goes to docs/ instead and the table into docs/QUANTIZE.md between this model's markers (without it,
a partial run leaves the docs alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks/peers"))

TEXTS = {"wikitext2": ROOT.parent / "shared/data/wikitext2-valid.txt",
         "tinyshakespeare": ROOT.parent / "shared/data/tinyshakespeare.txt"}
CALIB = [str(ROOT / "calibration_data/general_prose.jsonl"), str(ROOT / "calibration_data/kb_calibration.jsonl")]
LLAMACPP = ROOT / ".peers/llama.cpp"
LLMCOMPRESSOR = ROOT / ".peers/llmcompressor"
LADDER = "Q3_K_M,Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0"
DOC = ROOT / "docs/QUANTIZE.md"
SEQ = 512


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def held_out_ids(tok: Any, tokens: int) -> dict[str, list[int]]:
    """The first `tokens` token ids of each held-out text (TEXTS) under `tok`; a one-line exit when one is missing."""
    missing = [str(p) for p in TEXTS.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"error: held-out text {missing[0]} missing")
    return {name: tok.encode(p.read_text(encoding="utf-8"))[:tokens] for name, p in TEXTS.items()}


def doc_markers(model: str) -> tuple[str, str]:
    return (f"<!-- quant-frontier:{model}:begin (written by benchmarks/quant_frontier.py --write-doc) -->",
            f"<!-- quant-frontier:{model}:end -->")


# ------------------------------------------------------------------------------------------------ the points
def group_sizes(model_dir: Path) -> list[int]:
    """The int4 group sizes (128, 64, 32) that divide every linear's input width, largest first."""
    import torch

    from llmopt.group_size import is_valid_group_size
    from llmopt.layers.linear import iter_linears
    from llmopt.models.loader import build_empty
    from llmopt.models.resolve import resolve_model

    empty = build_empty(resolve_model(str(model_dir)), torch.float32, "cpu")  # meta: shapes only
    widths = {m.weight.shape[1] for _, m in iter_linears(empty)}
    return [g for g in (128, 64, 32) if is_valid_group_size(widths, g)]


def our_points(groups: list[int], budgets: list[float]) -> dict[str, dict[str, Any]]:
    """label -> QuantizeConfig options, at each of `groups` (group_sizes)."""
    points: dict[str, dict[str, Any]] = {}
    for method in ("rtn", "gptq", "awq"):
        for g in groups:
            points[f"W4A16 g{g} {method.upper()}"] = {"scheme": "w4a16", "group_size": g, "method": method}
    points["W8A16 RTN"] = {"scheme": "w8a16"}
    for b in budgets:
        points[f"auto {b:g} bits GPTQ"] = {"scheme": "auto", "target_bits": b, "method": "gptq"}
    if budgets:  # AWQ is the best uniform int4 method on SmolLM2, GPTQ on Gemma 3: auto with AWQ, and with the
        # better of the two per linear (`--method auto`), at the first budget
        points[f"auto {budgets[0]:g} bits AWQ"] = {"scheme": "auto", "target_bits": budgets[0], "method": "awq"}
        points[f"auto {budgets[0]:g} bits GPTQ|AWQ"] = {"scheme": "auto", "target_bits": budgets[0], "method": "auto"}
    # the same with the head (the tied embedding) in int8 per row: what llama.cpp's ladder does to it too
    smallest = min(groups, default=None)
    for label in [k for k in points if "GPTQ" in k or k.startswith("auto") or k == "W8A16 RTN"
                  or k.startswith(f"W4A16 g{smallest} ")]:
        points[f"{label} + int8 head"] = {**points[label], "lm_head": "int8"}
    # the head inside the budget (`--lm-head auto`: bf16, int8 or int4, chosen with the linears; the budget
    # then counts the head's weights too, so the same B is a smaller checkpoint)
    for b in budgets:
        points[f"auto {b:g} bits GPTQ + auto head"] = {"scheme": "auto", "target_bits": b, "method": "gptq",
                                                        "lm_head": "auto"}
    if budgets:
        for method, name in (("awq", "AWQ"), ("auto", "GPTQ|AWQ")):
            points[f"auto {budgets[0]:g} bits {name} + auto head"] = {"scheme": "auto", "target_bits": budgets[0],
                                                                     "method": method, "lm_head": "auto"}
    # asymmetric groups (a zero point per group, what llama.cpp's Q4_1/Q4_K blocks have), smallest groups, and
    # `--scheme auto --asym` (every int candidate asymmetric; the budget pays for the zero points) at the first budget
    if smallest:
        for method in ("rtn", "awq"):
            points[f"W4A16 g{smallest} {method.upper()} asym + int8 head"] = {
                "scheme": "w4a16", "group_size": smallest, "method": method, "symmetric": False, "lm_head": "int8"}
    if budgets:
        points[f"auto {budgets[0]:g} bits GPTQ|AWQ asym + int8 head"] = {
            "scheme": "auto", "target_bits": budgets[0], "method": "auto", "symmetric": False, "lm_head": "int8"}
    return points


def quantize_ours(model: str, opts: dict[str, Any], out: Path, calib: Path, plans: dict[tuple, Any]) -> dict[str, Any]:
    """Quantize one point. `--scheme auto` points that differ only in the budget or a fixed head share one
    search (its measurements, as a gate search shares them): `plans` keeps each search by what it measured,
    and a point that reuses one is charged the search's seconds, so "quantize s" is what the point costs alone."""
    from llmopt.quant.auto import AutoPlan
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    kw = dict(opts)
    if kw.get("method", "rtn") != "rtn" or kw["scheme"] == "auto":
        kw["calib"] = calib
    plan = None
    if kw["scheme"] == "auto":  # the head outside the budget (float or a fixed int8) is not part of the search
        plan = plans.setdefault((kw.get("method", "rtn"), kw.get("lm_head") == "auto", kw.get("symmetric", True)),
                                AutoPlan(0.0, {}, {}))
    reused = plan.seconds if plan is not None and plan.options else 0.0
    t0 = time.perf_counter()
    report = quantize_model(QuantizeConfig(model=model, output=out, overwrite=True, device="cpu", **kw), plan=plan)
    extra: dict[str, Any] = {"quantize_s": round(time.perf_counter() - t0 + reused, 1)}
    if report.auto:
        extra |= {"bits": report.auto["bits"], "predicted_kl": report.auto["predicted_kl"],
                  "measured_kl": report.auto["measured_kl"]}
    return extra


def llmcompressor_points(groups: list[int]) -> dict[str, dict[str, Any]]:
    """label -> llmcompressor_worker.py job fields: its three W4A16 methods at each group size, and W8A16."""
    points = {f"llm-compressor W4A16 g{g} {m.upper()}": {"method": m, "num_bits": 4, "group_size": g}
              for m in ("rtn", "gptq", "awq") for g in groups}
    points["llm-compressor W8A16 RTN"] = {"method": "rtn", "num_bits": 8, "group_size": None}
    return points


def quantize_llmcompressor(model_dir: Path, job: dict[str, Any], out: Path, windows: Path,
                           threads: int) -> dict[str, Any]:
    from quant_peers import llmcompressor_job

    shutil.rmtree(out, ignore_errors=True)
    res = llmcompressor_job(LLMCOMPRESSOR, {"model_dir": str(model_dir), "symmetric": True, "ignore": ["lm_head"],
                                            "dtype": "bfloat16", "windows": str(windows), "out_dir": str(out),
                                            "threads": threads, **job}, out)
    return {"quantize_s": res["wall_s"], "versions": res["versions"]}


def cpu_name() -> str:
    return next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), "unknown")


def checkpoint_bytes(path: Path) -> int:
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return int(sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------- llama.cpp
def llamacpp_tools() -> dict[str, Path]:
    tools = {"quantize": LLAMACPP / "bin/llama-quantize", "imatrix": LLAMACPP / "bin/llama-imatrix",
             "convert": LLAMACPP / "bin/convert_hf_to_gguf.py", "python": ROOT / ".peers/llamacpp-py/bin/python"}
    missing = [str(p) for p in tools.values() if not p.exists()]
    if missing:
        raise SystemExit(f"error: {missing[0]} missing: run benchmarks/peers/install_llamacpp.sh (make quant-frontier does)")
    return tools


def _run(cmd: list[str], logfile: Path) -> None:
    with logfile.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"error: {Path(cmd[0]).name} failed (rc {r.returncode}, {logfile}): {' | '.join(tail)}")


def llamacpp_sources(model_dir: Path, calib_text: Path, chunks: int, work: Path, threads: int) -> tuple[Path, Path]:
    """The f32 GGUF of `model_dir` and its importance matrix on the calibration text (once; reused)."""
    tools = llamacpp_tools()
    f32 = work / "source-f32.gguf"
    if not f32.is_file():
        log(f"convert_hf_to_gguf.py {model_dir} -> {f32.name}")
        _run([str(tools["python"]), str(tools["convert"]), str(model_dir), "--outtype", "f32",
              "--outfile", str(f32) + ".tmp"], work / "convert.log")
        os.replace(str(f32) + ".tmp", f32)
    imatrix = work / "imatrix.gguf"
    if not imatrix.is_file():
        log(f"llama-imatrix on {chunks} chunks of {SEQ} calibration tokens")
        _run([str(tools["imatrix"]), "-m", str(f32), "-f", str(calib_text), "-c", str(SEQ), "--chunks", str(chunks),
              "-t", str(threads), "-o", str(imatrix) + ".tmp.gguf"], work / "imatrix.log")
        os.replace(str(imatrix) + ".tmp.gguf", imatrix)
    return f32, imatrix


def quantize_llamacpp(kind: str, f32: Path, imatrix: Path, out: Path, threads: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    _run([str(llamacpp_tools()["quantize"]), "--imatrix", str(imatrix), str(f32), str(out), kind, str(threads)],
         out.with_suffix(".log"))
    return {"quantize_s": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------------------------------- scoring
def score(path: Path, texts: dict[str, list[int]], reference: dict[str, Any] | None = None,
          record: bool = False, windows: bool = False) -> dict[str, dict[str, Any]]:
    """Perplexity of each text's token ids under `path` in our engine, float32, as `llmopt eval` scores them;
    and, given the unquantized model's `reference` (text -> its top-k log-probs, filled when `record`), the mean
    KL(unquantized || this) per token, as `llmopt eval --baseline` measures it (top-256 coarsened, a lower bound).
    `windows`: each window's mean NLL and scored tokens too, for paired intervals (benchmarks/auto_seeds.py)."""
    from llmopt import LLM
    from llmopt.eval.perplexity import score_text

    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    ppl, kl, window_nll, window_tokens = {}, {}, {}, {}
    for name, ids in texts.items():
        ref = None if reference is None else reference[name]
        s = score_text(llm.engine, ids, SEQ, record=ref if record else None,
                       compare_to=None if record else ref)
        ppl[name] = float(s.nll[0].ppl)
        window_nll[name], window_tokens[name] = s.per_window_nll[0], s.window_tokens
        if s.divergence is not None:
            kl[name] = float(s.divergence.kl_div)
    del llm
    out: dict[str, dict[str, Any]] = {"ppl": ppl, "kl": kl} if kl else {"ppl": ppl}
    return out | {"window_nll": window_nll, "window_tokens": window_tokens} if windows else out


# ---------------------------------------------------------------------------------------------------- output
def table(result: dict[str, Any]) -> str:
    names = list(TEXTS)
    base = result["base"]
    lines = [f"| point | tool | checkpoint MB | {' | '.join(f'{n} ppl (vs fp32)' for n in names)} | "
             f"{' | '.join(f'{n} KL' for n in names)} | quantize s |",
             "|---|---|---|" + "---|" * (2 * len(names)) + "---|"]
    rows = sorted(result["points"].values(), key=lambda r: r["bytes"])
    for r in [base, *rows]:
        cells = [f"{r['ppl'][n]:.3f} ({100 * (r['ppl'][n] / base['ppl'][n] - 1):+.1f}%)" if r is not base
                 else f"{r['ppl'][n]:.3f}" for n in names]
        cells += [f"{r['kl'][n]:.4f}" if n in r.get("kl", {}) else "" for n in names]
        q = f"{r['quantize_s']:.0f}" if "quantize_s" in r else ""
        label = r["label"].replace("|", "\\|")  # "GPTQ|AWQ" inside a Markdown cell
        label = f"**{label}**" if r.get("tool") == "llmopt" and label.startswith("auto") else label
        lines.append(f"| {label} | {r.get('tool', '')} | {r['bytes'] / 1e6:.1f} | {' | '.join(cells)} | {q} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels over checkpoint MB: wikitext-2 perplexity increase, and KL to the unquantized model on the same
    tokens (points scored before KL was measured are left out of that panel). KL is the steadier ranking of
    4-bit points of similar damage (docs/QUANTIZE.md, "The sign of the scale")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = result["base"]["ppl"]["wikitext2"]
    panels = [("wikitext-2 perplexity increase over fp32 (%, log; 0.01 at the least)",
               lambda r: max(100 * (r["ppl"]["wikitext2"] / base - 1), 0.01)),
              ("wikitext-2 KL(fp32 || point) per token (nats, log; 1e-4 at the least)",
               lambda r: max(r["kl"]["wikitext2"], 1e-4) if r.get("kl") else None)]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    markers = {"llama.cpp (imatrix)": "s", "llmopt auto": "*", "llmopt, int8 head": "D", "llm-compressor": "x"}
    for ax, (ylabel, value) in zip(axes, panels, strict=True):
        series: dict[str, list[tuple[float, float, str]]] = {}
        for r in result["points"].values():
            label, y = r["label"], value(r)
            if y is None:
                continue
            fam = ("llama.cpp (imatrix)" if r["tool"] == "llama.cpp" else "llm-compressor" if r["tool"] == "llm-compressor"
                   else "llmopt, int8 head" if label.endswith("int8 head")
                   else "llmopt auto" if label.startswith("auto") else f"llmopt {label.split()[-1]}"
                   if label.startswith("W4A16") else "llmopt W8A16")
            series.setdefault(fam, []).append((r["bytes"] / 1e6, y, label))
        for fam, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(fam, "o"),
                    linestyle="-" if fam.startswith("llama.cpp") else "", label=fam,
                    markersize=10 if fam in markers else 6)
            for x, y, label in pts:
                short = (label.replace(" + int8 head", "").replace(" bits ", "b ").replace("W4A16 ", "")
                         .replace("llama.cpp ", "").replace("llm-compressor ", "llmc "))
                ax.annotate(short, (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.set_yscale("log")
        ax.set_xlabel("checkpoint MB (every tensor: embedding and head included)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}: size against held-out quality ({result['tokens']} tokens, our engine, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_doc(model: str, text: str) -> None:
    from llmopt.io import write_text_atomic

    begin, end = doc_markers(model)
    doc = DOC.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"error: {DOC} has no {begin!r} ... {end!r} markers")
    head, rest = doc.split(begin, 1)
    write_text_atomic(DOC, head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


# ------------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored per text")
    ap.add_argument("--num-samples", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--budgets", default="4.5,5,6", help="--scheme auto budgets (bits per weight of the linears)")
    ap.add_argument("--ladder", default=LADDER, help="llama.cpp types, each with the importance matrix")
    ap.add_argument("--only", default="", help="comma list of point labels to run (default: all)")
    ap.add_argument("--reuse", action="store_true", help="keep points already in the results file")
    ap.add_argument("--no-llmcompressor", action="store_true",
                    help="leave out llm-compressor's points (they need benchmarks/peers/install_llmcompressor.sh)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--work", type=Path, default=ROOT / "runs/quant-frontier")
    ap.add_argument("--write-doc", action="store_true", help="put the table into docs/QUANTIZE.md")
    args = ap.parse_args()

    import torch

    from llmopt.calibrate import CalibrateConfig, SavedStats, run_calibration
    from llmopt.io import write_text_atomic
    from llmopt.models.resolve import gguf_weights_dir, resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    work = args.work / args.model
    model_dir = Path(weights_dir(resolve_model(args.model)))
    tok = load_tokenizer(model_dir)
    texts = held_out_ids(tok, args.tokens)
    work.mkdir(parents=True, exist_ok=True)
    results_file = work / "frontier.json"

    calib = work / f"calib-{args.num_samples}x{SEQ}"
    if not (calib / "stats.safetensors").is_file():
        log(f"llmopt calibrate: {args.num_samples} x {SEQ} windows")
        run_calibration(CalibrateConfig(model=args.model, data=CALIB, num_samples=args.num_samples, seq_len=SEQ,
                                        seed=0, output=calib, overwrite=True, device="cpu"))
    calib_text = work / "calibration.txt"
    windows = SavedStats.load(calib / "stats.safetensors").windows.tolist()
    calib_text.write_text("".join(tok.decode(w, skip_special_tokens=True) for w in windows), encoding="utf-8")
    windows_json = work / "calibration-windows.json"  # the same windows as token ids, for llm-compressor
    windows_json.write_text(json.dumps({"windows": windows}))

    result: dict[str, Any] = json.loads(results_file.read_text()) if args.reuse and results_file.is_file() else {}
    result.setdefault("threads", args.threads)  # the threads the points ran with: updated when one runs
    result |= {"model": args.model, "tokens": args.tokens, "num_samples": args.num_samples,
               "cpu": cpu_name(), "torch": torch.__version__,
               "llamacpp": (LLAMACPP / "BUILD_INFO").read_text().splitlines()[0] if (LLAMACPP / "BUILD_INFO").is_file() else None}
    result.setdefault("points", {})
    save = lambda: write_text_atomic(results_file, json.dumps(result, indent=2))  # noqa: E731
    reference: dict[str, Any] = {}  # text -> the unquantized model's top-k log-probs, once a point needs them

    def baseline() -> dict[str, Any]:
        if not reference:
            from llmopt.eval.divergence import BaselineTopK

            log("scoring the unquantized model (fp32), keeping its top-k log-probs for the points' KL")
            reference.update({name: BaselineTopK() for name in texts})
            result["base"] = {"label": "unquantized (fp32 source)", "tool": "",
                              "bytes": checkpoint_bytes(model_dir), **score(model_dir, texts, reference, record=True)}
            save()
        return reference

    if "base" not in result:
        baseline()
    save()

    groups = group_sizes(model_dir)
    plan: dict[str, tuple[str, Any]] = {k: ("llmopt", v) for k, v in
                                        our_points(groups, [float(b) for b in args.budgets.split(",") if b]).items()}
    plan |= {f"llama.cpp {q}": ("llama.cpp", q) for q in args.ladder.split(",") if q}
    if not args.no_llmcompressor:
        plan |= {k: ("llm-compressor", v) for k, v in llmcompressor_points(groups).items()}
    only = set(filter(None, args.only.split(",")))
    plans: dict[tuple, Any] = {}  # one --scheme auto search per (method, head in the budget, symmetric)
    for label, (tool, what) in plan.items():
        if (only and label not in only) or label in result["points"]:
            continue
        log(f"{label}: quantizing")
        if tool == "llmopt":
            out = work / "ckpt"
            extra = quantize_ours(args.model, what, out, calib, plans)
        elif tool == "llm-compressor":
            out = work / "ckpt-llmcompressor"
            try:
                extra = quantize_llmcompressor(model_dir, what, out, windows_json, args.threads)
            except RuntimeError as e:  # a peer's failure is a finding, recorded; the other points go on
                log(f"{label}: {e}")
                result.setdefault("failed", {})[label] = str(e)
                save()
                continue
            result["llmcompressor"] = extra.pop("versions")
            result.get("failed", {}).pop(label, None)
        else:
            f32, imatrix = llamacpp_sources(model_dir, calib_text, len(windows), work, args.threads)
            out = work / f"{what}.gguf"
            extra = quantize_llamacpp(what, f32, imatrix, out, args.threads)
        log(f"{label}: scoring")
        # a GGUF is scored as llmopt loads one, but with the source's tokenizer: the ids are the same, and
        # transformers cannot rebuild Gemma 3's vocabulary from the GGUF convert_hf_to_gguf.py writes
        scored = gguf_weights_dir(out, model_dir) if out.suffix == ".gguf" else out
        row = {"label": label, "tool": tool, "bytes": checkpoint_bytes(out), **score(scored, texts, baseline()),
               **extra}
        shutil.rmtree(scored, ignore_errors=True)  # a GGUF's dequantized copy in llmopt's cache: hundreds of MB
        if out.is_file():
            out.unlink()
        result["points"][label] = row
        result["threads"] = args.threads
        save()
        log(f"{label}: {row['bytes'] / 1e6:.1f} MB, ppl {row['ppl']}, KL {row.get('kl')}")

    text = table(result)
    if result.get("failed"):
        text += "\n\nFailed: " + "; ".join(f"{k}: {v.split(' (log:')[0]}" for k, v in result["failed"].items())
    print(text)
    png = (ROOT / "docs" if args.write_doc else work) / f"quant-frontier-{args.model}.png"
    plot(result, png)
    log(f"plot: {png}")
    if args.write_doc:
        llmc = result.get("llmcompressor")
        peer = (f"; llm-compressor {llmc['llmcompressor']} (compressed-tensors {llmc['compressed_tensors']}, "
                f"transformers {llmc['transformers']})" if llmc else "")
        write_doc(args.model, f"{result['model']}, {result['tokens']} held-out tokens per text, {result['num_samples']} "
                  f"x {SEQ} calibration windows; {result['cpu']}, {result['threads']} threads, torch {result['torch']}; "
                  f"llama.cpp {result['llamacpp']}{peer}.\n\n{text}\n\n![{args.model} frontier](quant-frontier-{args.model}.png)")


if __name__ == "__main__":
    main()
