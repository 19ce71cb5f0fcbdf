"""How many CPU threads the engine's matmuls and kernels run on: a fixed count, or `auto`.

Why `auto`: an OpenMP parallel region ends at a barrier where every thread waits for the slowest. A
thread that shares its core with another busy process gets that core in scheduler slices of
milliseconds, and every region of a decode step (hundreds per token) waits for it: with one of two
cores busy elsewhere, decode fell to 17% of its quiet speed (issue #31; llama.cpp falls as far). The
same step on the cores nobody else is using keeps the share those cores can give. So `auto` counts the
cores other processes keep busy (from /proc/stat, less this process's own time) and runs on the rest,
following a neighbour that comes or goes within half a second. The load is read four times a second on a thread
of its own (`LoadSampler`) and the engine takes its reading between steps: read only between steps, the first
reading after an idle stretch averaged over the whole stretch, load long gone included, and a decode that
started on a quiet machine ran its first second on too few threads (docs/BENCHMARKS.md, "Decode on a shared
CPU"). A core counts as taken only when two windows in a row say so, and as free again from the first window
that says so: a neighbour's burst of a fraction of a second (a benchmark client starting) costs no threads, and
the cores come back a quarter of a second after it ends, not a second ("The benchmark client's start").
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)

Threads = int | Literal["auto"] | None  # None: leave torch's setting as it is
RECHECK_S = 1.0  # how often `auto` reads the load itself between steps (no sampler thread: a forked process)
SAMPLE_S = 0.25  # the sampler thread's window
SUSTAIN = 2  # windows in a row that must see a neighbour before `auto` gives up its core
BUSY_CORE = 0.5  # a core counts as taken when other processes used more than this share of it


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _read_stat(cpus: set[int] | None) -> tuple[int, int, int] | None:
    """(all CPU time, busy CPU time) over `cpus` (None: every CPU) and this process's CPU time, in clock
    ticks since boot; None off Linux. Only the CPUs this process may run on count: a neighbour on a core
    outside its affinity mask takes nothing from it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        total = busy = 0
        for line in lines:
            name, *rest = line.split()
            if not name.startswith("cpu"):
                break
            wanted = name == "cpu" if cpus is None else name != "cpu" and int(name[3:]) in cpus
            if not wanted:
                continue
            fields = [int(x) for x in rest[:8]]
            total += sum(fields)
            busy += sum(fields) - fields[3] - fields[4]  # less idle + iowait; steal is busy: a neighbour VM's
        return total, busy, int(own[11]) + int(own[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


class CpuLoad:
    """Cores' worth of CPU time that other processes used between two readings, on the CPUs this process
    may run on."""

    def __init__(self):
        self._cpus = _allowed_cpus()
        self.cpus = len(self._cpus) if self._cpus else (os.cpu_count() or 1)
        self._last = _read_stat(self._cpus)

    def others(self) -> float | None:
        now = _read_stat(self._cpus)
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        d_total, d_busy, d_own = now[0] - last[0], now[1] - last[1], now[2] - last[2]
        return max(0.0, (d_busy - d_own) / d_total * self.cpus)


class LoadSampler:
    """`load.others()` every `period` seconds on a daemon thread: `latest` is the last full window's reading
    (None before the first), `sustained` the least of the last SUSTAIN (the load that has lasted). Stops on
    `close()`; a process forked from this one has no such thread (`alive` is False there), and its policy
    reads the load itself."""

    def __init__(self, load: CpuLoad, period: float = SAMPLE_S):
        self._load, self.period = load, period
        self._recent: list[float] = []  # the last SUSTAIN readings, replaced whole (read from another thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmopt-cpu-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            others = self._load.others()
            if others is not None:
                self.record(others)

    def record(self, others: float) -> None:
        """One window's reading (the thread's; a test's)."""
        self._recent = [*self._recent, others][-SUSTAIN:]

    @property
    def latest(self) -> float | None:
        recent = self._recent
        return recent[-1] if recent else None

    @property
    def sustained(self) -> float | None:
        recent = self._recent
        return min(recent) if recent else None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()


_TORCH_DEFAULT = torch.get_num_threads()  # at import, before any engine changed it: OMP_NUM_THREADS or the cores


def default_threads() -> int:
    """The most threads `auto` uses: OMP_NUM_THREADS when set (now), else torch's own default, the
    physical cores it may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) >= 1 else _TORCH_DEFAULT


def free_cores(others: float, most: int) -> int:
    """Cores left when others use `others` cores' worth of time: at least one, at most `most`."""
    taken = math.floor(others + (1 - BUSY_CORE))  # 0.4 busy -> 0 taken, 0.6 -> 1, 1.0 -> 1, 1.6 -> 2
    return max(1, min(most, most - taken))


class ThreadPolicy:
    """Sets torch's thread count at start and, for `auto`, follows the free cores between steps (`tick`)."""

    def __init__(self, threads: Threads, load: CpuLoad | None = None, clock=time.monotonic,
                 most: int | None = None, sampler: LoadSampler | None = None):
        """`load`: read at each tick, at most once per RECHECK_S (a script of readings, in tests); without it,
        `auto` reads /proc/stat on a `LoadSampler` (`sampler`, or its own, stopped with this policy)."""
        self.auto = threads == "auto"
        self.sets = threads is not None  # None: the process's setting, never touched
        self.most = most or default_threads()
        self._clock = clock
        self._load = load
        self._sampler = sampler
        self._last = clock()
        if threads is None:  # as the process has it (a caller's torch.set_num_threads included)
            self.threads = torch.get_num_threads()
            return
        if self.auto:
            if load is None and sampler is None:
                self._load = CpuLoad()
                time.sleep(0.2)  # a first reading over a short window
                first = self._pick(self.most)
                self._sampler = LoadSampler(self._load)  # from here on, the load is the sampler's to read
                weakref.finalize(self, self._sampler.close)
                self.threads = first
            else:
                self.threads = self._pick(self.most)
        else:
            self.threads = int(threads)
        torch.set_num_threads(self.threads)

    def _pick(self, current: int) -> int:
        if self._sampler is not None and self._sampler.alive:
            others = self._sampler.sustained
        elif self._load is not None:  # a scripted load, the first reading, or a forked process (no sampler thread)
            others = self._load.others()
        else:  # a caller's sampler, closed: keep the count
            others = None
        return current if others is None else free_cores(others, self.most)

    def tick(self) -> None:
        """Between engine steps: put back this engine's count if another engine in the process changed
        torch's (an A/B of two thread settings); with `auto`, move to the cores now free (by the sampler's
        sustained reading, or at most once per RECHECK_S by reading the load here)."""
        if not self.sets:
            return
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if not self.auto:
            return
        if self._sampler is None or not self._sampler.alive:
            now = self._clock()
            if now - self._last < RECHECK_S:
                return
            self._last = now
        n = self._pick(self.threads)
        if n != self.threads:
            log.info("threads: %d -> %d (other processes keep %d of %d cores busy)", self.threads, n,
                     self.most - n, self.most)
            self.threads = n
            torch.set_num_threads(n)

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads != 1 else ''}" + (
            f" (auto: the free cores of {self.most})" if self.auto else "")
