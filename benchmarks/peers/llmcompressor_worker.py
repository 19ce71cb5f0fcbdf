"""Runs inside llm-compressor's own venv (.peers/llmcompressor): quantize one model with one modifier.

Reads a job JSON {model_dir, method: rtn|gptq|awq, num_bits (4 or 8; default 4), group_size (None: one scale
per output channel), symmetric, ignore, dtype (the model's load dtype, default float32), windows (path of a
JSON file {"windows": [[ids]]}, for gptq/awq), out_dir, threads, options: {actorder, dampening_frac,
block_size, observer, ...}} and writes {"ok": true, "wall_s", "cpu_s", "versions": {...}, "recipe": "..."} or
{"ok": false, "error": "one line"}. The checkpoint is saved compressed (pack-quantized) into out_dir.
It imports nothing from llmopt, so it runs under llm-compressor's Python and dependencies alone.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import traceback


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _scheme(job: dict) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    opts = job.get("options", {})
    group = job.get("group_size")
    args = {"num_bits": job.get("num_bits", 4), "type": "int", "symmetric": job["symmetric"],
            "strategy": "group" if group else "channel", "group_size": group, "dynamic": False}
    if opts.get("observer"):
        args["observer"] = opts["observer"]
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))}


def _recipe(job: dict):
    import torch
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    opts = job.get("options", {})
    groups = _scheme(job)
    ignore = job.get("ignore", ["lm_head"])
    if job["method"] == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if job["method"] == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=ignore, block_size=opts.get("block_size", 128),
                             dampening_frac=opts.get("dampening_frac", 0.01),
                             actorder=opts.get("actorder", "static"))]
    if job["method"] == "awq":
        from llmcompressor.modifiers.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        if not torch.accelerator.is_available():
            # llm-compressor 0.14's AWQ pins its cached activations for host-to-device copies, which
            # raises "Cannot access accelerator device when none is available" on a CPU-only machine;
            # pinning changes no value, so skip it
            IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None

        kw = {k: opts[k] for k in ("duo_scaling", "n_grid") if k in opts}
        return [AWQModifier(ignore=ignore, **kw), QuantizationModifier(config_groups=groups, ignore=ignore)]
    raise ValueError(f"unknown method {job['method']!r}")


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    try:
        import compressed_tensors
        import llmcompressor
        import torch
        import transformers
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(job.get("threads", torch.get_num_threads()))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=getattr(torch, job.get("dtype", "float32")))
        tok = AutoTokenizer.from_pretrained(job["model_dir"])
        recipe = _recipe(job)
        kw: dict = {}
        if job["method"] != "rtn":
            from datasets import Dataset

            windows = json.load(open(job["windows"]))["windows"]
            ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
            kw = {"dataset": ds, "num_calibration_samples": len(windows), "max_seq_length": len(windows[0]),
                  "shuffle_calibration_samples": False}
        t, c = time.perf_counter(), _cpu_s()
        oneshot(model=model, recipe=recipe, **kw)
        wall, cpu = time.perf_counter() - t, _cpu_s() - c
        model.save_pretrained(job["out_dir"], save_compressed=True)
        tok.save_pretrained(job["out_dir"])
        result = {"ok": True, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                  "recipe": "; ".join(repr(m) for m in recipe),
                  "versions": {"llmcompressor": llmcompressor.__version__,
                               "compressed_tensors": compressed_tensors.__version__,
                               "torch": torch.__version__, "transformers": transformers.__version__}}
    except BaseException as e:  # any failure is a result the driver reports
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        result = {"ok": False, "error": f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]}
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
