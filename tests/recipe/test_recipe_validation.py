"""Malformed recipes: each problem is one line naming file:line (or --set / --stages), the key and the fix.

Validation needs no model weights: the recipe's model is the shipped Llama-2-7B config.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from recipe_helpers import DATA, LLAMA_CONFIG, write

from llmopt.recipe.interpolate import interpolate_string
from llmopt.recipe.issues import RecipeInvalid
from llmopt.recipe.loader import parse_recipe_text
from llmopt.recipe.overrides import apply_overrides, parse_key_path
from llmopt.recipe.validate import validate_recipe
from tests.cli_runner import run_cli

# Line numbers below refer to this text (line 1 is `model:`).
BASE = f"""model: {LLAMA_CONFIG}
vram_plan:
  gpu_memory: 24GiB
  batch: 4
calibration:
  data: [text.txt]
  num_samples: 8
  seq_len: 64
quantize:
  scheme: w8a16
  method: rtn
eval:
  baseline: {LLAMA_CONFIG}
  ppl_data: text.txt
  tasks: [{DATA / "kb_mc.yaml"}]
  gates: ["ppl_increase_pct<=5"]
serve:
  engine:
    max_num_seqs: 8
bench:
  concurrency: [1, 2]
  gates: ["output_throughput>=1"]
"""


def sub(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


def drop_lines(*numbers: int) -> Callable[[str], str]:
    return lambda text: "".join(line for n, line in enumerate(text.splitlines(True), 1) if n not in numbers)


@dataclass
class Case:
    id: str
    edit: Callable[[str], str] | str  # a transformation of BASE, or the whole file
    where: str  # "LINE: key.path", "LINE" (no key), "--set: key.path", "--set", "--stages"
    fragment: str
    overrides: list[str] = field(default_factory=list)
    stages: str | None = None
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("unknown-top-level-key", sub("vram_plan:", "vram_plam:"), "2: vram_plam",
         "unknown key; did you mean 'vram_plan'?"),
    Case("misspelled-nested-key", sub("  scheme: w8a16", "  sheme: w8a16"), "10: quantize.sheme",
         "unknown key; did you mean 'scheme'?"),
    Case("abbreviated-key", sub("  method: rtn", "  sym: true"), "11: quantize.sym",
         "unknown key; did you mean 'symmetric'?"),
    Case("unknown-key-deep", sub("    max_num_seqs: 8", "    speculative: {method: ngram, k: 4}"),
         "19: serve.engine.speculative.k", "unknown key (allowed: method, num_speculative_tokens"),
    Case("wrong-type", sub("  num_samples: 8", "  num_samples: many"), "7: calibration.num_samples",
         "input should be a valid integer"),
    Case("bad-enum", sub("  scheme: w8a16", "  scheme: w3a16"), "10: quantize.scheme",
         "got 'w3a16'; did you mean 'w8a16'?"),
    Case("negative-number", sub("  seq_len: 64", "  seq_len: -64"), "8: calibration.seq_len",
         "greater than or equal to 2, got -64"),
    Case("library-dtype-check", sub("  gpu_memory: 24GiB", "  weight_dtype: int3"), "3: vram_plan.weight_dtype",
         "unknown --weight-dtype 'int3'"),
    Case("bad-memory-size", sub("  gpu_memory: 24GiB", "  gpu_memory: 24 potatoes"), "3: vram_plan.gpu_memory",
         "cannot parse memory size"),
    Case("library-cross-field-check", sub("  method: rtn", "  act_order: true"), "11: quantize.act_order",
         "--act-order applies to --method gptq only"),
    Case("auto-without-budget", sub("  scheme: w8a16", "  scheme: auto"), "10: quantize.scheme",
         "--scheme auto needs --target-bits"),
    Case("auto-without-calibration", lambda t: sub("  scheme: w8a16", "  scheme: auto\n  target_bits: 6")(
        drop_lines(5, 6, 7, 8)(t)), "6: quantize.scheme", "scheme: auto needs calibration data"),
    Case("gptq-without-calibration", lambda t: sub("  method: rtn", "  method: gptq")(drop_lines(5, 6, 7, 8)(t)),
         "7: quantize.method", "needs calibration data: add a `calibration` section"),
    Case("bad-gate-expression", sub('"ppl_increase_pct<=5"', '"ppl <<< 3"'), "16: eval.gates[0]",
         "cannot parse gate 'ppl <<< 3'"),
    Case("unknown-bench-gate-metric", sub('"output_throughput>=1"', '"ttft_p99<=1000"'), "22: bench.gates[0]",
         "does not measure 'ttft_p99'; did you mean 'ttft_p99_ms'?"),
    Case("eval-gate-needs-baseline", drop_lines(13), "15: eval.gates[0]", "no eval.baseline"),
    Case("bad-sweep", sub("[1, 2]", "[1, x]"), "21: bench.concurrency", "cannot parse concurrency sweep"),
    Case("eval-without-data", drop_lines(14, 15), "12: eval.ppl_data", "give --ppl-data and/or at least one --task"),
    Case("missing-ppl-file", sub("  ppl_data: text.txt", "  ppl_data: nope.txt"), "14: eval.ppl_data",
         "eval.ppl_data file not found"),
    Case("missing-calibration-file", sub("[text.txt]", "[nope.jsonl]"), "6: calibration.data[0]",
         "calibration data not found"),
    Case("missing-task-file", sub("kb_mc.yaml", "nope.yaml"), "15: eval.tasks[0]", "eval task file not found"),
    Case("missing-model", sub(f"model: {LLAMA_CONFIG}", "model: ./no-such-model"), "1: model", "not found"),
    Case("missing-required-key", drop_lines(1), "1: model", "required key missing"),
    # an empty section enables its stage with every default (it used to be read as null and skipped)
    Case("empty-section", lambda t: drop_lines(10, 11)(t), "9: quantize.scheme", "required key missing"),
    Case("duplicate-key", lambda t: t + "model: other\n", "23: model",
         "duplicate key 'model' (first written on line 1)"),
    Case("bad-yaml-syntax", sub("  method: rtn", "   method: rtn"), "11", "invalid YAML: mapping values are not allowed"),
    Case("bad-yaml-unclosed", sub("[1, 2]", "[1, 2"), "22", "invalid YAML"),
    Case("empty-file", "", "1", "empty recipe"),
    Case("only-comments", "# nothing here\n", "1", "empty recipe"),
    Case("not-a-mapping", "- model: x\n- quantize: {}\n", "1", "must be a mapping of sections"),
    Case("scalar-document", "smollm2-135m\n", "1", "not a single str value"),
    Case("bad-interpolation", sub(f"model: {LLAMA_CONFIG}", "model: ${1BAD}"), "1: model",
         "bad variable reference '${1BAD}'"),
    Case("unset-variable", sub(f"model: {LLAMA_CONFIG}", "model: ${LLMOPT_TEST_UNSET}"), "1: model",
         "environment variable LLMOPT_TEST_UNSET is not set"),
    Case("unterminated-interpolation", sub("  scheme: w8a16", "  scheme: ${SCHEME"), "10: quantize.scheme",
         "unterminated '${'"),
    Case("bad-set-path", BASE, "--set", "model is a str, not a mapping", overrides=["model.path=x"]),
    Case("bad-set-syntax", BASE, "--set", "expected KEY.PATH=VALUE", overrides=["quantize.scheme"]),
    Case("bad-set-key-path", BASE, "--set", "bad key path 'quantize..scheme'", overrides=["quantize..scheme=w8a16"]),
    Case("bad-set-index", BASE, "--set", "index 5 is out of range", overrides=["bench.gates[5]=failed<=0"]),
    Case("set-unknown-key", BASE, "--set: quantize.sheme", "unknown key; did you mean 'scheme'?",
         overrides=["quantize.sheme=w4a16"]),
    Case("set-bad-value", BASE, "--set: calibration.num_samples", "greater than or equal to 1, got -1",
         overrides=["calibration.num_samples=-1"]),
    Case("unknown-stage", BASE, "--stages", "unknown stage 'evall'; did you mean 'eval'?", stages="quantize,evall"),
    Case("stage-not-in-recipe", BASE, "--stages", "stage 'serve' is not part of this recipe (serve.smoke is not true)",
         stages="serve"),
]


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    (tmp_path / "text.txt").write_text("The on-call engineer acknowledges every page within five minutes.\n" * 20)
    return tmp_path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_recipe(case: Case, recipe_dir: Path, monkeypatch):
    monkeypatch.delenv("LLMOPT_TEST_UNSET", raising=False)
    text = case.edit if isinstance(case.edit, str) else case.edit(BASE)
    path = write(recipe_dir, text)
    with pytest.raises(RecipeInvalid) as info:
        validate_recipe(path, case.overrides, env=case.env, stages=case.stages)
    line = info.value.issues[0].format()
    assert "\n" not in line and "\n" not in str(info.value)
    source = case.where.split(":")[0]
    if source.isdigit():  # file:line[: key]
        assert line.startswith(f"{path}:{case.where}: "), line
        assert info.value.issues[0].line == int(source)
    else:
        assert line.startswith(f"{case.where}: "), line
    assert case.fragment in line, line


def test_task_document_without_choices(recipe_dir: Path):
    """A later document without choices is found by validation, not by scoring after the model loaded."""
    (recipe_dir / "mc.jsonl").write_text('{"q": "a?", "c": ["x", "y"], "l": 0}\n{"q": "b?", "c": [], "l": 0}\n')
    (recipe_dir / "mc.yaml").write_text("task: mc\ndataset_path: json\ndataset_kwargs: {data_files: {test: mc.jsonl}}\n"
                                        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                        "doc_to_target: l\ndoc_to_choice: '{{c}}'\n")
    with pytest.raises(RecipeInvalid) as info:
        validate_recipe(write(recipe_dir, sub(str(DATA / "kb_mc.yaml"), "mc.yaml")(BASE)), env={})
    line = info.value.issues[0].format()
    assert line.endswith("15: eval.tasks[0]: task mc: document 1 has no choices"), line


def test_validation_reports_every_problem(recipe_dir: Path):
    text = sub("  num_samples: 8", "  num_samples: -1")(sub("  scheme: w8a16", "  scheme: w3a16")(BASE))
    with pytest.raises(RecipeInvalid) as info:
        validate_recipe(write(recipe_dir, text), env={})
    where = [(i.line, i.path) for i in info.value.issues]
    assert where == [(7, ("calibration", "num_samples")), (10, ("quantize", "scheme"))]
    assert "(and 1 more problem;" in str(info.value)


def test_valid_base_recipe(recipe_dir: Path):
    rr, stages = validate_recipe(write(recipe_dir, BASE), env={})
    assert [s.name for s in stages] == ["vram_plan", "calibrate", "quantize", "eval", "bench"]
    assert rr.recipe.bench.concurrency == "1,2"
    assert rr.recipe.calibration.data[0].path == "text.txt"


# ---------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("args,fragment", [
    (["recipe", "validate", "{path}", "--set", "quantize.sheme=w4a16"], "--set: quantize.sheme: unknown key"),
    (["recipe", "validate", "{bad}"], "{bad}:3: quantize.sheme: unknown key; did you mean 'scheme'?"),
    (["run", "{bad}", "--dry-run"], "{bad}:3: quantize.sheme: unknown key; did you mean 'scheme'?"),
    (["run", "{path}", "--stages", "quantise", "--dry-run"], "--stages: unknown stage 'quantise'; did you mean"),
    (["run", "{yaml}"], "{yaml}:3: invalid YAML"),
])
def test_cli_exit_code_2(args, fragment, recipe_dir: Path, monkeypatch, capsys):
    files = {"path": write(recipe_dir, BASE),
             "bad": write(recipe_dir, f"model: {LLAMA_CONFIG}\nquantize:\n  sheme: w8a16\n", "bad.yaml"),
             "yaml": write(recipe_dir, f"model: {LLAMA_CONFIG}\nquantize:\n  scheme: [w8a16\n", "syntax.yaml")}
    argv = [a.format(**files) for a in args]
    code, out, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 2, (out, err)
    assert fragment.format(**files) in err
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1
    assert not (recipe_dir / "runs").exists()


def test_cli_validate_ok_and_schema(recipe_dir: Path, monkeypatch, capsys):
    path = write(recipe_dir, BASE)
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "validate", str(path))
    assert code == 0, err
    assert "ok (stages: vram_plan, calibrate, quantize, eval, bench)" in out
    code, out, _ = run_cli(monkeypatch, capsys, "recipe", "schema")
    assert code == 0
    schema = json.loads(out)
    assert schema["title"] == "llmopt recipe"
    assert set(schema["properties"]) == {"model", "description", "vram_plan", "calibration", "quantize", "eval",
                                         "serve", "bench"}
    assert schema["additionalProperties"] is False


# ------------------------------------------------------------------- interpolation, overrides, lines


@pytest.mark.parametrize("text,env,expected", [
    ("${A}", {"A": "x"}, "x"),
    ("${A:-d}", {}, "d"),
    ("${A:-d}", {"A": ""}, "d"),
    ("${A}", {"A": ""}, ""),
    ("pre-${A}-${B:-2}", {"A": "1"}, "pre-1-2"),
    ("$$HOME and ^a$", {}, "$HOME and ^a$"),
    ("${A:-a:b}", {}, "a:b"),
])
def test_interpolation(text, env, expected):
    assert interpolate_string(text, env) == expected


def test_interpolated_values_are_typed_by_the_schema(recipe_dir: Path):
    text = sub("  num_samples: 8", "  num_samples: ${N:-8}")(BASE)
    rr, _ = validate_recipe(write(recipe_dir, text), env={"N": "16"})
    assert rr.recipe.calibration.num_samples == 16


def test_overrides_are_yaml_typed_and_create_sections():
    data, done, issues = apply_overrides({"model": "m", "bench": {"gates": ["a"]}}, [
        "bench.concurrency=[1, 2, 4]", "eval.limit=8", "bench.gates[1]=failed<=0", "quantize.symmetric=false",
        "eval.stride=null"])
    assert not issues
    assert data["bench"] == {"gates": ["a", "failed<=0"], "concurrency": [1, 2, 4]}
    assert data["eval"] == {"limit": 8, "stride": None}
    assert data["quantize"] == {"symmetric": False}
    assert ("bench", "gates", 1) in done
    assert parse_key_path("eval.gates.0") == parse_key_path("eval.gates[0]") == ("eval", "gates", 0)


def test_line_map_with_anchors_and_merge_keys():
    src = parse_recipe_text("model: m\nengine: &e\n  dtype: float32\nserve:\n  engine:\n    <<: *e\n"
                            "    max_num_seqs: 4\n", "r.yaml")
    assert src.data["serve"]["engine"] == {"dtype": "float32", "max_num_seqs": 4}
    assert src.lines.line(("serve", "engine", "max_num_seqs")) == 7
    assert src.lines.line(("serve", "engine", "dtype")) == 3  # merged from the anchor
    assert src.lines.line(("serve", "engine", "nope")) == 5  # nearest ancestor
