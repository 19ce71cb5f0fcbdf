"""`llmopt run` writes `summary.html` beside `summary.md`: stages, every gate with its interval and verdict,
the memory plan, the eval report and the benchmark's figures, read back from the run directory (a skipped
stage shows what it measured last time)."""

from __future__ import annotations

from pathlib import Path

from html_check import assert_figures, assert_self_contained, read_page
from rich.console import Console

from llmopt.recipe.runner import RunRequest, run_recipe
from llmopt.recipe.summary import write_summary
from tests.cli_runner import run_cli
from tests.eval.eval_helpers import write_task

RECIPE = """model: {model}
description: plan, eval and bench of a tiny model, for the HTML summary
vram_plan:
  seq_len: 256
  batch: 4
  gpu_memory: 4GiB
eval:
  baseline: {model}
  ppl_data: text.txt
  seq_len: 64
  tasks: [t/tiny_mc.yaml]
  device: cpu
  gates: ["ppl_increase_pct<=1@95", "acc_drop<=50@95", "ppl<=1"]
serve:
  engine: {{device: cpu, dtype: float32, kv_cache_memory: 8MiB, num_threads: 1}}
bench:
  input_len: 8
  output_len: 4
  num_prompts: 3
  concurrency: [1, 2]
  warmup: 0
  gates: ["failed<=0"]
"""
SECTIONS = {"stages", "gates", "memory-plan", "eval-metrics", "runs", "latency", "curve"}
FIGURES = ["fig-memory-plan", "fig-cdf-ttft", "fig-cdf-tpot", "fig-cdf-e2el", "fig-curve"]


def _recipe(folder: Path, model: Path) -> Path:
    (folder / "text.txt").write_text("A KV cache stores keys and values for every token. " * 30)
    write_task(folder / "t")
    path = folder / "recipe.yaml"
    path.write_text(RECIPE.format(model=model))
    return path


def test_summary_html_of_a_run_and_its_rerun(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = _recipe(tmp_path, tiny_llama)
    run_dir = tmp_path / "run"
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir))
    assert code == 1, err  # ppl<=1 fails on a random model; the summary is written with it
    page = read_page(run_dir / "summary.html")
    assert_self_contained(page)
    assert page.title == f"llmopt run: {recipe}"
    assert set(page.sections) == SECTIONS
    assert_figures(page, FIGURES)
    # the gates of every stage: the plan's fit, eval's three (two on intervals), bench's one
    assert page.verdicts == ["PASS", "PASS", "PASS", "FAIL", "PASS"]
    for text in ("vram_plan: fits==1", "eval: ppl_increase_pct<=1@95", "eval: acc_drop<=50@95", "eval: ppl<=1",
                 "bench: failed<=0", "upper bound", "memory per GPU", "Knee ("):
        assert text in page.text, text
    # a rerun skips every stage and still shows what they measured
    report = run_recipe(RunRequest(recipe=recipe, out=run_dir), Console(quiet=True))
    assert {s.status for s in report.stages} == {"skipped"}
    again = read_page(run_dir / "summary.html")
    assert set(again.sections) == SECTIONS and again.verdicts == page.verdicts
    assert_figures(again, FIGURES)


def test_summary_html_of_a_plan_only_run(tiny_llama, tmp_path):
    recipe = _recipe(tmp_path, tiny_llama)
    report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "plan", stages="vram_plan"), Console(quiet=True))
    assert report.exit_code == 0
    page = read_page(tmp_path / "plan" / "summary.html")
    assert_self_contained(page)
    assert set(page.sections) == {"stages", "gates", "memory-plan"}
    assert_figures(page, ["fig-memory-plan"])
    assert "not selected" in page.text
    # an artifact the page cannot read (here: an older plan format) is named, and the summary still written
    (tmp_path / "plan" / "vram_plan" / "plan.json").write_text('{"model": "x"}')
    write_summary(tmp_path / "plan", report)
    page = read_page(tmp_path / "plan" / "summary.html")
    assert set(page.sections) == {"stages", "gates"} and "Not shown: vram_plan/plan.json (KeyError)" in page.text
    (tmp_path / "plan" / "vram_plan" / "plan.json").unlink()
    write_summary(tmp_path / "plan", report)
    assert "Not shown: vram_plan/plan.json (missing)" in read_page(tmp_path / "plan" / "summary.html").text
