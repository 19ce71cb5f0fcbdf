"""lm-evaluation-harness's `local-completions` model against a real `llmopt serve` on loopback.

lm-eval scores each (context, continuation) by sending the token ids with `echo: true, logprobs: 1,
max_tokens: 1` and summing `token_logprobs[ctxlen:-1]`; greediness compares each token's logprob with
the best of its `top_logprobs`. Through the server, on the real SmolLM2 and the shipped kb_mc task, it
must reach the same accuracy as `llmopt eval --task` in process, with per-choice log-likelihoods that
agree closely (the same engine scores both; only the batch around each prompt differs).
"""

from __future__ import annotations

import logging
import time

import pytest

from llmopt.eval.engines import EngineOptions, build_llm
from llmopt.eval.harness_lmeval import _task_dict
from llmopt.eval.runner import evaluate_task
from llmopt.eval.tasks import load_task
from llmopt.models.resolve import resolve_model, weights_dir
from tests.conftest import requires_smollm2
from tests.serve._server import MODEL_NAME, serve

pytest.importorskip("lm_eval")

LIMIT = 12
NAME = "smollm2-135m"


@pytest.mark.slow
@requires_smollm2
def test_lm_eval_local_completions_through_the_server_matches_llmopt_eval():
    import lm_eval

    task = load_task("calibration_data/kb_mc.yaml")
    llm = build_llm(NAME, EngineOptions())
    t0 = time.perf_counter()
    ours = evaluate_task(llm, task, limit=LIMIT)
    in_process_s = time.perf_counter() - t0
    del llm
    model_dir = weights_dir(resolve_model(NAME))
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with serve(None, engine_kw={"kv_cache_memory": "256MiB", "num_threads": None}) as srv:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"base_url={srv.v1}/completions,model={MODEL_NAME},tokenizer_backend=huggingface,"
                        f"tokenizer={model_dir},num_concurrent=1,max_retries=1"),
            tasks=[_task_dict(task)], limit=LIMIT, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
        served_s = time.perf_counter() - t0
        assert srv.state.admission.waiting == 0 and not srv.state.engine_loop.active
    res = out["results"][task.name]
    samples = sorted(out["samples"][task.name], key=lambda s: s["doc_id"])
    assert len(samples) == ours.n == LIMIT
    worst = 0.0
    for mine, theirs in zip(ours.samples, samples, strict=True):
        got = [float(r[0]) for r in theirs["filtered_resps"]]
        assert got == pytest.approx(mine["loglikelihoods"], abs=1e-3)
        worst = max(worst, *(abs(a - b) for a, b in zip(got, mine["loglikelihoods"], strict=True)))
        assert (theirs["acc"], theirs["acc_norm"]) == (mine["acc"], mine["acc_norm"])
    assert res["acc,none"] == pytest.approx(ours.metrics["acc"].value)
    assert res["acc_norm,none"] == pytest.approx(ours.metrics["acc_norm"].value)
    print(f"kb_mc limit {LIMIT} ({4 * LIMIT} choices): acc {res['acc,none']:.3f}, max |loglik diff| {worst:.2e}; "
          f"scoring: llmopt eval in process {in_process_s:.1f}s, lm-eval local-completions through llmopt serve "
          f"{served_s:.1f}s")
