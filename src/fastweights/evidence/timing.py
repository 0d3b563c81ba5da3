"""How the benchmark scripts time a call: CPU seconds or wall seconds, one call, the samples of repeats or their
median. The one timer of ``benchmarks/``: a script chooses its clocks, repeats and summary, never its own stopwatch.
The threads it times on are ``--threads`` (:func:`fastweights.evidence.script_args.benchmark_threads_flag`), set by
``use_threads("benchmark", args.threads)``.

One thread on the CPU: this process's CPU seconds (other jobs taking turns on the core do not count); any
other setting: wall seconds, with CUDA synchronised around each call.
"""

from __future__ import annotations

import statistics
import time

import torch

#: wall seconds and this process's CPU seconds of the same call, read in that order
WALL_AND_CPU = (time.perf_counter, time.process_time)


def bench_clock(device) -> tuple:
    """(clock, name) for timing on ``device``: with one CPU thread, this process's CPU seconds (other
    jobs taking turns on the core do not count); otherwise wall seconds."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, "process CPU time"
    return time.perf_counter, "wall"


def call_seconds(fn, clocks=(time.perf_counter,), sync=None) -> tuple[float, ...]:
    """Seconds of one call of ``fn`` on each of ``clocks`` (each read before the call and after it, in order);
    ``sync`` (``torch.cuda.synchronize``, say) is called before the first reading and before the second."""
    if sync is not None:
        sync()
    start = [clock() for clock in clocks]
    fn()
    if sync is not None:
        sync()
    return tuple(clock() - t for clock, t in zip(clocks, start))


def samples(fn, repeat: int, warmup: int = 0, clocks=(time.perf_counter,), sync=None) -> list[tuple[float, ...]]:
    """``repeat`` timed calls of ``fn`` after ``warmup`` untimed ones: :func:`call_seconds` of each."""
    for _ in range(warmup):
        fn()
    return [call_seconds(fn, clocks, sync) for _ in range(repeat)]


def interleaved_samples(fns: dict, rounds: int, clocks=WALL_AND_CPU, warmup: int = 1) -> dict[str, list[tuple]]:
    """``rounds`` timed calls of each of ``fns`` (name -> fn) taken in turn, so that every one sees the same load
    of a shared machine, after ``warmup`` untimed calls of each: name -> :func:`call_seconds` of each call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(call_seconds(fn, clocks))
    return out


def children_cpu_seconds() -> float:
    """CPU seconds (user and system) of this process's children that have ended: what a script's ``fastweights``
    subprocesses cost, read before and after them."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def device_sync(device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_timing(step, device, warmup: int, repeat: int) -> dict:
    """Median wall seconds of ``step()`` on ``device`` after ``warmup`` calls, synchronised around each; every
    timed call's seconds, the warm-up's (its calls and their queued work together), and on CUDA the peak memory
    over all calls (what the GPU benchmarks record of each item)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def warm():  # the warm-up calls and their queued work, timed together
        for _ in range(warmup):
            step()
        device_sync(device)

    (first,) = call_seconds(warm)
    times = [s for (s,) in samples(step, repeat, sync=lambda: device_sync(device))]
    out = {"seconds_median": statistics.median(times), "seconds_all": [round(x, 6) for x in times],
           "warmup_seconds_total": round(first, 3)}
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def upper_median(values) -> float:
    """The middle value of the sorted ``values`` (of an even count, the upper of the two middle ones)."""
    values = sorted(values)
    return values[len(values) // 2]


def timeit(fn, warmup: int = 3, repeat: int = 10, clock=time.perf_counter) -> float:
    """Median seconds per call of ``fn`` (synchronising CUDA around each call).

    ``clock=time.process_time`` counts this process's CPU seconds instead of wall seconds: for a
    one-thread CPU measurement that is the work done, unaffected by other jobs taking turns on the core.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    return upper_median(s for (s,) in samples(fn, repeat, warmup, (clock,), sync))


def timed_rounds(fns: dict, rounds: int, repeat: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """``rounds`` rounds in each of which every one of ``fns`` (name -> fn) is timed in turn by :func:`timeit` (one
    warm-up call, the median of ``repeat``), so that a drifting load reaches them alike: name -> its median of each
    round."""
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(timeit(fn, warmup=1, repeat=repeat, clock=clock))
    return out


#: op classes of a CPU step's profile (:func:`op_shares`): torch's GEMMs (and oneDNN's linear), and attention's
#: fused kernels (SDPA's forward and backward, the flash form CPU training takes)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                      "mkldnn::_linear_pointwise"})


def op_class(name: str) -> str:
    """``gemm``, ``attention`` or ``other`` for a profiler event's name."""
    if name in GEMM_OPS:
        return "gemm"
    return "attention" if "scaled_dot_product" in name else "other"


def op_shares(step, steps: int = 3) -> dict[str, float]:
    """The share of ``steps`` calls' CPU time that the profiler puts in each :func:`op_class` (each op's own time,
    over all ops' own)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    own = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        own[op_class(e.key)] += e.self_cpu_time_total
    total = sum(own.values()) or 1.0
    return {k: v / total for k, v in own.items()}
