"""`llmopt quantize` end to end through the CLI, and its error paths (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import run_cli

KB = Path(__file__).resolve().parents[2] / "calibration_data" / "kb_calibration.jsonl"




def test_quantize_then_generate_from_the_output(tiny_llama, tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "llmopt", "quantize", str(tiny_llama), "--scheme", "w4a16",
                        "--group-size", "32", "--method", "gptq", "--calib-data", str(KB), "--num-samples", "4",
                        "--seq-len", "64", "--format", "gptq", "--threads", "1", "-o", str(out), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["format"] == "gptq" and len(report["modules"]) == 8
    assert report["settings"]["threads"] == 1  # GPTQ's rounding depends on it: the report says what it ran on
    r = subprocess.run([sys.executable, "-m", "llmopt", "generate", str(out), "-p", "The quick", "--max-tokens",
                        "4", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    gen = json.loads(r.stdout)
    assert gen["output_tokens"] == 4 and gen["dtype"] == "bfloat16"


@pytest.mark.parametrize("args, msg", [
    (["--scheme", "w3a16"], "invalid scheme"),
    (["--scheme", "w4a16", "--group-size", "48"],
     "valid group sizes: 8, 16, 32, 64 (multiples of 32 for the int4 kernels: 32, 64), or -1 (per channel)"),
    (["--scheme", "w4a16", "--calib", "no-such-dir", "--method", "gptq"], "no-such-dir"),
    (["--scheme", "w4a16", "--ignore", "(["], "bad regex"),
    (["--scheme", "w4a16", "--override", "v_proj=w8a16"], "must share a scheme"),
    (["--scheme", "w4a16", "--method", "gptq"], "needs calibration data"),
    (["--scheme", "w8a16", "--override", "mlp=w8a8"], "SmoothQuant (an --override to w8a8) needs calibration data"),
    (["--scheme", "fp8", "--asym"], "fp8 weights are symmetric"),
    (["--scheme", "auto", "--target-bits", "5", "--group-size", "32", "--calib-data", str(KB)],
     "--group-size applies to a fixed scheme"),
    (["--scheme", "w4a16", "--kv-cache", "int8"], "KV-cache scales needs calibration data"),
    (["--scheme", "fp8", "--format", "gptq"], "gptq format"),
    (["--scheme", "w4a16", "--method", "gptq", "--act-order", "--no-static-groups", "--calib-data", "x.txt"],
     "needs --format gptq"),
    (["--scheme", "w4a16", "--mse"], "--mse applies to --method gptq only"),
    (["--scheme", "auto"], "--scheme auto needs --target-bits"),
    (["--scheme", "w4a16", "--target-bits", "4.5"], "--target-bits, --eval-data and --auto-tokens apply to --scheme"),
    (["--scheme", "w4a16", "--auto-tokens", "4096"], "--auto-tokens apply to --scheme auto only"),
    (["--scheme", "auto", "--target-bits", "5", "--auto-tokens", "0"], "auto_tokens"),
    (["--scheme", "auto", "--target-bits", "5", "--format", "gptq"], "one scheme for the whole model"),
    (["--scheme", "auto", "--target-bits", "5", "--override", "mlp=w8a16"], "chooses every linear's scheme"),
    (["--scheme", "auto", "--target-bits", "5", "--candidates", "w3a16"], "unknown candidate 'w3a16'"),
    (["--scheme", "auto", "--target-bits", "5"], "--scheme auto needs calibration data"),
    (["--scheme", "auto", "--target-bits", "16", "--calib-data", str(KB)], "a budget of 16 or more quantizes nothing"),
    (["--scheme", "auto", "--target-bits", "inf", "--calib-data", str(KB)], "a budget of 16 or more"),
    (["--scheme", "auto", "--target-bits", "4", "--calib-data", str(KB)], "below the cheapest candidates"),
    (["--scheme", "auto", "--target-bits", "5", "--candidates", "w4a16-g48", "--calib-data", str(KB)],
     "add w8a16 or bf16"),
    (["--scheme", "w4a16", "--kv-cache", "fp8", "--format", "gptq"], "--kv-cache fp8 is a compressed-tensors"),
    (["--scheme", "w4a16", "--kv-cache", "int8", "--kv-cache-strategy", "attn_head"],
     "--kv-cache-strategy attn_head applies to --kv-cache fp8"),
    (["--scheme", "w4a16", "--kv-cache", "fp8", "--kv-cache-strategy", "channel"], "kv_cache_strategy"),
    (["--scheme", "w4a16", "--lm-head", "int8", "--format", "gptq"], "--lm-head int8 is written as a compressed"),
    (["--scheme", "w4a16", "--lm-head", "int3"], "lm_head"),
    (["--scheme", "w4a16", "--lm-head", "int4", "--format", "gptq"], "--lm-head int4 is written as a compressed"),
    (["--scheme", "w4a16", "--lm-head", "auto"], "--lm-head auto lets --scheme auto choose the head"),
    (["--scheme", "w4a16", "--method", "auto"], "--method auto lets --scheme auto choose GPTQ or AWQ"),
    (["--scheme", "w4a16", "--float-dtype", "fp16"], "float_dtype"),
    (["--scheme", "w4a16", "--threads", "0"], "invalid threads"),
    (["--scheme", "w4a16", "--gate", "kl_div<=0.1"], "--gate applies to --scheme auto"),
    (["--scheme", "auto", "--gate", "kl_div<=0.1", "--calib-data", str(KB)], "--gate needs --eval-data"),
    (["--scheme", "auto", "--gate", "kl_div<=0.1", "--target-bits", "5", "--eval-data", str(KB)], "not both"),
    (["--scheme", "auto", "--gate", "kl <= x", "--eval-data", str(KB)], "cannot parse gate 'kl <= x'"),
    (["--scheme", "auto", "--gate", "kl_div<=0.1@120", "--eval-data", str(KB)], "a percentage between 50 and 100"),
    (["--scheme", "auto", "--gate", "acc_drop<=1", "--eval-data", str(KB), "--calib-data", str(KB)],
     "this run does not measure 'acc_drop'"),
    (["--scheme", "auto", "--gate", "kl_div<=1", "--eval-data", "no-such.txt", "--calib-data", str(KB)],
     "no-such.txt"),
])
def test_bad_input_is_one_line_exit_2(tiny_llama, tmp_path, monkeypatch, capsys, args, msg):
    out = tmp_path / "q"
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), *args, "-o", str(out))
    assert code == 2
    assert msg in err and err.strip().count("\n") == 0 and "Traceback" not in err
    assert not out.exists()


def test_an_output_that_cannot_be_made_is_one_line_exit_2_before_any_work(tiny_llama, tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), "--scheme", "w8a16",
                           "-o", str(tmp_path / "afile" / "q"))
    assert code == 2 and err.strip().count("\n") == 0 and "Traceback" not in err
    assert f"cannot write {tmp_path / 'afile' / 'q'}: {tmp_path / 'afile'} is a file, not a folder" in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_threads_hold_for_the_run_and_are_put_back(tiny_llama, tmp_path):
    import torch
    from rich.console import Console

    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    cfg = QuantizeConfig(model=str(tiny_llama), scheme="w8a16", threads=want, output=tmp_path / "q", device="cpu")
    assert quantize_model(cfg, Console(quiet=True)).settings["threads"] == want
    assert torch.get_num_threads() == before
    default = quantize_model(cfg.model_copy(update={"threads": None, "output": tmp_path / "d"}), Console(quiet=True))
    assert default.settings["threads"] == before
    # the forward dtype `auto` resolved to on this CPU is what the report records
    from llmopt.devices import forward_dtype
    assert default.settings["forward_dtype"] == str(forward_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def test_existing_output_dir_is_refused(tiny_llama, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    out.mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_llama), "--scheme", "w8a16", "-o", str(out))
    assert code == 2 and "already exists; pass --overwrite" in err and err.strip().count("\n") == 0
