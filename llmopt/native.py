"""Small C kernels, built on first use with the system C compiler, cached, and loaded through ctypes.

Why: a few hot loops (paged decode attention, int8 weight-only matmuls at decode sizes) run far below
memory speed in torch's CPU kernels, and a short C file with OpenMP closes that without a build step at
install time. Each source is built with `cc -O3 -march=native -fopenmp` (`$CC` if set) into the llmopt
cache under a name keyed by its source, the compiler (path and version) and the CPU, so a cache shared
by different machines never loads a build for another CPU. OpenMP is linked against torch's own
libgomp where torch ships one, so the kernels and torch share one thread pool. When there is no
compiler or a build fails, `load()` logs why once and returns None, and the caller keeps its torch
path. ctypes releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from llmopt.cache import cache_root
from llmopt.io import write_bytes_atomic

log = logging.getLogger(__name__)

COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# shared by the kernels, on their include path
HEADERS = [Path(__file__).with_name(h) for h in ("native_bf16.h", "native_amx.h")]

T = TypeVar("T")
_loaded: dict[Path, object] = {}  # source -> the wrapped library, or None once a build failed
_libc: ctypes.CDLL | bool | None = None  # for trim_heap: None until looked up, False where there is none


class KernelBuildError(RuntimeError):
    pass


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _torch_lib_dir() -> Path | None:
    """torch's lib folder when it ships its own libgomp (linking against it shares torch's threads)."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if any(lib.glob("libgomp*.so*")) else None


def _cpuinfo_line(*keys: str) -> str:
    """The first /proc/cpuinfo line that starts with one of `keys`, or "" (no such line, or no /proc)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo_line("flags", "Features")


# CPU vendors whose cores multiply faster in float32 FMAs than in AVX512-BF16's vdpbf16ps: on Intel cores
# vdpbf16ps takes about two cycles on both 512-bit ports, four times an FMA's share (docs/BENCHMARKS.md, "float32
# passes"); AMD's Zen 4 is documented to run it at an FMA's cost with twice the products, and keeps it (not measured
# there). bf16_linear.c's passes (packed_linear.py) and prefill_attention.c's float32 kernel both follow it.
FMA_VENDORS = ("GenuineIntel",)


def fma_beats_vdpbf16ps() -> bool:
    """Whether this CPU's vendor is one of FMA_VENDORS."""
    return cpu_vendor() in FMA_VENDORS


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where it names none: the same
    instruction can cost twice as much on one vendor's cores (docs/BENCHMARKS.md, "float32 passes")."""
    return _cpuinfo_line("vendor_id").partition(":")[2].strip()


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere). Why: after a large
    tensor is freed, glibc raises its mmap threshold, so later tensors of that size come from the heap,
    whose freed pages it keeps; a streamed loop that frees a layer per step would otherwise grow its
    resident memory by the layer size until the heap happens to be reused."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def cpu_has(feature: str) -> bool:
    """Whether this CPU lists `feature` (as /proc/cpuinfo names it, e.g. "amx_bf16"): which kernel wins
    can depend on it (docs/BENCHMARKS.md, "AMX")."""
    return feature in _cpu_flags().split()


def _run(cmd: list[str]) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"{cmd[0]}: {e}") from None
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()
        raise KernelBuildError(f"{' '.join(cmd[:2])} failed: {first[0] if first else f'exit {proc.returncode}'}")


def build(source: Path, cc: str, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` with `cc` into `cache_dir` (once per source, headers, compiler, CPU and flags: an existing
    build is reused); returns the .so. `extra_flags` follow the usual ones (tests build the AVX2 passes on
    AVX-512 CPUs with -mno-avx512f).
    Compiled with -ffast-math, linked without it: a -ffast-math link adds crtfastmath, which would turn
    on flush-to-zero for the whole process when the library loads."""
    src = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in HEADERS)])
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"no C compiler {cc!r} ({e})") from None
    libdir = _torch_lib_dir()
    link = [f"-L{libdir}", f"-Wl,-rpath,{libdir}"] if libdir else []
    flags = [*COMPILE_FLAGS, *extra_flags]
    key = hashlib.sha256(b"\0".join([src, cc.encode(), version.encode(), " ".join(flags + link).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    so = cache_dir / f"{source.stem}-{key}.so"
    if so.exists():
        return so
    with tempfile.TemporaryDirectory(prefix="llmopt-kernel-") as tmp:
        obj, out = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        _run([cc, *flags, f"-I{HEADERS[0].parent}", "-c", str(source), "-o", str(obj)])
        _run([cc, "-shared", "-fopenmp", str(obj), "-o", str(out), *link, "-lm"])
        # fsynced and renamed in: a crash never leaves a truncated library under the final name (it
        # would fail to load, and exist, forever); a concurrent build of the same key writes the same bytes
        write_bytes_atomic(so, out.read_bytes())
    return so


def load(source: Path, wrap: Callable[[Path], T], fallback: str) -> T | None:
    """`wrap(built .so)`, built on first use with the compiler of that moment and kept for the process;
    None (after one warning naming `fallback`, what runs instead) when it cannot be built or loaded here.
    Only a dict lookup once loaded: this runs per kernel call, many times per decode step."""
    if source not in _loaded:
        cc = compiler()
        try:
            if cc is None:
                raise KernelBuildError("no C compiler found (set CC)")
            _loaded[source] = wrap(build(source, cc, cache_root() / "kernels"))
        except (KernelBuildError, OSError) as e:
            log.warning("%s kernel unavailable (%s); %s", source.stem.replace("_", " "), e, fallback)
            _loaded[source] = None
    return _loaded[source]  # type: ignore[return-value]
