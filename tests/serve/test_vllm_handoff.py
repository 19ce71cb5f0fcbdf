"""`llmopt serve --engine vllm`: the equivalent `vllm serve` command line, quoted, with planned TP/PP."""

from __future__ import annotations

import json
import shlex

from llmopt.models.resolve import resolve_model
from llmopt.planning.vram import VramPlanOptions, plan_vram
from llmopt.serve.vllm_handoff import VllmOptions, build_vllm_command
from llmopt.testing.tiny_model import write_tiny_llama
from tests.cli_runner import run_cli

LLAMA_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def write_config(path, cfg) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)




def test_flags_map_one_to_one(tiny_llama):
    opts = VllmOptions(port=9000, dtype="bf16", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=1024,
                       enable_prefix_caching=False, api_keys=["sk-1"], served_model_name="tiny")
    cmd = build_vllm_command(str(tiny_llama), opts)
    a = cmd.argv
    assert a[:3] == ["vllm", "serve", str(tiny_llama.resolve())]
    assert flag(a, "--host") == "127.0.0.1" and flag(a, "--port") == "9000"
    assert flag(a, "--dtype") == "bfloat16" and flag(a, "--max-model-len") == "512"
    assert flag(a, "--max-num-seqs") == "32" and flag(a, "--max-num-batched-tokens") == "1024"
    assert "--no-enable-prefix-caching" in a and flag(a, "--api-key") == "sk-1"
    assert flag(a, "--served-model-name") == "tiny"
    assert "--kv-cache-dtype" not in a and "--quantization" not in a
    assert "--tensor-parallel-size" not in a  # one GPU: vLLM's default of 1


def test_int8_kv_becomes_fp8_with_a_note(tiny_llama):
    cmd = build_vllm_command(str(tiny_llama), VllmOptions(kv_cache_dtype="int8"))
    assert flag(cmd.argv, "--kv-cache-dtype") == "fp8"
    assert any("fp8" in n and "int8" in n for n in cmd.notes)


def test_quoting_survives_spaces_and_quotes(tmp_path):
    model = write_config(tmp_path / "my model's dir", LLAMA_70B)
    cmd = build_vllm_command(model, VllmOptions(served_model_name="llama 70b", tensor_parallel_size=8))
    assert shlex.split(cmd.shell()) == cmd.argv
    assert flag(cmd.argv, "--tensor-parallel-size") == "8"


def test_quantization_from_the_checkpoint(tmp_path):
    cfg = {**LLAMA_70B, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    cmd = build_vllm_command(write_config(tmp_path / "gptq", cfg), VllmOptions(tensor_parallel_size=1))
    assert flag(cmd.argv, "--quantization") == "gptq_marlin"
    cfg = {**LLAMA_70B, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}
    cmd = build_vllm_command(write_config(tmp_path / "ct", cfg), VllmOptions(tensor_parallel_size=1))
    assert flag(cmd.argv, "--quantization") == "compressed-tensors"


def test_parallel_layout_comes_from_the_memory_plan(tmp_path):
    model = write_config(tmp_path / "llama70b", LLAMA_70B)
    opts = VllmOptions(max_model_len=4096, max_num_seqs=16, gpu_memory_bytes=80 * 1024**3, num_gpus=8)
    cmd = build_vllm_command(model, opts)
    plan = plan_vram(resolve_model(model).spec, VramPlanOptions(
        seq_len=4096, batch=16, gpu_memory_bytes=80 * 1024**3, num_gpus=8))
    rep = plan.parallel.replica
    assert rep.tp * rep.pp > 1  # 70B in bf16 does not fit one 80 GiB GPU
    assert int(flag(cmd.argv, "--tensor-parallel-size") or 1) == rep.tp
    assert int(flag(cmd.argv, "--pipeline-parallel-size") or 1) == rep.pp
    assert int(flag(cmd.argv, "--data-parallel-size") or 1) == plan.parallel.replicas
    assert any("memory plan" in n for n in cmd.notes)
    explicit = build_vllm_command(model, opts.model_copy(update={"tensor_parallel_size": 4,
                                                                  "pipeline_parallel_size": 2}))
    assert flag(explicit.argv, "--tensor-parallel-size") == "4" and flag(explicit.argv, "--pipeline-parallel-size") == "2"


def test_cli_dry_run_prints_the_command(tiny_llama, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--engine", "vllm", "--dry-run",
                             "--kv-cache-dtype", "int8", "--max-model-len", "256")
    assert code == 0
    argv = shlex.split(out.strip())
    assert argv[:2] == ["vllm", "serve"] and flag(argv, "--max-model-len") == "256"
    assert "# note:" in err


def test_cli_without_vllm_is_a_one_line_error(tiny_llama, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `vllm` anywhere
    code, out, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--engine", "vllm")
    assert code == 2 and out == ""
    assert "vLLM is not installed" in err and len(err.strip().splitlines()) == 1


def test_cli_bad_model_and_bad_key_priority_are_one_line_errors(tiny_llama, monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tmp_path / "nope"))
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--api-key", "k",
                           "--api-key-priority", "k:3")
    assert code == 2 and "KEY=PRIO" in err
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--log-level", "loud")
    assert code == 2 and "invalid log_level" in err and len(err.strip().splitlines()) == 1  # was a traceback


def test_cli_kv_cache_scales_bad_value_and_vllm_engine_are_one_line_errors(tiny_llama, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--kv-cache-scales", "static")
    assert code == 2 and "kv_cache_scales" in err
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--engine", "vllm", "--dry-run",
                           "--kv-cache-scales", "dynamic")
    assert code == 2 and "--kv-cache-scales applies to --engine llmopt" in err and len(err.strip().splitlines()) == 1


def test_cli_speculative_draft_needs_a_compatible_draft_model(tiny_llama, monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--speculative", "draft")
    assert code == 2 and "needs draft_model" in err and len(err.strip().splitlines()) == 1
    other = write_tiny_llama(tmp_path / "other-tokenizer", tokenizer_vocab_size=300)
    capsys.readouterr()
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(tiny_llama), "--speculative", "draft",
                           "--draft-model", str(other), "--port", "0")
    # the server is up when the engine fails to load; it exits 2 with the reason as its last line
    assert code == 2 and "needs the same tokenizer" in err.strip().splitlines()[-1]


def test_notes_say_which_vllm_backends_do_not_run_the_checkpoint(tiny_llama, tmp_path):
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    out = tmp_path / "w8"
    quantize_model(QuantizeConfig(model=str(tiny_llama), scheme="w8a16", output=out, device="cpu"))
    notes = build_vllm_command(str(out), VllmOptions(tensor_parallel_size=1)).notes
    assert any(n.startswith("vLLM CPU does not run this checkpoint: no CPU kernel for uint8b128") for n in notes)
    assert not any(n.startswith("vLLM CUDA does not run") for n in notes)
    w4 = tmp_path / "w4"
    quantize_model(QuantizeConfig(model=str(tiny_llama), scheme="w4a16", group_size=32, output=w4, device="cpu"))
    assert not any("does not run this checkpoint" in n
                   for n in build_vllm_command(str(w4), VllmOptions(tensor_parallel_size=1)).notes)


def test_without_dry_run_the_process_becomes_vllm_serve(tiny_llama, tmp_path):
    """The real hand-off: `llmopt serve --engine vllm` execs the `vllm` found on PATH with the command
    --dry-run prints (here a `vllm` that records its argv and pid instead of serving)."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    exe = bin_dir / "vllm"
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   f"json.dump({{'argv': sys.argv[1:], 'pid': os.getpid()}}, open({str(record)!r}, 'w'))\n")
    exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = [sys.executable, "-m", "llmopt", "serve", str(tiny_llama), "--engine", "vllm", "--port", "8123"]
    dry = subprocess.run([*args, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(record.read_text())
    assert got["pid"] == proc.pid  # exec'd in place: vLLM owns the process (signals, exit code)
    assert ["vllm", *got["argv"]] == shlex.split(dry.stdout.strip())
    assert "# running: vllm serve" in err
