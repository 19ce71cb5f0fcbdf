"""The recipes in recipes/: they validate, the 7B plan runs offline, the CPU ones run end to end (slow)."""

from __future__ import annotations

import json
import re

import pytest
from recipe_helpers import LLAMA_CONFIG, RECIPES, ROOT

from llmopt.recipe.schema import Recipe, recipe_json_schema
from tests.cli_runner import run_cli

SHIPPED = sorted(p.name for p in RECIPES.glob("*.yaml"))
CPU_RECIPES = ["quickstart.yaml", "spec-ngram.yaml"]  # end to end in the slow suite; the others take longer


def test_the_recipes_are_there():
    assert {"quickstart.yaml", "smollm2-w4a16-gptq.yaml", "kv-int8.yaml", "spec-ngram.yaml",
            "llama-7b-24gb-kb-qa.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_validates(name, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_7B_PATH", str(LLAMA_CONFIG))
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "validate", str(RECIPES / name))
    assert code == 0, err
    assert f"{RECIPES / name}: ok" in out


def test_7b_recipe_needs_its_variable(monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_7B_PATH", raising=False)
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "validate", str(RECIPES / "llama-7b-24gb-kb-qa.yaml"))
    assert code == 2
    assert re.search(r"llama-7b-24gb-kb-qa.yaml:\d+: model: environment variable LLAMA_7B_PATH is not set", err)


def test_7b_memory_plan_runs_offline(monkeypatch, capsys, tmp_path):
    """The seed scenario's plan: W8A16 + int8 KV, 20 users x 2048 tokens on one 24 GiB GPU."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("LLAMA_7B_PATH", "recipes/configs/llama-2-7b.config.json")  # relative to the checkout
    code, out, err = run_cli(monkeypatch, capsys, "run", "recipes/llama-7b-24gb-kb-qa.yaml", "--stages",
                             "vram_plan", "--out", str(tmp_path / "run"), "--json")
    assert code == 0, err
    stage = json.loads(out)["stages"][0]
    assert stage["status"] == "ran"
    m = stage["metrics"]
    assert (m["weight_dtype"], m["kv_dtype"], m["batch"], m["fits"]) == ("int8", "int8", 20, True)
    assert m["max_concurrent_sequences"] >= 20
    plan = json.loads((tmp_path / "run" / "vram_plan" / "plan.json").read_text())
    assert plan["params"] == 6_738_415_616  # Llama-2-7B's exact parameter count: the shipped config is right
    # the other stages need the weights, and say so before any work
    code, _, err = run_cli(monkeypatch, capsys, "run", "recipes/llama-7b-24gb-kb-qa.yaml", "--out",
                           str(tmp_path / "run"))
    assert code == 2 and "is only a config.json: enough for vram_plan" in err


def _keys(schema: dict, node: dict, prefix: str) -> list[str]:
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    for option in node.get("anyOf", []):
        if "$ref" in option:
            return _keys(schema, option, prefix)
    out = []
    for name, sub in node.get("properties", {}).items():
        out.append(f"{prefix}{name}")
        out += _keys(schema, sub, f"{prefix}{name}.")
    return out


def test_every_key_is_documented():
    schema = recipe_json_schema()
    doc = (ROOT / "docs" / "RECIPES.md").read_text()
    missing = [k for k in _keys(schema, schema, "") if f"`{k.split('.')[-1]}`" not in doc]
    assert not missing, f"document these recipe keys in docs/RECIPES.md: {missing}"
    assert set(Recipe.model_fields) <= set(schema["properties"])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the quickstart takes ~10 min on 2 busy cores
@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipe_end_to_end(name, monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "run", str(RECIPES / name), "--out", str(tmp_path / "run"),
                             "--json")
    data = json.loads(out)
    assert code == 0, (data["failed_gates"], err[-3000:])
    assert all(s["status"] == "ran" for s in data["stages"])
    assert (tmp_path / "run" / "summary.md").is_file()
