"""Confidence gates (`METRIC OP NUMBER@95`) in a recipe's eval section: validated before any work (one
line, exit 2, located), and read from the paired interval by `llmopt run` (verdict, interval and what
would decide an undecided gate in the summary)."""

from __future__ import annotations

import json

import pytest
import yaml
from recipe_helpers import DATA, LLAMA_CONFIG, write

from tests.cli_runner import run_cli

EVAL_ONLY = """model: {model}
eval:
  baseline: {model}
  ppl_data: text.txt
  seq_len: 64
  tasks: [{task}]
  device: cpu
  gates: [{gates}]
"""


def _recipe(tmp_path, model, gates: str, task: str | None = None):
    (tmp_path / "text.txt").write_text("A KV cache stores keys and values for every token. " * 40)
    return write(tmp_path, EVAL_ONLY.format(model=model, task=task or DATA / "kb_mc.yaml", gates=gates))


@pytest.mark.parametrize("gate, fragment", [
    ("acc_drop<=1@101", "the confidence after @ is a percentage between 50 and 100"),
    ("acc_drop==1@95", "a confidence (@) needs >=, >, <= or <"),
    ("nll<=3@95", "'nll' has no interval in this eval; a confidence (@) applies to ppl_increase_pct, kl_div"),
    ("kb_mc.acc>=0.5@95", "'kb_mc.acc' has no interval"),
    ("acc_dorp<=1@95", "does not measure 'acc_dorp'; did you mean 'acc_drop'?"),
    ("acc_drop<=1@", "cannot parse gate"),
])
def test_bad_confidence_gate_is_one_located_line(gate, fragment, tmp_path, monkeypatch, capsys):
    recipe = _recipe(tmp_path, LLAMA_CONFIG, f'"{gate}"')
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "validate", str(recipe))
    assert code == 2
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and ":8: eval.gates[0]: " in lines[0] and fragment in lines[0], err


def test_confidence_gates_through_llmopt_run(tiny_llama, tmp_path, monkeypatch, capsys):
    """The tiny model against itself on 20 questions: `acc_drop<=15@95` passes (no item differs, and 20
    items rule out drops above ~9 points), `acc_drop<=5@95` is not shown (exit 1) with the items it needs."""
    recipe = _recipe(tmp_path, tiny_llama, '"acc_drop<=15@95", "kl_div<=0.001@95"')
    text = recipe.read_text() + "  limit: 20\n"
    recipe.write_text(text)
    run_dir = tmp_path / "run"
    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir), "--json")
    assert code == 0, err
    stage = json.loads(out)["stages"][0]
    gates = {g["gate"]: g for g in stage["gates"]}
    assert set(gates) == {"acc_drop<=15@95", "kl_div<=0.001@95"} and all(g["passed"] for g in gates.values())
    assert gates["acc_drop<=15@95"]["detail"].startswith("PASS acc_drop<=15@95 (point 0, 95% interval [")
    assert json.loads((run_dir / "eval" / "eval.json").read_text())["metrics"]["kb_mc.acc_drop"]["interval"]["n"] == 20
    low, high = stage["metrics"]["kb_mc.acc_drop.ci95"]
    assert low < 0 < high <= 15

    code, out, err = run_cli(monkeypatch, capsys, "run", str(recipe), "--out", str(run_dir),
                             "--set", "eval.gates=[acc_drop<=5@95]")
    assert code == 1
    assert "eval: NOT SHOWN acc_drop<=5@95 (point 0, 95% interval [" in err
    assert "with 20 items this gate can rule out drops above" in err and "items would decide it" in err
    summary = (run_dir / "summary.md").read_text()
    assert "`acc_drop<=5@95`" in summary and "NOT SHOWN acc_drop<=5@95" in summary
    assert f"- `kb_mc.acc_drop.ci95`: [{low:.4g}, {high:.4g}]" in summary
    resolved = yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())
    assert resolved["eval"]["gates"] == ["acc_drop<=5@95"]
