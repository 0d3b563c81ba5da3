"""Helpers shared by the benchmark scripts: machine description and JSON output with the command
(relative to the repository root, so a reader can run it from a clone)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository root when it lies inside it (else unchanged), so recorded
    paths mean the same in every clone."""
    p = Path(path)
    if p.is_absolute() and p.resolve().is_relative_to(REPO):
        return p.resolve().relative_to(REPO).as_posix()
    return str(path)


def command_line(argv: list[str] | None = None, program: str | None = None) -> str:
    """The command that ran this script, for the JSON it writes: ``program`` (default: the Python
    executable's name) then ``argv`` (default ``sys.argv``), with every absolute path inside the
    repository, and ``--flag=PATH``, made relative to the repository root (the script itself too,
    wherever it was started from)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).is_file():
        argv[0] = repo_relative(Path(argv[0]).resolve())
    words = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
        words.append(f"{flag}{eq}{repo_relative(value)}" if value.startswith("/") else a)
    return " ".join(shlex.quote(w) for w in [program or Path(sys.executable).name, *words])


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def git_state() -> dict:
    """The commit the code was measured at and whether the tree differed from it (``dirty``, with the
    changed tracked paths, at most 20): ``report.py --check`` compares the commit with the last commit
    touching the code a benchmark measures. ``{"commit": None}`` outside a git checkout."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed), "dirty_paths": changed[:20]}


def provenance(argv: list[str] | None = None) -> dict:
    """What every result JSON records: the command, the date, the commit (and dirty flag) and the
    machine with its load. Scripts that write their JSON themselves merge this in."""
    return {"command": command_line(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git_state(),
            "machine": machine()}


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {**provenance(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path


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
