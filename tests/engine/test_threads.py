"""The engine's CPU thread policy (llmopt.engine.threads): fixed counts, and `auto` following free cores."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from llmopt.engine.config import EngineConfig
from llmopt.engine.threads import RECHECK_S, CpuLoad, ThreadPolicy, free_cores


@pytest.mark.parametrize(("others", "most", "free"), [
    (0.0, 2, 2), (0.4, 2, 2), (0.6, 2, 1), (1.0, 2, 1), (1.9, 2, 1), (3.0, 2, 1), (1.0, 16, 15), (0.0, 1, 1)])
def test_free_cores(others, most, free):
    assert free_cores(others, most) == free


class Load:
    """Other processes' load as a script: the policy's input, not the thing under test."""

    def __init__(self, values):
        self.values = list(values)

    def others(self):
        return self.values.pop(0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_auto_follows_a_neighbour_that_comes_and_goes():
    clock = Clock()
    policy = ThreadPolicy("auto", load=Load([0.1, 1.0, 1.0, 0.05]), clock=clock, most=2)
    assert policy.threads == 2 and torch.get_num_threads() == 2
    policy.tick()  # too soon: nothing read
    assert policy.threads == 2
    clock.t += RECHECK_S
    policy.tick()
    assert policy.threads == 1 and torch.get_num_threads() == 1
    clock.t += RECHECK_S
    policy.tick()
    assert policy.threads == 1
    clock.t += RECHECK_S
    policy.tick()
    assert policy.threads == 2 and "auto" in policy.describe()


def test_fixed_count_is_put_back_after_another_engine_changed_it():
    policy = ThreadPolicy(2)
    torch.set_num_threads(1)  # a second engine in the process, e.g. the other side of an A/B
    policy.tick()
    assert torch.get_num_threads() == 2


def test_none_leaves_the_process_setting_alone():
    torch.set_num_threads(1)
    policy = ThreadPolicy(None, most=2)
    policy.tick()
    assert policy.threads == 1 and torch.get_num_threads() == 1


def test_cpu_load_sees_a_busy_process():
    """A real spinner: CpuLoad counts it, and not this process's own time."""
    load = CpuLoad()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        load.others()  # from here on the spinner runs for the whole window
        t = time.perf_counter()
        while time.perf_counter() - t < 0.5:
            pass  # our own busy time must not count
        time.sleep(0.5)
        others = load.others()
    finally:
        spinner.kill()
        spinner.wait()
    assert others is not None and 0.7 <= others <= load.cpus, others


@pytest.mark.parametrize("bad", ["zero", 0, -1, 1.5, True])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match="positive count or auto"):
        EngineConfig(num_threads=bad)


def test_thread_count_strings_are_counts():
    assert EngineConfig(num_threads="3").num_threads == 3
    assert EngineConfig(num_threads="auto").num_threads == "auto"


class Quiet(Load):
    """After the script, a quiet machine for ever."""

    def others(self):
        return self.values.pop(0) if self.values else 0.0


def test_auto_decides_by_the_last_reading_not_by_an_idle_stretch():
    """The sampler reads the load on its own thread, so the first step after an idle stretch sees the machine
    as it is now: a neighbour that kept a core busy for most of the stretch and left is not counted. (Read
    only between steps, one reading spanned the whole stretch and put the first second on one thread.)"""
    from llmopt.engine.threads import LoadSampler

    busy_then_quiet = Quiet([1.0] * 5)  # five readings with a neighbour, then none
    sampler = LoadSampler(busy_then_quiet, period=0.01)
    try:
        policy = ThreadPolicy("auto", most=2, sampler=sampler)
        deadline = time.monotonic() + 5
        while sampler.latest != 1.0 and time.monotonic() < deadline:
            time.sleep(0.005)
        policy.tick()  # the neighbour, as the sampler last saw it
        assert policy.threads == 1 and torch.get_num_threads() == 1
        while (busy_then_quiet.values or sampler.latest != 0.0) and time.monotonic() < deadline:
            time.sleep(0.005)  # idle: no steps, no ticks, while the neighbour leaves
        policy.tick()  # the first step after the stretch: no wait for a new window
        assert policy.threads == 2 and torch.get_num_threads() == 2
    finally:
        sampler.close()


def test_a_neighbour_counts_once_two_windows_see_it_and_stops_counting_at_the_first_without():
    """A burst of one window (a benchmark client starting next to a server) takes no thread; a neighbour
    that stays takes one from its second window; once it leaves, the first quiet window gives it back."""
    from llmopt.engine.threads import SUSTAIN, LoadSampler

    sampler = LoadSampler(Quiet([]), period=3600)  # no window of its own in this test: `record` is the input
    try:
        policy = ThreadPolicy("auto", most=2, sampler=sampler)
        seen = []
        for others in [0.0, 1.0, 0.1] + [1.0] * SUSTAIN + [1.0, 0.05, 0.0]:
            sampler.record(others)
            policy.tick()
            seen.append(policy.threads)
        assert seen == [2, 2, 2] + [2] * (SUSTAIN - 1) + [1, 1, 2, 2]
        assert sampler.latest == 0.0 and sampler.sustained == 0.0
    finally:
        sampler.close()


def test_a_real_auto_policy_samples_on_its_own_thread_and_stops_with_it():
    import gc
    import threading

    def samplers():
        return {t for t in threading.enumerate() if t.name == "llmopt-cpu-load"}

    before = samplers()
    policy = ThreadPolicy("auto", most=2)
    (mine,) = samplers() - before  # one new thread, this policy's
    assert 1 <= policy.threads <= 2
    del policy
    gc.collect()
    mine.join(timeout=3 * RECHECK_S)
    assert not mine.is_alive()
