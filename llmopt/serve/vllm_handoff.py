"""Hand a checkpoint to vLLM: the `vllm serve` command equivalent to an `llmopt serve` command line.

Our flags map to vLLM's one to one where vLLM has them; where it does not, the nearest equivalent is
used and a note says so (our int8 KV cache becomes vLLM's fp8, whose int8 KV cache is not generally
available). Tensor/pipeline parallel sizes not given are taken from the memory plan
(`llmopt.planning.vram.plan_vram`) for `--gpu-memory` × `--num-gpus`, and the quantization method from the
checkpoint's `quantization_config`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmopt.errors import LlmoptError
from llmopt.models.resolve import ResolvedModel, resolve_model, weights_dir

_DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
# quant_method in config.json -> vLLM's --quantization (the Marlin kernels are what vLLM picks by itself
# on Ampere and newer; naming a method explicitly would otherwise pin the slower non-Marlin kernel)
_QUANT = {"gptq": "gptq_marlin", "awq": "awq_marlin", "compressed-tensors": "compressed-tensors", "fp8": "fp8",
          "bitsandbytes": "bitsandbytes", "modelopt": "modelopt", "gguf": "gguf"}


class VllmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    api_keys: list[str] = []
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int | None = Field(None, ge=1)
    gpu_memory_bytes: int = 24 * 1024**3
    num_gpus: int = Field(1, ge=1)


@dataclass
class VllmCommand:
    argv: list[str]
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(self.argv)


def _model_path(resolved: ResolvedModel) -> tuple[str, str | None]:
    if resolved.kind == "config":
        raise LlmoptError(f"{resolved.path} is only a config.json; vLLM needs a model directory with weights")
    if resolved.kind == "gguf":
        path = weights_dir(resolved)  # dequantized once, cached; vLLM loads it like any HF checkpoint
        return str(path), f"GGUF {resolved.path.name} is served from its dequantized copy {path}"
    return str(resolved.path.resolve()), None


def _quant_weight_dtype(qc: dict[str, Any]) -> str | None:
    """Weight storage of a quantized checkpoint, in vram-plan's names (None when unknown)."""
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    bits = qc.get("bits")
    kind = "int"
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits, kind = w.get("num_bits"), w.get("type", "int")
            break
    if kind == "float" and bits == 8:
        return "fp8"
    return {4: "int4", 8: "int8"}.get(bits)


def _plan_parallel(resolved: ResolvedModel, opts: VllmOptions, weight: str, notes: list[str]) -> tuple[int, int, int]:
    """(tp, pp, data-parallel replicas) from the memory plan."""
    from llmopt.planning.vram import VramPlanOptions, plan_vram

    spec = resolved.spec
    popts = VramPlanOptions(weight_dtype=weight, kv_dtype="fp8" if opts.kv_cache_dtype in ("int8", "fp8") else "auto",
                            seq_len=opts.max_model_len or spec.max_position_embeddings, batch=opts.max_num_seqs or 1,
                            gpu_memory_bytes=opts.gpu_memory_bytes, num_gpus=opts.num_gpus,
                            max_num_batched_tokens=opts.max_num_batched_tokens or 2048)
    plan = plan_vram(spec, popts, model_name=resolved.source)
    if plan.parallel is None:
        if not plan.fits:
            notes.append("the memory plan does not fit one GPU at these settings (see `llmopt vram-plan`); "
                         "add --num-gpus, shorten --max-model-len or quantize")
        return 1, 1, 1
    par = plan.parallel
    if par.replica is None:
        tp = max(par.valid_tp_degrees)
        notes.append(f"no layout over {opts.num_gpus} GPUs fits the memory plan; using TP {tp} anyway "
                     "(see `llmopt vram-plan --num-gpus`)")
        return tp, 1, 1
    return par.replica.tp, par.replica.pp, par.replicas


def build_vllm_command(model: str | None, opts: VllmOptions) -> VllmCommand:
    resolved = resolve_model(model)
    notes: list[str] = []
    path, note = _model_path(resolved)
    if note:
        notes.append(note)
    notes += deployment_notes(path)
    argv = ["vllm", "serve", path, "--host", opts.host, "--port", str(opts.port),
            "--served-model-name", opts.served_model_name or model or resolved.source]
    dtype = _DTYPES.get(opts.dtype)
    if dtype is None:
        raise LlmoptError(f"unknown --dtype {opts.dtype!r}; choose one of {', '.join(_DTYPES)}")
    argv += ["--dtype", dtype]
    for flag, value in (("--max-model-len", opts.max_model_len), ("--max-num-seqs", opts.max_num_seqs),
                        ("--max-num-batched-tokens", opts.max_num_batched_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    if opts.kv_cache_dtype == "int8":
        argv += ["--kv-cache-dtype", "fp8"]
        notes.append("--kv-cache-dtype int8 maps to vLLM's fp8 (same memory; vLLM's int8 KV cache is not "
                     "generally available); check quality with `llmopt eval` before relying on it")
    elif opts.kv_cache_dtype == "fp8":
        argv += ["--kv-cache-dtype", "fp8"]
    elif opts.kv_cache_dtype != "auto":
        raise LlmoptError(f"unknown --kv-cache-dtype {opts.kv_cache_dtype!r}; choose auto, int8 or fp8")
    argv.append("--enable-prefix-caching" if opts.enable_prefix_caching else "--no-enable-prefix-caching")

    qc = resolved.quantization_config
    weight = {"auto": "auto", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    if qc is not None:
        method = str(qc.get("quant_method"))
        argv += ["--quantization", _QUANT.get(method, method)]
        weight = _quant_weight_dtype(qc) or "fp16"
        if method in ("gptq", "awq"):
            notes.append(f"{method} checkpoints use vLLM's {_QUANT[method]} kernel (compute capability >= 8.0); "
                         f"on older GPUs replace it with --quantization {method}")
    tp, pp = opts.tensor_parallel_size, opts.pipeline_parallel_size
    dp = 1
    if tp is None and pp is None:
        tp, pp, dp = _plan_parallel(resolved, opts, weight, notes)
        notes.append(f"parallel layout from the memory plan for {opts.num_gpus} GPU(s) of "
                     f"{opts.gpu_memory_bytes / 1024**3:g} GiB: TP {tp} × PP {pp}"
                     + (f", {dp} data-parallel replicas" if dp > 1 else ""))
    tp, pp = tp or 1, pp or 1
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if pp > 1:
        argv += ["--pipeline-parallel-size", str(pp)]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if opts.api_keys:
        argv += ["--api-key", opts.api_keys[0]]
        if len(opts.api_keys) > 1:
            notes.append("vLLM's --api-key takes one key: only the first is passed")
        notes.append("the key is visible in the process list; vLLM also reads it from VLLM_API_KEY")
    return VllmCommand(argv, notes)


def _vllm_executable() -> str:
    exe = shutil.which("vllm")
    if exe is None:
        raise LlmoptError("vLLM is not installed (no `vllm` on PATH): `pip install vllm` on a GPU machine; for "
                          "vLLM's CPU build run benchmarks/peers/install_vllm.sh and put .peers/vllm/bin on PATH; "
                          "or add --dry-run to print the command")
    return exe


def exec_vllm(cmd: VllmCommand) -> None:
    """Replace this process with `vllm serve` (never returns), or a one-line error when vLLM is missing."""
    exe = _vllm_executable()
    os.execv(exe, [exe, *cmd.argv[1:]])


def deployment_notes(path: str) -> list[str]:
    """What `llmopt quantize` recorded about where this checkpoint runs, for the vLLM backends that do not
    run it: said before vLLM starts, so a CPU-only user learns why vLLM refuses it in one line."""
    report = Path(path) / "quantization_report.json"
    try:
        dep = json.loads(report.read_text()).get("deployment") or {}
    except (OSError, ValueError):
        return []
    notes = []
    for tool, name in (("vllm_cuda", "vLLM CUDA"), ("vllm_cpu", "vLLM CPU")):
        cell = dep.get(tool) or {}
        if cell.get("runs") is False:
            notes.append(f"{name} does not run this checkpoint: {cell.get('how')}")
    return notes


def vllm_handoff(model: str | None, opts: VllmOptions, dry_run: bool) -> VllmCommand:
    """`--engine vllm`: the `vllm serve` command; a missing vLLM fails before any work. The caller prints
    the notes and then (unless `dry_run`) calls `exec_vllm`."""
    if not dry_run:
        _vllm_executable()
    return build_vllm_command(model, opts)
