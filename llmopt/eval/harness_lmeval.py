"""Run a task with lm-evaluation-harness itself, as an independent check of our runner.

The model is the transformers implementation of the same checkpoint (`weights_dir`, so an alias such
as smollm2-135m is the same dequantized GGUF our engine loads) wrapped in lm-eval's HFLM, with the
tokenizer llmopt uses. The task is the same YAML, except that its data_files are made absolute: plain
lm-eval would resolve them against the working directory, llmopt against the YAML's folder. Only
float checkpoints are supported: lm-eval cannot run our quantized formats or our INT8 KV cache, which
is exactly why the primary runner is our engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.eval.metrics import MetricValue
from llmopt.eval.runner import TaskResult
from llmopt.eval.tasks import IGNORED_KEYS, Task, _read_yaml


def _task_dict(task: Task) -> dict[str, Any]:
    raw = _read_yaml(task.path)
    cfg = {k: v for k, v in raw.items() if k not in IGNORED_KEYS or k == "metadata"}
    cfg["task"] = task.name
    files = dict(cfg.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, (str, list)):
        files = {"train": files}
    cfg["dataset_kwargs"] = {"data_files": {
        split: [str((task.path.parent / n).resolve()) for n in ([names] if isinstance(names, str) else names)]
        for split, names in files.items()}}
    return cfg


def evaluate_task_lmeval(model: str | None, task: Task, limit: int | None = None, dtype: str = "float32",
                         device: str = "cpu", batch_size: int = 16) -> TaskResult:
    """`task` scored by lm-eval's own pipeline over transformers' model; same TaskResult shape as ours."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise LlmoptError("--harness lm-eval needs lm-eval: pip install 'lm-eval>=0.4'") from None
    import torch
    from transformers import AutoModelForCausalLM

    from llmopt.models.loader import parse_dtype
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    resolved = resolve_model(model)
    if resolved.quantization_config is not None:
        raise LlmoptError(f"{resolved.source}: lm-eval cannot run quantized checkpoints "
                          f"({resolved.quantization_config.get('quant_method')}); use --harness llmopt")
    directory = weights_dir(resolved)
    torch_dtype = parse_dtype(dtype, resolved.spec.dtype)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype).to(device).eval()
    lm = HFLM(pretrained=hf, tokenizer=load_tokenizer(directory), batch_size=batch_size, device=device)
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with torch.inference_mode():
        out = lm_eval.simple_evaluate(model=lm, tasks=[_task_dict(task)], limit=limit, log_samples=True,
                                      bootstrap_iters=1000, verbosity="ERROR")
    res = out["results"][task.name]
    n = len(out["samples"][task.name])
    metrics = {}
    for spec in task.metrics:
        value = res.get(f"{spec.metric},none")
        if value is None:
            raise LlmoptError(f"lm-eval did not report {spec.metric} for task {task.name}")
        stderr = res.get(f"{spec.metric}_stderr,none")
        metrics[spec.metric] = MetricValue(float(value), float(stderr) if isinstance(stderr, (int, float))
                                           else float("nan"), n)
    samples = []
    for s in sorted(out["samples"][task.name], key=lambda s: s["doc_id"]):
        row: dict[str, Any] = {"doc_id": s["doc_id"], **{m.metric: s.get(m.metric) for m in task.metrics}}
        resps = s.get("filtered_resps") or []
        if task.output_type == "multiple_choice":
            row["loglikelihoods"] = [float(r[0]) for r in resps]
        elif resps:
            row["prediction"] = resps[0]
        samples.append(row)
    return TaskResult(task.name, task.output_type, metrics, samples, time.perf_counter() - t0,
                      harness=f"lm-eval {lmeval_version()}")


def lmeval_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:
        return None

