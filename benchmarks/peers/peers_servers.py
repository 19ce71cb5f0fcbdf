"""Starting and stopping the peer servers, preparing their checkpoints, measuring memory bandwidth.

Every server binds 127.0.0.1, uses the same number of threads and is stopped before the next one starts.
The command lines are built by pure functions (`*_command`) so the tests can check them without starting
anything.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_plan import tensor_bytes_safetensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP = ROOT / ".peers/llama.cpp"
VLLM_BIN = ROOT / ".peers/vllm/bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def llmopt_command(model: str, port: int, *, max_seqs: int, max_model_len: int = 2048, kv_memory: str = "1GiB",
                   dtype: str = "bfloat16", python: str = sys.executable) -> list[str]:
    return [python, "-m", "llmopt", "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--device", "cpu", "--max-model-len", str(max_model_len), "--kv-cache-memory", kv_memory,
            "--max-num-seqs", str(max(64, max_seqs))]


def llamacpp_command(gguf: str, port: int, *, threads: int, slots: int, ctx_per_slot: int,
                     binary: str | Path = LLAMACPP / "bin/llama-server") -> list[str]:
    """llama-server with `slots` parallel sequences sharing one KV pool of slots x ctx_per_slot tokens, prompt
    cache on (and the cross-slot RAM cache, its default), the same threads for prompt and decode."""
    return [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-c", str(slots * ctx_per_slot), "--parallel", str(slots), "--kv-unified", "--cache-prompt", "--no-webui",
            "--metrics"]


def vllm_command(model: str, port: int, *, max_model_len: int = 2048, bin_dir: Path = VLLM_BIN) -> list[str]:
    return [str(bin_dir / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len)]


def vllm_env(threads: int, kv_gib: int = 2) -> dict[str, str]:
    """As benchmarks/peers/vllm_interop.py runs vLLM CPU: its own KV space, OMP threads bound to cores 0..n-1,
    and int4 weights with bf16 activations (VLLM_CPU_INT4_W4A8=0; the default on AMX CPUs is int8 activations,
    which is not W4A16)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_INT4_W4A8": "0", "VLLM_LOGGING_LEVEL": "WARNING", **thread_env(threads),
            "PATH": f"{VLLM_BIN}:{os.environ.get('PATH', '')}"}


class Server:
    """A server process in its own process group, its log in a file; a context manager that always stops it."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, port: int, timeout_s: float = 600,
                 unset: tuple[str, ...] = ()):
        self.name, self.cmd, self.port, self.log, self.timeout_s = name, cmd, port, log, timeout_s
        self.env = {k: v for k, v in {**os.environ, **env}.items() if k not in unset}
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.log.open("w")
        self._f.write("$ " + " ".join(self.cmd) + "\n")
        self._f.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        try:
            wait_healthy(self.url, self.proc, self.timeout_s, paths=("/health", "/v1/models"), poll_s=0.5)
        except RuntimeError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting; "
                                   f"last log lines:\n{tail(self.log)}") from None
            raise RuntimeError(f"{self.name} not ready after {self.timeout_s:.0f} s; log {self.log}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if getattr(self, "_f", None):
            self._f.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600, paths: tuple[str, ...] = ("/health",),
                 poll_s: float = 0.2) -> None:
    """Until every one of `paths` under `url` answers 200; raises when the process exits first or the time
    runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode} while starting")
        try:
            if all(httpx.get(url + p, timeout=2 if p == "/health" else 5).status_code == 200 for p in paths):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)


def llamacpp_decode_rate(url: str, prompt: str, n_predict: int, timeout_s: float = 1800) -> float:
    """Decode tok/s of one greedy completion of `n_predict` tokens, from llama-server's own timings (prompt
    cache off, so every call decodes alike)."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    r = httpx.post(url + "/completion", json=body, timeout=timeout_s)
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -------------------------------------------------------------------------------------- checkpoints


def hf_dir(model: str = "smollm2-135m") -> Path:
    from llmopt.models.resolve import resolve_model, weights_dir

    return Path(weights_dir(resolve_model(model)))


def quantized_checkpoint(out: Path, scheme: str, group_size: int | None = None, model: str = "smollm2-135m",
                         python: str = sys.executable, lm_head: str | None = None) -> Path:
    """`llmopt quantize MODEL --scheme SCHEME [--group-size G] [--lm-head H] -o OUT` once (RTN,
    compressed-tensors)."""
    if (out / "config.json").is_file():
        return out
    cmd = [python, "-m", "llmopt", "quantize", model, "--scheme", scheme, "-o", str(out)]
    if group_size is not None:
        cmd += ["--group-size", str(group_size)]
    if lm_head is not None:
        cmd += ["--lm-head", lm_head]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def gguf_models(models_dir: Path = LLAMACPP / "models") -> dict[str, Path]:
    return {q: models_dir / f"smollm2-135m-{q}.gguf" for q in ("bf16", "q8_0", "q4_0")}


def tensor_bytes_gguf(path: Path) -> dict[str, int]:
    """name -> bytes of every tensor in a GGUF file (gguf-py's reader, from llama.cpp's source or the venv)."""
    gguf_py = LLAMACPP / "src/gguf-py"
    if gguf_py.is_dir() and str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}


def tensor_bytes_dir(path: Path) -> dict[str, int]:
    return tensor_bytes_safetensors(sorted(Path(path).glob("*.safetensors")), float_bytes=2)


def model_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ------------------------------------------------------------------------------------ memory bandwidth


COPY_MIB_MAX = 2048  # the copy's buffer: far past the caches, and a 16 GB read buffer's copy would not fit in 24 GiB


def measure_bandwidth(threads: int, mib: int = 1024, repeats: int = 7) -> dict[str, float]:
    """Best-of-N memory bandwidth in GB/s with `threads` torch threads on a buffer far larger than the caches:
    read (a sum over `mib`, what decode does with weights) and copy (read + write of the first
    `COPY_MIB_MAX` of it at most, counted as 2x the bytes copied)."""
    import torch

    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty(min(n, COPY_MIB_MAX * 2**20 // 4), dtype=torch.float32)
    src = x[: y.numel()]
    x.sum()
    y.copy_(src)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t)
    return {"read_gbs": n * 4 / best_read / 1e9, "copy_gbs": 2 * y.numel() * 4 / best_copy / 1e9, "buffer_mib": mib,
            "copy_mib": y.numel() * 4 // 2**20, "threads": threads}
