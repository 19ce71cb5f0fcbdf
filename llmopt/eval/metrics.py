"""Per-document metrics and their aggregation, with lm-eval's definitions.

- acc: the choice with the highest summed continuation log-likelihood is the gold one.
- acc_norm: the same after dividing each log-likelihood by the choice's length in characters
  (`len(choice)`, without the target delimiter; lm_eval ConfigurableTask.process_results).
- acc_bytes: divided by the UTF-8 byte length instead.
- exact_match: prediction == reference after `regexes_to_ignore` (re.sub with ""), `ignore_case`
  (lower), `ignore_punctuation` and `ignore_numbers` (string.punctuation / string.digits removed), in
  that order (lm_eval.api.metrics.exact_match_hf_evaluate); a list of references matches if any does.
Ties go to the first choice (numpy argmax). Aggregation is the mean, and its standard error is the
sample standard deviation (ddof=1) over sqrt(n), lm-eval's `mean_stderr`.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmopt.eval.loglikelihood import Scored

# metrics that are fractions of 1 (reports show them as percentages; a gate's threshold must be one too), where
# their drops against a baseline (`acc_drop`) are in points
FRACTION_METRICS = ("acc", "acc_norm", "acc_bytes", "exact_match", "top1_agreement")


def is_fraction(name: str) -> bool:
    """Whether `name` (bare, or `task.metric`) is one of FRACTION_METRICS."""
    return name.rsplit(".", 1)[-1] in FRACTION_METRICS


def multiple_choice_scores(scored: Sequence[Scored], choices: Sequence[str],
                           gold: int | list[int]) -> dict[str, float]:
    lls = np.array([s.logprob for s in scored], dtype=np.float64)
    preds = {
        "acc": int(np.argmax(lls)),
        "acc_norm": int(np.argmax(lls / np.array([float(len(c)) for c in choices]))),
        "acc_bytes": int(np.argmax(lls / np.array([float(len(c.encode("utf-8"))) for c in choices]))),
    }
    golds = gold if isinstance(gold, list) else [gold]
    return {k: 1.0 if p in golds else 0.0 for k, p in preds.items()}


def _normalize(text: str, regexes_to_ignore: Sequence[str] | None, ignore_case: bool,
               ignore_punctuation: bool, ignore_numbers: bool) -> str:
    for pattern in regexes_to_ignore or ():
        text = re.sub(pattern, "", text)
    if ignore_case:
        text = text.lower()
    if ignore_punctuation:
        text = text.translate(str.maketrans("", "", string.punctuation))
    if ignore_numbers:
        text = text.translate(str.maketrans("", "", string.digits))
    return text


def exact_match(prediction: str, references: str | Sequence[str], *, regexes_to_ignore: Sequence[str] | None = None,
                ignore_case: bool = False, ignore_punctuation: bool = False, ignore_numbers: bool = False) -> float:
    refs = [references] if isinstance(references, str) else list(references)
    p = _normalize(prediction, regexes_to_ignore, ignore_case, ignore_punctuation, ignore_numbers)
    return 1.0 if any(p == _normalize(r, regexes_to_ignore, ignore_case, ignore_punctuation, ignore_numbers)
                      for r in refs) else 0.0


def mean_stderr(values: Sequence[float]) -> float:
    """lm-eval's mean_stderr: sqrt(sum((x - mean)^2) / (n - 1)) / sqrt(n); NaN below two samples."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


@dataclass(frozen=True)
class MetricValue:
    value: float
    stderr: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> MetricValue:
        return cls(sum(values) / len(values) if values else float("nan"), mean_stderr(values), len(values))
