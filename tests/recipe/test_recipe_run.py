"""Running recipes on the tiny random-weight llama: every stage, skip-on-unchanged, gates, atomicity."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from recipe_helpers import DATA, LLAMA_CONFIG, write
from rich.console import Console

from llmopt.errors import LlmoptError
from llmopt.recipe.hashing import tree_fingerprint
from llmopt.recipe.issues import RecipeInvalid
from llmopt.recipe.runner import RunRequest, run_recipe
from llmopt.recipe.state import load_state
from llmopt.recipe.validate import validate_recipe
from tests.cli_runner import run_cli

STAGES = ["vram_plan", "calibrate", "quantize", "eval", "serve", "bench"]

TINY = """model: {model}
description: every stage on a tiny model
vram_plan:
  seq_len: 256
  batch: 4
  gpu_memory: 4GiB
  gates: ["max_concurrent_sequences>=4"]
calibration:
  data: [{data}/kb_calibration.jsonl]
  num_samples: 4
  seq_len: 32
  device: cpu
quantize:
  scheme: w8a16
  device: cpu
eval:
  baseline: {model}
  ppl_data: text.txt
  seq_len: 64
  device: cpu
  gates: ["ppl_increase_pct<=5"]
serve:
  engine: {{device: cpu, dtype: float32, kv_cache_memory: 8MiB, num_threads: 1}}
  smoke: true
bench:
  input_len: 16
  output_len: 4
  num_prompts: 4
  concurrency: [1, 2]
  warmup: 0
  gates: ["output_throughput>=0.01", "failed<=0"]
"""


def make_recipe(directory: Path, model: Path | str, **replace: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "text.txt").write_text("A KV cache stores keys and values for every token. " * 40)
    text = TINY.format(model=model, data=DATA)
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return write(directory, text)


def quiet() -> Console:
    return Console(width=200, quiet=True)


def temp_leftovers(run_dir: Path) -> list[str]:
    return [p.name for p in run_dir.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def statuses(run_dir: Path) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary(run_dir)["stages"]}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_llama) -> tuple[Path, Path]:
    """One complete run (every stage) through the library; tests copy the run directory to change it."""
    base = tmp_path_factory.mktemp("recipe-run")
    recipe = make_recipe(base, tiny_llama)
    console = Console(width=250, file=io.StringIO())
    report = run_recipe(RunRequest(recipe=recipe, out=base / "run"), console)
    (base / "console.txt").write_text(console.file.getvalue())
    assert report.exit_code == 0, report.to_json()
    return recipe, base / "run"


def copy_run(full_run, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the recipe folder (recipe, its text file, the run directory) that a test may change."""
    recipe, run_dir = full_run
    shutil.copytree(recipe.parent, tmp_path / "copy")
    return tmp_path / "copy" / recipe.name, tmp_path / "copy" / run_dir.name


def test_full_run_writes_every_artifact(full_run):
    recipe, run_dir = full_run
    data = summary(run_dir)
    assert data["recipe"] == str(recipe)
    assert data["passed"] and data["exit_code"] == 0 and data["failed_gates"] == []
    assert [s["name"] for s in data["stages"]] == STAGES
    assert all(s["status"] == "ran" and s["duration_s"] >= 0 for s in data["stages"])
    assert {s["reason"] for s in data["stages"]} == {"no previous run"}
    for rel in ("vram_plan/plan.json", "calibrate/manifest.json", "calibrate/stats.safetensors",
                "quantize/config.json", "quantize/model.safetensors", "quantize/quantization_report.json",
                "eval/eval.json", "eval/eval.md", "serve/smoke.json", "bench/bench.json", "bench/bench.md",
                "bench/bench.png", "state.json", "summary.md", "versions.json", "recipe.resolved.yaml"):
        assert (run_dir / rel).is_file(), rel
    assert "quantization_config" in json.loads((run_dir / "quantize/config.json").read_text())
    assert temp_leftovers(run_dir) == []
    by_name = {s["name"]: s for s in data["stages"]}
    assert by_name["quantize"]["metrics"]["compression"] > 1.5
    assert by_name["calibrate"]["metrics"]["windows"] == 4
    assert by_name["serve"]["metrics"]["completion_tokens"] > 0
    assert by_name["bench"]["metrics"]["levels"] == 2
    gates = {g["gate"]: g["passed"] for s in data["stages"] for g in s["gates"]}
    assert gates == {"fits==1": True, "max_concurrent_sequences>=4": True, "ppl_increase_pct<=5": True,
                     "output_throughput>=0.01": True, "failed<=0": True}
    # the measured values are the stage reports' own numbers
    eval_json = json.loads((run_dir / "eval/eval.json").read_text())
    assert by_name["eval"]["metrics"]["ppl_increase_pct"] == eval_json["metrics"]["ppl_increase_pct"]["candidate"]
    versions = json.loads((run_dir / "versions.json").read_text())
    assert {"llmopt", "torch", "transformers", "python"} <= set(versions)
    md = (run_dir / "summary.md").read_text()
    assert "All gates passed." in md and "| quantize | ran |" in md
    # the resolved recipe is itself a valid recipe (absolute paths, defaults filled in)
    resolved = run_dir / "recipe.resolved.yaml"
    assert yaml.safe_load(resolved.read_text())["calibration"]["num_samples"] == 4
    rr, stages = validate_recipe(resolved, env={})
    assert [s.name for s in stages] == STAGES and rr.recipe.eval.ppl_data == recipe.parent / "text.txt"


def test_reports_and_messages_name_the_stage_folders_not_their_temporary_ones(full_run):
    """Stages write into a temporary folder renamed when they finish; quantization_report.json's `output`,
    the quantize table and bench's `wrote` lines used to name `.quantize.tmp-…` / `.bench.tmp-…`."""
    recipe, run_dir = full_run
    printed = (recipe.parent / "console.txt").read_text()
    words = " ".join(printed.split())  # a table title wraps where the path is long (xdist's tmp folders)
    assert f"→ {run_dir / 'quantize'}" in words
    for name in ("bench.json", "bench.md", "bench.png"):
        assert f"wrote {run_dir / 'bench' / name}" in words
    report = json.loads((run_dir / "quantize/quantization_report.json").read_text())
    assert report["output"] == str(run_dir / "quantize")
    assert ".tmp-" not in printed
    for p in run_dir.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".md", ".yaml", ".html"):
            assert ".tmp-" not in p.read_text(), p


def test_unchanged_stages_are_skipped_and_changes_rerun(full_run, tmp_path):
    recipe, run_dir = copy_run(full_run, tmp_path)  # moved with its data: still unchanged
    before = load_state(run_dir).stages
    report = run_recipe(RunRequest(recipe=recipe, out=run_dir), quiet())
    assert [s.status for s in report.stages] == ["skipped"] * 6
    assert report.exit_code == 0
    assert report.stages[3].metrics == before["eval"].metrics  # a skipped stage reports what it measured
    # a changed eval option reruns eval only
    report = run_recipe(RunRequest(recipe=recipe, out=run_dir, overrides=["eval.seq_len=32"]), quiet())
    assert {s.name: s.status for s in report.stages} == {**dict.fromkeys(STAGES, "skipped"), "eval": "ran"}
    assert report.stages[3].reason == "inputs changed: options"
    # a changed quantize option reruns quantize and everything that reads its checkpoint
    report = run_recipe(RunRequest(recipe=recipe, out=run_dir, overrides=["eval.seq_len=32", "quantize.symmetric=false"]),
                        quiet())
    assert [s.status for s in report.stages] == ["skipped", "skipped", "ran", "ran", "ran", "ran"]
    assert [s.reason for s in report.stages[2:4]] == ["inputs changed: options", "inputs changed: upstream artifacts"]
    # editing an input file reruns the stage that reads it
    (recipe.parent / "text.txt").write_text("Continuous batching schedules new requests at every step. " * 40)
    plan = run_recipe(RunRequest(recipe=recipe, out=run_dir, overrides=["eval.seq_len=32", "quantize.symmetric=false"],
                                 dry_run=True), quiet())
    assert [s.status for s in plan.stages] == ["would_skip"] * 3 + ["would_run"] + ["would_skip"] * 2
    assert plan.stages[3].reason.endswith("inputs changed: data files")
    # a tampered artifact is rebuilt
    (run_dir / "bench" / "bench.md").write_text("edited")
    plan = run_recipe(RunRequest(recipe=recipe, out=run_dir, overrides=["eval.seq_len=32", "quantize.symmetric=false"],
                                 dry_run=True), quiet())
    assert plan.stages[5].status == "would_run" and "artifact missing or modified" in plan.stages[5].reason


def test_failing_gate_exits_1_and_names_the_gate(full_run, tmp_path, monkeypatch, capsys):
    recipe, run_dir = copy_run(full_run, tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir),
                             "--set", "eval.gates=[ppl_increase_pct<=5, nll<=0.001]")
    assert code == 1, err
    assert "error: 1 gate(s) failed: eval: nll<=0.001 (measured " in err
    assert statuses(run_dir) == {**dict.fromkeys(STAGES, "skipped"), "eval": "ran"}
    assert summary(run_dir)["failed_gates"][0].startswith("eval: nll<=0.001")
    # the gate's stage is recorded: an unchanged rerun skips it and still fails on it
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir), "--json",
                             "--set", "eval.gates=[ppl_increase_pct<=5, nll<=0.001]")
    assert code == 1
    data = json.loads(out)
    assert data["exit_code"] == 1 and data["stages"][3]["status"] == "skipped"


def test_skipped_gate_is_left_out_and_named(full_run, tmp_path, monkeypatch, capsys):
    """--skip-gate takes out the gate that fails (by metric), the run passes, and the summary names it; a
    name that matches no gate is bad input (exit 2) before any work."""
    recipe, run_dir = copy_run(full_run, tmp_path)
    gates = ["--set", "eval.gates=[ppl_increase_pct<=5, nll<=0.001]"]
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir), "--json", *gates,
                             "--skip-gate", "nll")
    assert code == 0, err
    data = json.loads(out)
    assert data["skipped_gates"] == ["eval: nll<=0.001"] and data["passed"] is True
    assert "**Gates skipped** (`--skip-gate`): `eval: nll<=0.001`" in (run_dir / "summary.md").read_text()
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir), *gates,
                             "--skip-gate", "nll<=0.001", "--skip-gate", "kl_dvi")
    assert code == 2
    assert "--skip-gate 'kl_dvi' matches no gate of this recipe" in err and len(err.strip().splitlines()) == 1


def test_cli_full_run(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = make_recipe(tmp_path, tiny_llama)
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(tmp_path / "run"), "--json",
                             "--set", "serve.smoke=false")
    assert code == 0, err
    data = json.loads(out)  # stdout holds only the summary; stage output went to stderr
    assert data["passed"] is True
    assert [(s["name"], s["status"]) for s in data["stages"]] == [
        ("vram_plan", "ran"), ("calibrate", "ran"), ("quantize", "ran"), ("eval", "ran"), ("bench", "ran")]
    assert "stage 2/5: calibrate" in err


def test_failed_stage_leaves_no_partial_artifact(tiny_llama, tmp_path, monkeypatch):
    import llmopt.quant.pipeline as pipeline

    def broken(cfg, console=None):
        (cfg.output / "model.safetensors").write_bytes(b"half a checkpoint")
        raise LlmoptError("disk full")

    monkeypatch.setattr(pipeline, "quantize_model", broken)
    recipe = make_recipe(tmp_path, tiny_llama)
    run_dir = tmp_path / "run"
    with pytest.raises(LlmoptError, match="stage quantize failed: disk full") as info:
        run_recipe(RunRequest(recipe=recipe, out=run_dir, stages="calibrate,quantize,eval"), quiet())
    assert info.value.exit_code == 2
    assert not (run_dir / "quantize").exists()
    assert temp_leftovers(run_dir) == []
    assert (run_dir / "calibrate" / "manifest.json").is_file()
    assert set(load_state(run_dir).stages) == {"calibrate"}
    assert statuses(run_dir) == {"vram_plan": "not_selected", "calibrate": "ran", "quantize": "failed",
                                 "eval": "not_run", "serve": "not_selected", "bench": "not_selected"}
    assert summary(run_dir)["stages"][2]["error"] == "disk full"


def test_failed_rerun_keeps_the_previous_artifact(full_run, tmp_path, monkeypatch):
    import llmopt.quant.pipeline as pipeline

    recipe, run_dir = copy_run(full_run, tmp_path)
    before = tree_fingerprint(run_dir / "quantize")

    def broken(cfg, console=None):
        (cfg.output / "model.safetensors").write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "quantize_model", broken)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(RunRequest(recipe=recipe, out=run_dir, stages="quantize", force=True), quiet())
    assert tree_fingerprint(run_dir / "quantize") == before
    assert temp_leftovers(run_dir) == []
    assert summary(run_dir)["stages"][2]["error"] == "interrupted"
    # the old artifact still matches its record, so the next run skips quantize
    plan = run_recipe(RunRequest(recipe=recipe, out=run_dir, dry_run=True), quiet())
    assert [s.status for s in plan.stages] == ["would_skip"] * 6


def test_plan_that_does_not_fit_stops_the_run(tiny_llama, tmp_path):
    recipe = make_recipe(tmp_path, tiny_llama, **{"gpu_memory: 4GiB": "gpu_memory: 1GiB"})
    report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run"), quiet())
    assert report.exit_code == 1
    assert [s.status for s in report.stages] == ["ran"] + ["not_run"] * 5
    assert report.stages[1].reason == "vram_plan stopped the run"
    assert report.failed_gates[0].startswith("vram_plan: fits==1 (measured 0)")
    assert not (tmp_path / "run" / "calibrate").exists()


def test_dry_run_plans_without_writing(tiny_llama, tmp_path):
    recipe = make_recipe(tmp_path, tiny_llama)
    report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run", dry_run=True), quiet())
    assert [s.status for s in report.stages] == ["would_run"] * 6
    assert report.stages[2].reason == "quantized checkpoint (llmopt quantize): no previous run"
    assert not (tmp_path / "run").exists()


def test_stage_needing_an_upstream_artifact_that_is_missing(tiny_llama, tmp_path):
    recipe = make_recipe(tmp_path, tiny_llama)
    with pytest.raises(RecipeInvalid, match="stage 'eval' reads the output of stage 'quantize'"):
        run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run", stages="eval"), quiet())


def test_config_only_model_runs_only_the_memory_plan(tmp_path):
    recipe = make_recipe(tmp_path, LLAMA_CONFIG)
    with pytest.raises(RecipeInvalid, match=r":1: model: .* is only a config.json: enough for vram_plan, but "
                                            r"calibrate, quantize, eval, serve, bench need"):
        run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run"), quiet())
    report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run", stages="vram_plan"), quiet())
    assert report.stages[0].status == "ran" and report.stages[0].metrics["weight_dtype"] == "int8"


def test_cuda_device_is_checked_before_any_work(tiny_llama, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    recipe = make_recipe(tmp_path, tiny_llama, **{"  device: cpu\nquantize": "  device: cuda\nquantize"})
    with pytest.raises(RecipeInvalid, match=r":12: calibration.device: stage calibrate asks for cuda"):
        run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run"), quiet())
    assert not (tmp_path / "run").exists()


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    """One run per folder: another process's lock makes `llmopt run` exit 2 with one line, and the
    folder's existing files are left alone; once the lock is gone the run goes ahead."""
    import subprocess
    import sys

    from llmopt.recipe.lock import LOCK_NAME

    recipe = make_recipe(tmp_path, LLAMA_CONFIG)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("mine")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from llmopt.recipe.lock import run_lock\n"
         "with run_lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)", str(run_dir)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir), "--stages", "vram_plan")
        assert code == 2 and "is in use by another `llmopt run`" in err and len(err.strip().splitlines()) == 1
        assert str(holder.pid) in err
        assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK_NAME, "keep.txt"])
    finally:
        holder.kill()
        holder.wait()
    report = run_recipe(RunRequest(recipe=recipe, out=run_dir, stages="vram_plan"), quiet())
    assert report.stages[0].status == "ran" and (run_dir / "keep.txt").read_text() == "mine"


def test_no_engine_outlives_its_stage(tiny_llama, tmp_path):
    """Each stage's models are gone when the next stage starts: on a 24 GiB machine a 7B run cannot hold
    two at once (the serve smoke's engine outlived its server and bench loaded a second one). Automatic
    collection is off, so only what the stages and the runner free counts."""
    import gc

    from llmopt.engine.llm_engine import LLMEngine

    recipe = make_recipe(tmp_path, tiny_llama)
    gc.collect()
    before = sum(type(o) is LLMEngine for o in gc.get_objects())
    gc.disable()  # no automatic collection may hide a stage that left its engine in a cycle
    try:
        report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run", stages="calibrate,quantize,eval,serve"),
                            quiet())
        alive = sum(type(o) is LLMEngine for o in gc.get_objects())
    finally:
        gc.enable()
    assert report.exit_code == 0, report.to_json()
    assert alive == before


def test_a_recipe_quantizes_to_a_gate_with_scheme_auto(tiny_llama, tmp_path):
    """`scheme: auto` with a gate on held-out text named relative to the recipe (issue #32): the quantize
    stage runs the gate search and records the bits it reached."""
    auto = ("  scheme: auto\n  gate: [\"kl_div<=0.5\"]\n  eval_data: text.txt\n  eval_seq_len: 64\n"
            "  candidates: [w4a16-g32, w8a16]\n  device: cpu")
    recipe = make_recipe(tmp_path / "r", tiny_llama, **{"  scheme: w8a16\n  device: cpu": auto})
    report = run_recipe(RunRequest(recipe=recipe, out=tmp_path / "run", stages="calibrate,quantize"), quiet())
    assert report.exit_code == 0, report.to_json()
    metrics = next(s for s in summary(tmp_path / "run")["stages"] if s["name"] == "quantize")["metrics"]
    assert metrics["scheme"] == "auto" and 4.5 <= metrics["auto_bits"] <= 8.25
    saved = json.loads((tmp_path / "run" / "quantize" / "quantization_report.json").read_text())
    assert saved["gate_search"]["eval_data"] == str(tmp_path / "r" / "text.txt")


@pytest.mark.parametrize("out", ["afile", "afile/run"])
def test_a_run_folder_that_cannot_be_made_is_one_line_exit_2(out, tmp_path, monkeypatch, capsys):
    recipe = make_recipe(tmp_path, LLAMA_CONFIG)
    (tmp_path / "afile").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(tmp_path / out),
                           "--stages", "vram_plan")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot use {tmp_path / out} as the run folder: " in err and "afile is a file" in err
    assert (tmp_path / "afile").read_text() == "mine"
