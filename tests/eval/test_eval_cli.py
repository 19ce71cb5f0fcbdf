"""`llmopt eval` end to end on tiny models: table, JSON, Markdown report, gates and exit codes."""

from __future__ import annotations

import json

import pytest
from eval_helpers import run_eval_cli, write_task

from llmopt.testing.tiny_model import write_tiny_llama

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 10


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """Same architecture and tokenizer as tiny_llama, different random weights: a 'broken' candidate."""
    return write_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1)


@pytest.fixture()
def data(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def test_single_model_json(tiny_llama, data, tmp_path, monkeypatch, capsys):
    task = write_task(tmp_path / "t")
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), "--ppl-data", str(data), "--seq-len", "64",
                                  "--task", str(task), "--json")
    assert code == 0, err
    rep = json.loads(out)
    ppl = rep["perplexity"]
    assert ppl["candidate"]["ppl"] > 1 and ppl["protocol"]["seq_len"] == 64
    assert ppl["candidate"]["tokens"] == ppl["protocol"]["text_tokens"] - ppl["protocol"]["windows"]
    assert set(rep["metrics"]) == {"ppl", "nll", "tiny_mc.acc", "tiny_mc.acc_norm"}
    assert rep["metrics"]["tiny_mc.acc"]["stderr"] is not None
    assert rep["tasks"]["tiny_mc"]["candidate"]["n"] == 6
    assert rep["passed"] is True


def test_compare_gates_and_report(tiny_llama, other_llama, data, tmp_path, monkeypatch, capsys):
    task = write_task(tmp_path / "t")
    gen = write_task(tmp_path / "t", name="tiny_gen", generate=True)
    report = tmp_path / "report.md"
    args = [str(other_llama), "--baseline", str(tiny_llama), "--ppl-data", str(data), "--seq-len", "64",
            "--task", str(task), "--task", str(gen), "--report", str(report)]
    # the same model as its own baseline passes every gate, exactly
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), *args[1:], "--json",
                                  "--gate", "ppl_increase_pct<=0.001", "--gate", "kl_div<=1e-6",
                                  "--gate", "top1_agreement>=1", "--gate", "acc_drop<=0")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["metrics"]["top1_agreement"]["candidate"] == 1.0
    assert rep["metrics"]["tiny_mc.acc"]["delta"] == 0.0
    assert all(g["pass"] for g in rep["gates"])
    # a different model fails the KL and top-1 gates: exit 1, the failures named, report still written
    code, out, err = run_eval_cli(monkeypatch, capsys, *args, "--gate", "top1_agreement>=0.9",
                                  "--gate", "kl_div<=0.01", "--gate", "tiny_gen.exact_match_drop<=100")
    assert code == 1
    assert "top1_agreement>=0.9" in err and "kl_div<=0.01" in err and "exact_match_drop" not in err
    assert "baseline" in out and "top1_agreement" in out and "FAIL" in out
    md = report.read_text()
    assert md.startswith("# llmopt eval report") and "| `kl_div` |" in md and "**FAIL** `top1_agreement>=0.9`" in md
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.md")]  # no temp file left


@pytest.mark.parametrize("case", ["missing_data", "empty_data", "unknown_field", "bad_template", "bad_gate",
                                  "unmeasured_gate", "bad_model", "corrupt_model", "stride", "harness",
                                  "lmeval_quantized", "report_path", "bisect_plot", "no_choices"])
def test_bad_input_is_one_line_exit_2(case, tiny_llama, data, tmp_path, monkeypatch, capsys):
    model = str(tiny_llama)
    args = ["--ppl-data", str(data)]
    if case == "missing_data":
        args = ["--ppl-data", str(tmp_path / "nope.txt")]
    elif case == "empty_data":
        (tmp_path / "empty.jsonl").write_text("")
        args = ["--ppl-data", str(tmp_path / "empty.jsonl")]
    elif case == "unknown_field":
        args += ["--task", str(write_task(tmp_path, doc_to_txt="x"))]
    elif case == "bad_template":
        args += ["--task", str(write_task(tmp_path, doc_to_text="{% if %}"))]
    elif case == "bad_gate":
        args += ["--gate", "ppl<<5"]
    elif case == "unmeasured_gate":
        args += ["--gate", "kl_div<=0.1"]  # needs --baseline
    elif case == "bad_model":
        model = str(tmp_path / "no-such-model")
    elif case == "corrupt_model":
        bad = tmp_path / "corrupt"
        bad.mkdir()
        for f in tiny_llama.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "model.safetensors").write_bytes(b"not a safetensors file")
        model = str(bad)
    elif case == "stride":
        args += ["--seq-len", "64", "--stride", "65"]
    elif case == "harness":
        args += ["--harness", "vllm"]
    elif case == "lmeval_quantized":  # lm-eval runs transformers models only: refused before loading
        q = tmp_path / "quantized"
        q.mkdir()
        cfg = json.loads((tiny_llama / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
        (q / "config.json").write_text(json.dumps(cfg))
        model = str(q)
        args = ["--task", str(write_task(tmp_path)), "--harness", "lm-eval"]
    elif case == "bisect_plot":  # without --bisect it was ignored, and no plot written
        args += ["--bisect-plot", str(tmp_path / "b.png")]
    elif case == "report_path":  # refused before any model loads (this one does not exist either)
        (tmp_path / "afile").write_text("x")
        args += ["--report", str(tmp_path / "afile" / "r.md")]
        model = str(tmp_path / "no-such-model")
    elif case == "no_choices":  # a later document without choices: found before the model (none here) loads
        task = write_task(tmp_path)
        rows = tmp_path / "tiny_mc.jsonl"
        rows.write_text(rows.read_text() + json.dumps({"context": "c", "question": "q?", "choices": [], "answer": 0})
                        + "\n")
        args += ["--task", str(task)]
        model = str(tmp_path / "no-such-model")
    code, out, err = run_eval_cli(monkeypatch, capsys, model, *args)
    assert code == 2, (out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    if case == "no_choices":
        assert lines[0] == "error: task tiny_mc: document 6 has no choices", err
    if case == "report_path":
        assert lines[0].startswith("error: --report") and "afile is not a folder" in lines[0], err


def test_confidence_gates_end_to_end(tiny_llama, other_llama, data, tmp_path, monkeypatch, capsys):
    """`@95` gates read the paired interval: the model against itself passes a margin its 6 items can
    support, a margin they cannot is NOT SHOWN (exit 1, with how many items would decide it), and another
    model fails the KL gate outright; the JSON and the Markdown report carry point, interval and verdict."""
    task = write_task(tmp_path / "t")
    base = ["--baseline", str(tiny_llama), "--ppl-data", str(data), "--seq-len", "64", "--task", str(task)]
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), *base, "--json",
                                  "--gate", "acc_drop<=30@95", "--gate", "kl_div<=1e-6@95",
                                  "--gate", "ppl_increase_pct<=0.001@90", "--gate", "top1_agreement>=1@95")
    assert code == 0, err
    rep = json.loads(out)
    g = {x["gate"]: x for x in rep["gates"]}
    drop = g["acc_drop<=30@95"]
    assert drop["verdict"] == "pass" and drop["point"] == 0 and drop["low"] < 0 < drop["high"] <= 30
    assert g["ppl_increase_pct<=0.001@90"]["confidence"] == pytest.approx(0.9)
    interval = rep["metrics"]["tiny_mc.acc_drop"]["interval"]
    assert interval["n"] == 6 and interval["p_value"] == 1.0 and interval["baseline_only"] == 0
    assert rep["metrics"]["kl_div"]["interval"]["unit"] == "windows"

    report = tmp_path / "r.md"
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), *base, "--gate", "acc_drop<=5@95",
                                  "--report", str(report))
    assert code == 1
    assert "NOT SHOWN acc_drop<=5@95 (point 0, 95% interval [" in err
    assert "with 6 items this gate can rule out drops above" in err and "items would decide it" in err
    assert "NOT SHOWN" in out and "paired differences" in out and "p (McNemar)" in out
    md = report.read_text()
    assert "**NOT SHOWN** `acc_drop<=5@95`" in md and "items would decide it" in md

    code, out, err = run_eval_cli(monkeypatch, capsys, str(other_llama), *base, "--json", "--gate", "kl_div<=0.01@95")
    assert code == 1
    kl = json.loads(out)["gates"][0]
    assert kl["verdict"] == "fail" and kl["low"] > 0.01 and kl["value"] == kl["high"]
    assert "1 gate(s) failed: kl_div<=0.01@95 (point " in err


@pytest.mark.parametrize("gate, message", [
    ("acc_drop<=1@100", "between 50 and 100"),
    ("acc_drop==0@95", "needs >=, >, <= or <"),
    ("ppl<=100@95", "'ppl' has no interval"),
    ("tiny_mc.acc>=0.5@95", "'tiny_mc.acc' has no interval"),
    ("acc_drop<=1@", "cannot parse gate"),
    ("acc_drops<=1@95", "does not measure 'acc_drops'"),
    ("tiny_mc.acc>=70", "'tiny_mc.acc' is a fraction of 1 (write tiny_mc.acc>=0.7 for 70%); its drop, "
                        "tiny_mc.acc_drop, is in points"),
    ("top1_agreement>=90@95", "'top1_agreement' is a fraction of 1 (write top1_agreement>=0.9 for 90%)"),
])
def test_bad_confidence_gate_is_one_line_exit_2(gate, message, tiny_llama, data, tmp_path, monkeypatch, capsys):
    task = write_task(tmp_path / "t")
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), "--baseline", str(tiny_llama),
                                  "--ppl-data", str(data), "--task", str(task), "--gate", gate)
    assert code == 2, (out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_confidence_gate_without_baseline_is_exit_2(tiny_llama, data, tmp_path, monkeypatch, capsys):
    code, out, err = run_eval_cli(monkeypatch, capsys, str(tiny_llama), "--ppl-data", str(data),
                                  "--gate", "kl_div<=0.1@95")
    assert code == 2 and "does not measure 'kl_div'" in err and len(err.strip().splitlines()) == 1
