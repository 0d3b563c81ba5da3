"""The one timer of the benchmark scripts (``fastweights.evidence.timing``, issue 48): what a call's seconds are on
each clock, where CUDA's synchronisation falls, which calls are warm-up, the median; that the speed benchmarks
time through it rather than with a stopwatch of their own; and that the threads a benchmark times on have one
``--threads`` flag and one default (``fastweights.core.threads.BENCHMARK_THREADS``)."""

import argparse
import re

from fastweights.core.threads import BENCHMARK_THREADS
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import call_seconds, samples, timeit, upper_median
from helpers import ROOT

# speed benchmarks that still read a clock themselves, with why (each entry must still be true)
OWN_CLOCK = {
    "fwl_scoring.py": "its --before result is this script run on another checkout's src, older than the timer",
}

# scripts that still declare --threads or set torch's threads themselves, with why (each entry must still be true)
OWN_THREADS = {
    "speed/fwl_scoring.py": "its --before result is this script run on another checkout's src, older than the flag",
    "tools/probes.py": "an evidence tool, not a benchmark: a probe runs on one thread and gives the caller's count back",
}


class Clock:
    """A clock that advances only when told, logging each reading into a shared journal."""

    def __init__(self, name, journal):
        self.name, self.journal, self.t = name, journal, 0.0

    def __call__(self):
        self.journal.append(self.name)
        return self.t


def test_one_call_is_timed_on_each_clock_between_two_synchronisations():
    journal = []
    wall, cpu = Clock("wall", journal), Clock("cpu", journal)

    def work():
        journal.append("work")
        wall.t += 2.0
        cpu.t += 0.5

    assert call_seconds(work, (wall, cpu), sync=lambda: journal.append("sync")) == (2.0, 0.5)
    assert journal == ["sync", "wall", "cpu", "work", "sync", "wall", "cpu"]


def test_warm_up_calls_are_not_timed_and_the_median_is_the_upper_middle():
    journal = []
    clock = Clock("clock", journal)
    costs = iter([100.0, 3.0, 1.0, 2.0, 4.0])  # the first call (a warm-up) is slow

    def work():
        clock.t += next(costs)

    assert samples(work, 4, warmup=1, clocks=(clock,)) == [(3.0,), (1.0,), (2.0,), (4.0,)]
    assert upper_median([3.0, 1.0, 2.0, 4.0]) == 3.0 and upper_median([2.0, 9.0, 1.0]) == 2.0
    costs = iter([100.0, 5.0, 1.0, 2.0])
    assert timeit(work, warmup=1, repeat=3, clock=clock) == 2.0


def test_the_speed_benchmarks_read_no_clock_of_their_own():
    reading = {p.name for p in sorted((ROOT / "benchmarks" / "speed").glob("*.py"))
               if re.search(r"time\.(perf_counter|process_time)\(\)", p.read_text())}
    assert reading <= set(OWN_CLOCK), f"{sorted(reading - set(OWN_CLOCK))}: time with fastweights.evidence.timing"
    assert set(OWN_CLOCK) <= reading, f"{sorted(set(OWN_CLOCK) - reading)}: fixed, remove it from OWN_CLOCK"


def test_the_benchmarks_threads_flag_has_one_default():
    parser = argparse.ArgumentParser()
    benchmark_threads_flag(parser)
    assert parser.parse_args([]).threads == BENCHMARK_THREADS == 1  # what the stored results ran with
    assert parser.parse_args(["--threads", "2"]).threads == 2


def test_no_benchmark_declares_its_own_threads_flag_or_sets_torchs_threads():
    own = {p.relative_to(ROOT).as_posix().removeprefix("benchmarks/") for p in sorted(
               [*(ROOT / "benchmarks").glob("*/*.py"), *(ROOT / "tools").glob("*.py")])
           if re.search(r"""add_argument\(\s*["']--threads["']|torch\.set_num_threads\(""", p.read_text())}
    assert own <= set(OWN_THREADS), (f"{sorted(own - set(OWN_THREADS))}: use fastweights.evidence.script_args."
                                     "benchmark_threads_flag and fastweights.core.threads.use_threads('benchmark', n)")
    assert set(OWN_THREADS) <= own, f"{sorted(set(OWN_THREADS) - own)}: fixed, remove it from OWN_THREADS"


def test_a_profiled_step_splits_into_gemm_attention_and_the_rest():
    import torch
    import torch.nn.functional as F

    from fastweights.evidence.timing import op_class, op_shares

    assert [op_class(n) for n in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mul")] == \
        ["gemm", "gemm", "gemm", "attention", "other"]
    x, w = torch.randn(256, 256), torch.randn(256, 256)
    q = torch.randn(1, 2, 64, 32)

    def step():
        (x @ w).relu_().exp_()
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

    shares = op_shares(step, steps=2)
    assert set(shares) == {"gemm", "attention", "other"} and abs(sum(shares.values()) - 1) < 1e-9
    assert all(v > 0 for v in shares.values())


def test_the_benchmark_clock_is_this_processs_cpu_time_on_one_thread_else_wall_time(monkeypatch):
    """What a result records as its clock: CPU seconds of this process on one CPU thread (other jobs on the core do
    not count), wall seconds with more threads or on a GPU, each named as the results' tables show it."""
    import time

    import torch

    from fastweights.evidence.timing import bench_clock

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert bench_clock("cpu") == (time.process_time, "process CPU time")
    assert bench_clock("cuda") == (time.perf_counter, "wall")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert bench_clock("cpu") == (time.perf_counter, "wall")


class _Ticks:
    """A clock that advances one second a reading: a call's seconds count the readings it makes."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_interleaved_samples_take_each_function_in_turn_after_its_warm_up():
    from fastweights.evidence.timing import interleaved_samples

    calls = []
    clock = _Ticks()
    fns = {"a": lambda: calls.append("a"), "b": lambda: (calls.append("b"), clock())}  # b reads the clock once
    out = interleaved_samples(fns, rounds=3, clocks=(clock,), warmup=2)
    assert calls == ["a", "b"] * 5  # two untimed rounds, then three timed, a and b alternating
    assert out == {"a": [(1.0,)] * 3, "b": [(2.0,)] * 3}


def test_timed_rounds_give_each_function_one_median_a_round():
    from fastweights.evidence.timing import timed_rounds

    clock, calls = _Ticks(), []
    out = timed_rounds({"a": lambda: calls.append("a"), "b": lambda: (calls.append("b"), clock(), clock())},
                       rounds=2, repeat=3, clock=clock)
    assert calls == (["a"] * 4 + ["b"] * 4) * 2  # per round: a's warm-up and 3 timed calls, then b's
    assert out == {"a": [1.0, 1.0], "b": [3.0, 3.0]}


def test_step_timing_on_the_cpu_reports_the_median_every_call_and_the_warm_up():
    import torch

    from fastweights.evidence.timing import step_timing

    calls = []
    out = step_timing(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeat=5)
    assert len(calls) == 7 and len(out["seconds_all"]) == 5 and "peak_bytes" not in out
    assert abs(out["seconds_median"] - sorted(out["seconds_all"])[2]) <= 1e-6  # the middle of five (rounded to 1e-6)
    assert set(out) == {"seconds_median", "seconds_all", "warmup_seconds_total"}


def test_the_cpu_seconds_of_ended_children_count_after_they_end():
    import subprocess
    import sys

    from fastweights.evidence.timing import children_cpu_seconds

    before = children_cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert children_cpu_seconds() - before > 0.05


def test_a_scripts_log_line_starts_with_the_time_of_day(capsys):
    from fastweights.evidence.script_log import log

    log("scored 4 texts")
    out = capsys.readouterr().out
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] scored 4 texts\n", out), out


class _CudaStandIn:
    """torch.cuda's calls that the timers make, recorded in order (a CUDA device stood in for on the CPU)."""

    def __init__(self, monkeypatch, log):
        import torch

        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: log.append((name, *a)))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: log.append(("peak", *a)) or 12345)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_step_timing_on_cuda_synchronises_each_call_and_reports_the_peak_memory(monkeypatch):
    import types

    from fastweights.evidence import timing

    log = []
    _CudaStandIn(monkeypatch, log)
    seconds = iter([0.98765, 0.1234567, 0.2, 0.3000004])

    def call_seconds(fn, clocks=None, sync=None):  # timing's own, with fixed durations
        if sync is not None:
            sync()
        fn()
        if sync is not None:
            sync()
        return (next(seconds),)

    monkeypatch.setattr(timing, "call_seconds", call_seconds)
    gpu = types.SimpleNamespace(type="cuda")
    out = timing.step_timing(lambda: log.append("step"), gpu, warmup=2, repeat=3)
    assert log == [("empty_cache",), ("reset_peak_memory_stats", gpu), "step", "step", ("synchronize", gpu),
                   *[("synchronize", gpu), "step", ("synchronize", gpu)] * 3, ("peak", gpu)]
    assert out == {"seconds_median": 0.2, "seconds_all": [0.123457, 0.2, 0.3], "warmup_seconds_total": 0.988,
                   "peak_bytes": 12345}
    assert list(out) == ["seconds_median", "seconds_all", "warmup_seconds_total", "peak_bytes"]


def test_samples_and_timeit_synchronise_cuda_around_every_timed_call(monkeypatch):
    from fastweights.evidence import timing

    log = []
    timing.samples(lambda: log.append("call"), 2, warmup=1, sync=lambda: log.append("sync"))
    assert log == ["call"] + ["sync", "call", "sync"] * 2
    log.clear()
    _CudaStandIn(monkeypatch, log)
    timing.timeit(lambda: log.append("call"), warmup=1, repeat=2)
    assert log == ["call"] + [("synchronize",), "call", ("synchronize",)] * 2
    log.clear()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    timing.timeit(lambda: log.append("call"), warmup=0, repeat=2)
    assert log == ["call", "call"]


def test_op_shares_add_each_ops_own_time_into_its_class(monkeypatch):
    import types

    import torch

    from fastweights.evidence import timing

    events = [types.SimpleNamespace(key=k, self_cpu_time_total=t) for k, t in
              (("aten::mm", 30.0), ("aten::addmm", 10.0), ("aten::mul", 20.0), ("aten::add", 20.0),
               ("aten::_scaled_dot_product_flash_attention_for_cpu", 20.0))]
    seen = {}

    class Profile:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    steps = []
    assert timing.op_shares(lambda: steps.append(1), steps=4) == {"gemm": 0.4, "attention": 0.2, "other": 0.4}
    assert steps == [1] * 4 and seen == {"activities": [torch.profiler.ProfilerActivity.CPU]}
    events.clear()  # a step with no ops: all shares 0, not a division by zero
    assert timing.op_shares(lambda: None) == {"gemm": 0.0, "attention": 0.0, "other": 0.0}


def test_a_scripts_log_line_is_flushed_at_once(monkeypatch):
    import io
    import sys

    from fastweights.evidence.script_log import log

    class Out(io.StringIO):
        flushes = 0

        def flush(self):
            Out.flushes += 1

    monkeypatch.setattr(sys, "stdout", Out())
    log("x")
    assert Out.flushes == 1


def test_the_cpu_seconds_of_children_are_their_user_and_system_time(monkeypatch):
    import resource
    import types

    from fastweights.evidence.timing import children_cpu_seconds

    asked = []
    monkeypatch.setattr(resource, "getrusage", lambda who: asked.append(who) or types.SimpleNamespace(ru_utime=2.5,
                                                                                                      ru_stime=0.75))
    assert children_cpu_seconds() == 3.25 and asked == [resource.RUSAGE_CHILDREN]
