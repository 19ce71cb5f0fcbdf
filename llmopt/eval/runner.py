"""Run one lm-eval-format task through an llmopt LLM and aggregate its metrics.

multiple_choice: every (context, delimiter + choice) pair of every document is scored in one
batched teacher-forced pass (`score_continuations`); generate_until: all contexts are generated
together through `LLM.generate`. Per-document results are kept (`samples`) so a comparison can say
which items a candidate got wrong that the baseline got right.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from llmopt.engine.llm import LLM
from llmopt.eval.generation import generate_until
from llmopt.eval.loglikelihood import score_continuations
from llmopt.eval.metrics import MetricValue, exact_match, multiple_choice_scores
from llmopt.eval.tasks import Task


@dataclass
class TaskResult:
    task: str
    output_type: str
    metrics: dict[str, MetricValue]
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    harness: str = "llmopt"

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "output_type": self.output_type, "n": self.n, "harness": self.harness,
                "seconds": round(self.seconds, 3),
                "metrics": {k: {"value": v.value, "stderr": v.stderr} for k, v in self.metrics.items()}}

    @property
    def n(self) -> int:
        return next(iter(self.metrics.values())).n if self.metrics else 0


def evaluate_task(llm: LLM, task: Task, limit: int | None = None,
                  max_batch_tokens: int | None = None) -> TaskResult:
    t0 = time.perf_counter()
    reqs = task.requests(limit)
    names = [m.metric for m in task.metrics]
    per_metric: dict[str, list[float]] = {m: [] for m in names}
    samples: list[dict[str, Any]] = []
    if task.output_type == "multiple_choice":
        pairs = [(r.context, c) for r in reqs for c in r.continuations]
        scored = score_continuations(llm.engine, pairs, max_batch_tokens=max_batch_tokens)
        k = 0
        for r in reqs:
            mine = scored[k:k + len(r.continuations)]
            k += len(r.continuations)
            s = multiple_choice_scores(mine, r.choices, r.gold)  # type: ignore[arg-type]
            for m in names:
                per_metric[m].append(s[m])
            samples.append({"doc": r.doc, "gold": r.gold, "loglikelihoods": [x.logprob for x in mine],
                            **{m: s[m] for m in names}})
    else:
        preds = generate_until(llm, [r.context for r in reqs], task.generation)
        for r, pred in zip(reqs, preds, strict=True):
            row: dict[str, Any] = {"doc": r.doc, "gold": r.gold, "prediction": pred}
            for spec in task.metrics:
                v = exact_match(pred, r.gold, regexes_to_ignore=spec.regexes_to_ignore,  # type: ignore[arg-type]
                                ignore_case=spec.ignore_case, ignore_punctuation=spec.ignore_punctuation,
                                ignore_numbers=spec.ignore_numbers)
                per_metric[spec.metric].append(v)
                row[spec.metric] = v
            samples.append(row)
    metrics = {m: MetricValue.of(v) for m, v in per_metric.items()}
    return TaskResult(task.name, task.output_type, metrics, samples, time.perf_counter() - t0)
