"""How many torch CPU threads a command uses unless told (``--threads``, ``train.threads``).

Measured by ``benchmarks/speed/threads.py`` (``benchmarks/results/threads.json``) on a 2-core machine, idle
and with a busy process on one core:

- Scoring and sampling (``eval``, ``generate``, ``dynamic eval``, the harness) run one thread: with models of
  the demo's size a second thread gained nothing on two idle cores and cost two to forty times the time
  when another process held a core. :data:`SCORING_THREADS`.
- A training step gains from a second idle core (about 1.6x) and loses when that core is taken, more the
  busier the machine (a step took 7x longer with two threads on a machine running other jobs).
  :func:`training_threads` therefore counts the cores idle when the run starts.
- Idle OpenMP threads sleep instead of spinning (:func:`prefer_passive_waiting`, ``OMP_WAIT_POLICY=PASSIVE``,
  which the command line sets before torch loads): with another process busy on one core, a demo-sized training
  step with two spinning threads ran at half the speed of one thread, with two sleeping ones at 0.94 of it; on
  two idle cores sleeping threads cost 6% (5.47 against 5.85 steps/s; a comparison run by hand on this project's
  2-core machine on 2026-11-28, not a stored result: benchmarks/results/threads.json measures the sleeping threads
  only). So two threads stay the right choice when a core gets busy after the run started.

:func:`use_threads` is the one place a command's thread count is decided and set: the count asked for, else
``OMP_NUM_THREADS`` (torchrun sets it for its processes; a user's shell may), else the default of the command's
kind of work (:data:`WORK`).
"""

from __future__ import annotations

import os
import sys
import time

SCORING_THREADS = 1
#: the benchmark scripts' ``--threads`` default: one thread, so a timing in this process's CPU seconds counts the work
#: done, unaffected by other jobs taking turns on a shared machine's cores (``fastweights.evidence.timing``)
BENCHMARK_THREADS = 1
MAX_THREADS_PER_CORE = 4  # more threads than this per usable core only thrash (and tens of thousands crash torch)
#: a command's kind of work -> what 0 (the default) threads means for it
WORK = {"scoring": "one thread (scoring and sampling)",
        "training": "the cores idle when it starts",
        "task": "one thread (the synthetic tasks' small models)",
        "benchmark": "one thread (a benchmark's timings, in this process's CPU seconds)"}
_SAMPLE_S = 0.25  # how long the CPU is watched to count busy cores: long enough to average a scheduler tick


def prefer_passive_waiting() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set it: idle OpenMP threads sleep rather than spin, so a core
    another process takes does not stall every step. OpenMP reads it when torch loads it: this does nothing once
    torch is imported (the ``fastweights`` command calls it first thing)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guests are inside user)
    return total - idle, total


def busy_cores(sample_s: float = _SAMPLE_S) -> float:
    """How many cores other work keeps busy now: the machine's busy fraction over ``sample_s`` seconds times
    its cores (Linux); elsewhere the 1-minute load average."""
    first = _cpu_times()
    if first is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(sample_s)
    second = _cpu_times()
    busy, total = second[0] - first[0], second[1] - first[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


def training_threads(sample_s: float = _SAMPLE_S) -> int:
    """The cores this process may use that nothing else keeps busy now, at least one."""
    return max(1, min(usable_cores(), round(usable_cores() - busy_cores(sample_s))))


def busy_machine_warning(threads: int, budget_cpu_s: float, sample_s: float = _SAMPLE_S) -> str | None:
    """What to tell a user whose CPU-second budget will take longer in wall time because other work keeps the cores
    this run's ``threads`` need busy (None on a machine with a core free per thread)."""
    busy, cores = busy_cores(sample_s), usable_cores()
    if cores - busy >= threads - 0.25:  # a quarter of a core of noise is not a busy machine
        return None
    return (f"warning: other work keeps {busy:.1f} of this machine's {cores} cores busy: the budget of "
            f"{budget_cpu_s / 60:,.1f} CPU-minutes on {threads} thread{'s' if threads > 1 else ''} will take longer "
            "in wall time (the progress line shows both ETAs)")


def _omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a count, or None when unset or not a positive integer (torch ignores it then)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def use_threads(work: str, requested: int | None = 0) -> int:
    """Set torch's CPU threads for ``work`` (a key of :data:`WORK`) and return the count: ``requested`` when
    positive (``--threads``, ``train.threads``), else ``OMP_NUM_THREADS`` when set, else the work's default
    (:data:`SCORING_THREADS` for scoring and tasks, :data:`BENCHMARK_THREADS` for a benchmark script,
    :func:`training_threads` for training). The only caller of
    ``torch.set_num_threads`` in the library."""
    import torch

    if work not in WORK:
        raise ValueError(f"unknown kind of work {work!r}; one of {', '.join(WORK)}")
    most = MAX_THREADS_PER_CORE * usable_cores()
    if requested and requested > most:  # 5,000 threads hung a 2-core machine, 100,000 crashed torch (issue 52)
        from fastweights.core.errors import UserError

        raise UserError(f"threads={requested}: at most {most} ({MAX_THREADS_PER_CORE} per core this process may use)")
    count = requested if requested and requested > 0 else _omp_threads()
    if count is None:
        count = (training_threads() if work == "training" else BENCHMARK_THREADS if work == "benchmark"
                 else SCORING_THREADS)
    torch.set_num_threads(count)
    return count
