"""The bf16 paged decode-attention kernel (`paged_decode.c`): built on first use with the system C
compiler, cached, and called through ctypes.

Why: SDPA wants each sequence's K/V contiguous, so every decode step copied all of its sequences'
blocks out of the pool, per layer, before an SDPA call that runs far below memory speed with one query
row per head. At batch 32 and 400 tokens of context that gather and SDPA were half of a bf16 decode
step. The kernel reads the blocks where they lie, one pass over K and one over V: per layer 1.5-2.4x
faster than gather + SDPA at one thread, 2.2-3.9x at two (docs/BENCHMARKS.md, "Paged decode kernel").

It is built with `cc -O3 -march=native -fopenmp` (`$CC` if set) into the llmopt cache under a name
keyed by its source, the compiler and the CPU, so a cache shared by different machines never loads a
build for another CPU. OpenMP is linked against torch's own libgomp where torch ships one, so the
kernel and torch share one thread pool. When there is no compiler or the build fails, `load()` logs
why once and returns None, and attention stays on SDPA. ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from llmopt.cache import cache_root
from llmopt.io import write_bytes_atomic

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
MAX_QUERY_GROUP = 64  # query heads per KV head the kernel takes (its per-group scratch)

_loaded: dict[str, PagedDecodeKernel | None] = {}  # by compiler: the kernel, or None once a build failed


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _torch_lib_dir() -> Path | None:
    """torch's lib folder when it ships its own libgomp (linking against it shares torch's threads)."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if any(lib.glob("libgomp*.so*")) else None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _run(cmd: list[str]) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"{cmd[0]}: {e}") from None
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()
        raise KernelBuildError(f"{' '.join(cmd[:2])} failed: {first[0] if first else f'exit {proc.returncode}'}")


def build(cc: str, cache_dir: Path) -> Path:
    """Compile the kernel with `cc` into `cache_dir` (once: an existing build is reused); returns the .so.
    Compiled with -ffast-math, linked without it: a -ffast-math link adds crtfastmath, which would turn
    on flush-to-zero for the whole process when the library loads."""
    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"no C compiler {cc!r} ({e})") from None
    libdir = _torch_lib_dir()
    link = [f"-L{libdir}", f"-Wl,-rpath,{libdir}"] if libdir else []
    key = hashlib.sha256(b"\0".join([src, version.encode(), " ".join(COMPILE_FLAGS + link).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    so = cache_dir / f"paged_decode-{key}.so"
    if so.exists():
        return so
    with tempfile.TemporaryDirectory(prefix="llmopt-kernel-") as tmp:
        obj, out = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        _run([cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)])
        _run([cc, "-shared", "-fopenmp", str(obj), "-o", str(out), *link, "-lm"])
        # fsynced and renamed in: a crash never leaves a truncated library under the final name (it
        # would fail to load, and exist, forever); a concurrent build of the same key writes the same bytes
        write_bytes_atomic(so, out.read_bytes())
    return so


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one decode group of one layer."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_decode_bf16
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn, self._lib, self.path = fn, lib, path

    @staticmethod
    def supports(q: torch.Tensor, k_pool: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_pool.dtype == torch.bfloat16
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERY_GROUP)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                 lens: torch.Tensor, start_block: int, block_size: int, window: int, scale: float) -> torch.Tensor:
        """q [B, H, D]; k_pool, v_pool [Hkv, slots, D] (one layer); blocks [B, n] (the first holds
        positions from start_block * block_size); lens [B]. Returns [B, H*D]."""
        b, h, d = q.shape
        q = q.contiguous()
        out = torch.empty(b, h * d, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                      lens.data_ptr(), b, h, k_pool.shape[0], d, k_pool.shape[1], block_size, start_block, window,
                      scale, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("paged decode kernel failed: a shape it does not take, or no memory for its scratch")
        return out


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None (after one warning) when it cannot be built here."""
    cc = _compiler()
    key = cc or ""
    if key not in _loaded:
        try:
            if cc is None:
                raise KernelBuildError("no C compiler found (set CC)")
            _loaded[key] = PagedDecodeKernel(build(cc, cache_root() / "kernels"))
        except (KernelBuildError, OSError) as e:
            log.warning("paged decode kernel unavailable (%s); bf16 decode attention uses SDPA", e)
            _loaded[key] = None
    return _loaded[key]
