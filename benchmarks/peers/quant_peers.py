"""llmopt's W4A16 quantizers against llm-compressor's, method by method, on the same model and data.

    benchmarks/peers/install_llmcompressor.sh          # once: llm-compressor in .peers/llmcompressor
    .venv/bin/python benchmarks/peers/quant_peers.py [--only rtn gptq awq] [--md out.md] [--json out.json]
    make quant-peers                                   # both, every default row, table into docs/QUANTIZE.md

One protocol for every checkpoint:

* calibration windows (token ids) are drawn once with `llmopt calibrate` (default: general prose + kb
  texts mixed 1:1, 128 x 512, seed 0), kept in its calibration directory, and written to
  `windows.json`; llmopt quantizes with `--calib` on that directory, llm-compressor gets the same ids as a
  tokenized dataset (no shuffling, no re-tokenization);
* llm-compressor runs in its own venv through `llmcompressor_worker.py` (which imports nothing from
  llmopt) on the same fp32 model folder llmopt loads; llmopt runs here through its library
  (`quantize_model`). Both write compressed-tensors pack-quantized checkpoints;
* every checkpoint is decompressed by the compressed-tensors library (installed here) into dense
  weights, which replace the weights of one transformers fp32 model of the original (every other tensor
  of the checkpoint, e.g. AWQ's rescaled norms, is loaded too); perplexity is scored teacher-forced on the
  first --tokens tokens of wikitext-2 validation and of tinyshakespeare, in windows of --seq-len.

The table: perplexity per domain, change vs fp32, share of llmopt RTN's damage (llmopt's RTN is the
reference), quantize wall time (the library call: `oneshot` / `quantize_model`, which includes loading
and writing) and the checkpoint's size on disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from llmopt.io import write_text_atomic  # noqa: E402

MODEL = "smollm2-135m"
DATA = {"wikitext2": ROOT.parent / "shared/data/wikitext2-valid.txt",
        "tinyshakespeare": ROOT.parent / "shared/data/tinyshakespeare.txt"}
CALIB = [str(ROOT / "calibration_data/general_prose.jsonl"), str(ROOT / "calibration_data/kb_calibration.jsonl")]
WORKER = Path(__file__).with_name("llmcompressor_worker.py")
INSTALL = Path(__file__).with_name("install_llmcompressor.sh")
DOC = ROOT / "docs/QUANTIZE.md"
DOC_MARKERS = ("<!-- quant-peers:begin (written by benchmarks/peers/quant_peers.py --write-doc) -->",
               "<!-- quant-peers:end -->")

# label -> (tool, method, options); llmopt options are QuantizeConfig fields, llm-compressor options go
# to the worker (GPTQModifier's actorder default is "static": act-order with static groups, as ours
# since issue #32; AWQModifier uses its default mappings for llama, then QuantizationModifier).
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llm-compressor RTN": ("llmcompressor", "rtn", {}),
    "llm-compressor RTN (mse observer)": ("llmcompressor", "rtn", {"observer": "mse"}),
    "llmopt RTN": ("llmopt", "rtn", {}),
    "llm-compressor GPTQ (actorder static)": ("llmcompressor", "gptq", {"actorder": "static"}),
    "llmopt GPTQ act-order": ("llmopt", "gptq", {"act_order": True}),
    "llm-compressor AWQ": ("llmcompressor", "awq", {}),
    "llmopt AWQ": ("llmopt", "awq", {}),
}
# more rows, run only when --only names them
EXTRA: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llm-compressor GPTQ (no actorder)": ("llmcompressor", "gptq", {"actorder": None}),
    "llmopt GPTQ": ("llmopt", "gptq", {"act_order": False}),
    "llmopt GPTQ act-order mse": ("llmopt", "gptq", {"act_order": True, "mse": True}),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_dir() -> Path:
    from llmopt.models.resolve import resolve_model, weights_dir

    return Path(weights_dir(resolve_model(MODEL)))


def eval_windows(tokenizer, path: Path, tokens: int, seq_len: int) -> list[list[int]]:
    ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: (min(tokens, len(ids)) // seq_len) * seq_len]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]


def calibration(work: Path, args: argparse.Namespace, num_samples: int) -> tuple[Path, Path]:
    """`llmopt calibrate` once per size; returns (calib dir, windows.json with the same token ids)."""
    from llmopt.calibrate import CalibrateConfig, SavedStats, run_calibration

    calib = work / f"calib-{num_samples}x{args.calib_seq_len}"
    windows = calib.with_suffix(".windows.json")
    if not (calib / "stats.safetensors").is_file():
        log(f"drawing {num_samples} x {args.calib_seq_len} calibration windows")
        run_calibration(CalibrateConfig(model=MODEL, data=args.calib, num_samples=num_samples,
                                        seq_len=args.calib_seq_len, seed=args.seed, output=calib,
                                        overwrite=True, device="cpu"))
    w = SavedStats.load(calib / "stats.safetensors").windows
    windows.write_text(json.dumps({"source": args.calib, "seed": args.seed, "windows": w.tolist()}))
    return calib, windows


def run_llmopt(method: str, opts: dict[str, Any], out: Path, calib: Path, args: argparse.Namespace) -> dict:
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    kw = dict(opts)
    if method != "rtn":
        kw["calib"] = calib
    cfg = QuantizeConfig(model=MODEL, scheme="w4a16", group_size=args.group_size, method=method, output=out,
                         overwrite=True, device="cpu", **kw)
    t = time.perf_counter()
    quantize_model(cfg)
    return {"wall_s": round(time.perf_counter() - t, 1)}


def llmcompressor_job(venv: Path, job: dict[str, Any], out: Path) -> dict:
    """Run one job (llmcompressor_worker.py's docstring) in llm-compressor's venv; its result, or a RuntimeError
    naming the log. The job and result files and the log sit next to `out`."""
    py = venv / "bin/python"
    if not py.is_file():
        raise SystemExit(f"error: {py} missing; run {INSTALL.relative_to(ROOT)} first")
    job_path, res_path = out.with_suffix(".job.json"), out.with_suffix(".result.json")
    res_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(out.with_suffix(".log"), "w") as logf:
        subprocess.run([str(py), str(WORKER), str(job_path), str(res_path)], stdout=logf, stderr=subprocess.STDOUT,
                       env=env, check=False)
    res = json.loads(res_path.read_text()) if res_path.is_file() else {"ok": False, "error": "worker died"}
    if not res.get("ok"):
        raise RuntimeError(f"llm-compressor {job['method']}: {res.get('error')} (log: {out.with_suffix('.log')})")
    return res


def run_llmcompressor(method: str, opts: dict[str, Any], out: Path, windows: Path, args: argparse.Namespace) -> dict:
    job = {"model_dir": str(model_dir()), "method": method, "group_size": args.group_size, "symmetric": True,
           "ignore": ["lm_head"], "windows": str(windows), "out_dir": str(out), "threads": args.threads,
           "options": opts}
    return llmcompressor_job(ROOT / args.llmcompressor_venv, job, out)


def dense_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a compressed-tensors checkpoint, quantized linears decompressed by the library."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file

    qcfg = QuantizationConfig.model_validate(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")})
    state = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in quantized or k.endswith(".bias")}
    for hf in quantized:
        group = next(g for g in qcfg.config_groups.values()
                     if any(t == "Linear" or match_name(hf, t) for t in g.targets))
        comp = BaseCompressor.get_value_from_registry(group.format or qcfg.format)
        local = {k[len(hf) + 1:]: v for k, v in tensors.items() if k.startswith(hf + ".") and not k.endswith(".bias")}
        state[f"{hf}.weight"] = comp.decompress(local, group)["weight"]
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


class Scorer:
    """One transformers fp32 model of the original; each checkpoint's dense weights are loaded into it."""

    def __init__(self, windows: dict[str, list[list[int]]], threads: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32).eval()
        self.original = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.windows = windows
        self.threads = threads

    @torch.inference_mode()
    def score(self, ckpt: Path | None) -> dict[str, float]:
        """Perplexity per domain, on one intra-op thread: on a shared 2-core machine a second OpenMP
        thread made it 5x slower (8 s vs 1.5 s CPU per 512-token window)."""
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._score(ckpt)
        finally:
            torch.set_num_threads(prev)

    def _score(self, ckpt: Path | None) -> dict[str, float]:
        self.model.load_state_dict(self.original)
        if ckpt is not None:
            state = dense_state(ckpt)
            own = self.model.state_dict()
            unknown = [k for k in state if k not in own]
            if unknown:
                raise RuntimeError(f"{ckpt}: tensors the model does not have: {unknown[:4]}")
            missing = [k for k in own if k not in state and k != "lm_head.weight"]
            if missing:
                raise RuntimeError(f"{ckpt}: no value for {missing[:4]}")
            self.model.load_state_dict(state, strict=False)
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()
        out = {}
        for name, seqs in self.windows.items():
            nll, n = 0.0, 0
            for s in seqs:
                ids = torch.tensor([s])
                logits = self.model(ids).logits[0, :-1].double()
                nll -= logits.log_softmax(-1).gather(1, ids[0, 1:, None]).sum().item()
                n += len(s) - 1
            out[name] = math.exp(nll / n)
        return out


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    domains = list(results["domains"])
    base = rows.get("fp32", {}).get("ppl", {})
    ref = rows.get("llmopt RTN", {}).get("ppl", {})
    head = "| variant | " + " | ".join(f"{d} ppl | Δ vs fp32 | share of llmopt RTN Δ" for d in domains)
    head += " | quantize wall s | size MB |"
    lines = [head, "|---|" + "---|---|---|" * len(domains) + "---|---|"]
    for label, r in rows.items():
        cells = [label]
        for d in domains:
            p = r.get("ppl", {}).get(d)
            if p is None:
                cells += ["", "", ""]
                continue
            cells.append(f"{p:.3f}")
            cells.append(f"{(p / base[d] - 1) * 100:+.1f}%" if d in base and label != "fp32" else "")
            share = (p - base[d]) / (ref[d] - base[d]) if d in base and d in ref and ref[d] > base[d] else None
            cells.append(f"{share:.2f}" if share is not None and label != "fp32" else "")
        cells.append(str(r.get("wall_s", "")))
        cells.append(f"{r['size_mb']:.1f}" if "size_mb" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None,
                    help="variants: whole labels select exactly those, otherwise substrings (e.g. rtn gptq awq) of "
                         "the default rows and the extra ones; fp32 always runs")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768, help="scored tokens per domain")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib", nargs="+", default=CALIB, help="calibration sources (PATH or PATH:weight)")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration windows for GPTQ")
    ap.add_argument("--awq-num-samples", type=int, default=16,
                    help="calibration windows for AWQ (llm-compressor's AWQ reruns whole attention/MLP blocks on every "
                         "window for each of its 20 grid points: 64 x 512 took over an hour on 2 CPU cores)")
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--score-threads", type=int, default=1, help="intra-op threads for the fp32 scoring")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llmopt-quant-peers"))
    ap.add_argument("--reuse", action="store_true",
                    help="keep checkpoints (and their scores on the same windows) already in --work-dir")
    ap.add_argument("--llmcompressor-venv", default=".peers/llmcompressor")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None, help="write the table, versions and command as markdown")
    ap.add_argument("--write-doc", action="store_true",
                    help="also write them into docs/QUANTIZE.md, between the quant-peers markers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    everything = {**VARIANTS, **EXTRA}
    exact = args.only is not None and all(o in everything for o in args.only)  # whole labels: exactly those
    plan = VARIANTS if args.only is None else {
        k: v for k, v in everything.items()
        if (k in args.only if exact else any(o.lower() in k.lower() for o in args.only))}

    from transformers import AutoTokenizer

    import llmopt

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    windows = {name: eval_windows(tok, path, args.tokens, args.seq_len) for name, path in DATA.items()}
    results: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]]),
        "versions": {"llmopt": llmopt.__version__, "torch": torch.__version__}, "domains": {
            k: {"windows": len(v), "tokens": sum(map(len, v))} for k, v in windows.items()},
        "calibration": {"sources": args.calib, "num_samples": {"gptq": args.num_samples, "awq": args.awq_num_samples},
                        "seq_len": args.calib_seq_len, "seed": args.seed},
        "group_size": args.group_size, "rows": {}}
    calibs = {m: calibration(work, args, args.awq_num_samples if m == "awq" else args.num_samples)
              for m in {m for _, m, _ in plan.values() if m != "rtn"}}
    scorer = Scorer(windows, args.score_threads)
    key = f"{args.tokens}x{args.seq_len}"  # scores are reused (--reuse) only for the same scored windows
    fp32_cache = work / f"fp32.{key}.json"
    if args.reuse and fp32_cache.is_file():
        results["rows"]["fp32"] = json.loads(fp32_cache.read_text())
    else:
        log("scoring fp32")
        results["rows"]["fp32"] = {"ppl": scorer.score(None)}
        fp32_cache.write_text(json.dumps(results["rows"]["fp32"]))
    for label, (tool, method, opts) in plan.items():
        out = work / label.replace(" ", "_").replace("(", "").replace(")", "")
        # the calibration windows a checkpoint was made from: --reuse keeps it only for the same ones
        calib_key = None if method == "rtn" else calibs[method][0].name
        row: dict[str, Any] = {"tool": tool, "method": method, "options": opts, "calibration": calib_key}
        prev = json.loads(out.with_suffix(".row.json").read_text()) if out.with_suffix(".row.json").is_file() else {}
        if (args.reuse and (out / "config.json").is_file() and "wall_s" in prev
                and prev.get("calibration") == calib_key):
            row.update({k: prev[k] for k in ("wall_s", "versions", "scores") if k in prev})
        else:
            log(f"quantizing: {label}")
            if tool == "llmopt":
                row.update(run_llmopt(method, opts, out, calibs.get(method, (None,))[0], args))
            else:
                res = run_llmcompressor(method, opts, out, calibs.get(method, (None, None))[1], args)
                row.update({"wall_s": res["wall_s"], "versions": res["versions"]})
            out.with_suffix(".row.json").write_text(json.dumps(row))
        if "versions" in row:
            results["versions"].update({f"{k} (peer venv)": v for k, v in row["versions"].items()})
        row["size_mb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
        scores = row.setdefault("scores", {})
        if key not in scores:
            scores[key] = scorer.score(out)
            out.with_suffix(".row.json").write_text(json.dumps(row))
        row["ppl"] = scores[key]
        log(f"{label}: " + ", ".join(f"{d} {p:.3f}" for d, p in row["ppl"].items()))
        results["rows"][label] = row
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    table = render(results)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    dom = ", ".join(f"{k} {v['tokens']} tokens" for k, v in results["domains"].items())
    ver = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    calib = ", ".join(str(Path(c).relative_to(ROOT)) if Path(c).is_relative_to(ROOT) else c for c in args.calib)
    md = (f"{table}\n\nCommand: `{results['command']}`\n\nScored: {dom} (windows of {args.seq_len}); "
          f"calibration: GPTQ {args.num_samples}, AWQ {args.awq_num_samples} windows of {args.calib_seq_len} from "
          f"{calib} (seed {args.seed}); versions: {ver}.\n")
    if args.md:
        write_text_atomic(args.md, md)
    if args.write_doc:
        from peers_plan import replace_doc_section

        write_text_atomic(DOC, replace_doc_section(DOC.read_text(), md, "### Against llm-compressor", DOC_MARKERS))
        print(f"wrote the llm-compressor table of {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
