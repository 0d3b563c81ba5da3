"""How the benchmark scripts time a call: CPU seconds or wall seconds, the median of repeats.

One thread on the CPU: this process's CPU seconds (other jobs taking turns on the core do not count); any
other setting: wall seconds, with CUDA synchronised around each call.
"""

from __future__ import annotations

import time

import torch


def bench_clock(device) -> tuple:
    """(clock, name) for timing on ``device``: with one CPU thread, this process's CPU seconds (other
    jobs taking turns on the core do not count); otherwise wall seconds."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, "process CPU time"
    return time.perf_counter, "wall"


def timeit(fn, warmup: int = 3, repeat: int = 10, clock=time.perf_counter) -> float:
    """Median seconds per call of ``fn`` (synchronising CUDA around each call).

    ``clock=time.process_time`` counts this process's CPU seconds instead of wall seconds: for a
    one-thread CPU measurement that is the work done, unaffected by other jobs taking turns on the core.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = clock()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(clock() - t)
    times.sort()
    return times[len(times) // 2]
