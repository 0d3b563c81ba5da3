"""A dependency-free progress line for long work: count, rate, ETA and free-form fields, on stderr."""

from __future__ import annotations

import sys
import time


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    """``Progress(total, unit)``; call ``update(n, **fields)``; ``close()`` ends the line.

    Redraws at most every ``min_interval`` seconds; on a non-terminal (CI logs) it prints a plain
    line every ``log_interval`` seconds instead of carriage-return redraws. ``time_limit`` (seconds):
    the work stops by then whatever the count (a training time budget), so the ETA never exceeds it.
    ``clock``: what elapsed time, rate and ETA count, wall-clock seconds (default) or
    ``time.process_time`` (shown as ``cpu``), which must match the clock of ``time_limit``.
    """

    def __init__(self, total: float | None, unit: str = "it", desc: str = "", enabled: bool = True,
                 min_interval: float = 0.2, log_interval: float = 10.0, stream=None, time_limit: float | None = None,
                 clock=time.perf_counter):
        self.total, self.unit, self.desc, self.enabled = total, unit, desc, enabled
        self.time_limit = time_limit
        self.clock = clock
        self.clock_label = "cpu" if clock is time.process_time else "elapsed"
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = min_interval if self.tty else log_interval
        self.n = 0.0
        self.last = time.perf_counter()  # redraw timing is always wall-clock
        self.start = clock()
        self.fields: dict = {}

    def update(self, n: float = 1, **fields) -> None:
        self.n += n
        self.fields.update(fields)
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.interval:
            self.last = now
            self._draw(self.clock())

    def _draw(self, now: float, final: bool = False) -> None:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = [self.desc] if self.desc else []
        parts.append(f"{self.n:,.0f}/{self.total:,.0f} {self.unit}" if self.total else f"{self.n:,.0f} {self.unit}")
        parts.append(f"{rate:,.0f} {self.unit}/s")
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.fields.items()]
        parts.append(f"{self.clock_label} {_fmt_time(elapsed)}")
        if self.total and rate > 0 and not final:
            eta = (self.total - self.n) / rate
            if self.time_limit is not None:
                eta = max(0.0, min(eta, self.time_limit - elapsed))
            parts.append(f"ETA {_fmt_time(eta)}")
        line = " | ".join(parts)
        self.stream.write(("\r\x1b[2K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(self.clock(), final=True)
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
