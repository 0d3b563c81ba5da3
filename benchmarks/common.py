"""Helpers shared by the benchmark scripts: machine description and JSON output with the command."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload}
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
