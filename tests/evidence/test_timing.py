"""The one timer of the benchmark scripts (``fastweights.evidence.timing``, issue 48): what a call's seconds are on
each clock, where CUDA's synchronisation falls, which calls are warm-up, the median; and that the speed benchmarks
time through it rather than with a stopwatch of their own."""

import re

from fastweights.evidence.timing import call_seconds, samples, timeit, upper_median
from helpers import ROOT

# speed benchmarks that still read a clock themselves, with why (each entry must still be true)
OWN_CLOCK = {
    "fwl_scoring.py": "its --before result is this script run on another checkout's src, older than the timer",
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
