"""A dependency-free progress line for long work: count, total, rate, ETA and free-form fields, on stderr.

The rules every progress line follows (``tests/cli/test_progress.py`` holds them):

- it states its unit (``12,000/40,000 tok``) and, where the work has a known size, the total and an ETA;
  an estimated total is marked ``~``;
- a rate never reads 0: below one unit per second it is printed as seconds per unit (``4.2 s/sample``);
- a loss carries its unit: pass it as a string (``loss="1.234 bits/tok"``), or give the bar ``loss_unit``
  (``Progress(..., loss_unit="nats")``) and a float ``loss`` field is shown with it;
- on a terminal the line is redrawn in place; elsewhere (logs, CI) a plain line is printed a few seconds
  after the start and then every ``log_interval`` seconds, so long work is never silent for long.

One command often runs several phases (a static and a dynamic pass, the points of a grid). A phase that
knows the whole command's size makes one bar for all of it and changes ``desc`` as it goes; a bar made
inside :meth:`Progress.adopting` with the same unit adds its counts to the adopting bar instead of drawing
its own line (library loops that make their own bar then count toward the command's total and ETA).
"""

from __future__ import annotations

import sys
import time

_ADOPTERS: list["Progress"] = []  # bars adopting the counts of bars made inside their `adopting()` block


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def _singular(unit: str) -> str:
    """``samples`` -> ``sample``, ``batches`` -> ``batch``, ``tok`` -> ``tok``."""
    if unit.endswith(("ches", "shes", "sses")):
        return unit[:-2]
    return unit[:-1] if unit.endswith("s") and not unit.endswith("ss") and len(unit) > 1 else unit


def format_rate(rate: float, unit: str) -> str:
    """``2,500 tok/s``, ``3.5 samples/s``, ``4.2 s/sample``: never ``0 x/s``; ``""`` when nothing is known
    yet (no unit done)."""
    if not rate > 0:
        return ""
    if rate >= 10:
        return f"{rate:,.0f} {unit}/s"
    if rate >= 1:
        return f"{rate:.1f} {unit}/s"
    per = 1 / rate
    return f"{per:,.1f} s/{_singular(unit)}" if per < 100 else f"{per:,.0f} s/{_singular(unit)}"


def _fmt_count(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() or abs(x) >= 100 else f"{x:,.1f}"


class Progress:
    """``Progress(total, unit)``; call ``update(n, **fields)``; ``close()`` ends the line.

    Redraws at most every ``min_interval`` seconds on a terminal; elsewhere (CI logs) it prints a plain
    line at the first update ``first_interval`` seconds after the start, then every ``log_interval``
    seconds. ``loss_unit``: the unit a float ``loss`` field is shown with ("nats", "bits/tok").
    ``total`` may change while the work runs (``bar.total = ...``); ``approximate=True`` marks
    it as an estimate (``~``). ``time_limit`` (seconds): the work stops by then whatever the count (a
    training time budget), so the ETA never exceeds it; ``bar.until_time_limit = True`` says that limit
    is the one that binds (the total is then what it allows), and the ETA is the time left to it.
    ``clock``: what elapsed time, rate and ETA count, wall-clock seconds (default, ``time.perf_counter``)
    or ``time.process_time`` (shown as ``cpu``), which must match the clock of ``time_limit``. ``initial``: the
    count done before this process (a resumed run's steps): shown in the count, left out of the rate and ETA,
    which measure only this process's work. With the CPU clock the ETA is in CPU seconds, and the wall-clock
    time it will take at this process's share of a core so far is shown beside it (``ETA 05:00 (wall ~12:30)``):
    on a busy machine a CPU-minute budget takes many wall minutes.
    """

    def __init__(self, total: float | None, unit: str = "it", desc: str = "", enabled: bool = True,
                 min_interval: float = 0.2, log_interval: float = 8.0, stream=None, time_limit: float | None = None,
                 clock=None, first_interval: float = 2.0, approximate: bool = False, loss_unit: str = "",
                 initial: float = 0.0):
        self.total, self.unit, self.desc, self.enabled = total, unit, desc, enabled
        self.loss_unit = loss_unit
        self.approximate = approximate
        self.time_limit = time_limit
        self.until_time_limit = False  # True: the time limit binds (the total is its estimate), the ETA is its own
        self.clock = clock or time.perf_counter
        self.clock_label = "cpu" if self.clock is time.process_time else "elapsed"
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = min_interval if self.tty else log_interval
        self.n = self.initial = float(initial)
        self.start = self.clock()
        self.wall_clock = time.perf_counter  # beside a CPU clock: how its seconds turn into wall seconds
        self.wall_start = self.wall_clock()
        # redraw timing is always wall-clock; a log prints its first line first_interval seconds in
        self.last = time.perf_counter() - (0.0 if self.tty else max(0.0, self.interval - first_interval))
        self.fields: dict = {}
        # a bar made inside another bar's adopting() block, with the same unit, counts toward that bar
        self.parent = next((p for p in reversed(_ADOPTERS) if p.unit == unit), None)

    def adopting(self):
        """Context manager: bars with this bar's unit made inside the block add their counts (and fields)
        to this bar and draw nothing of their own."""
        bar = self

        class _Adopt:
            def __enter__(self):
                _ADOPTERS.append(bar)
                return bar

            def __exit__(self, *exc):
                _ADOPTERS.remove(bar)
                return False

        return _Adopt()

    def update(self, n: float = 1, **fields) -> None:
        if self.parent is not None:
            self.parent.update(n, **fields)
            return
        self.n += n
        self.fields.update(fields)
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.interval:
            self.last = now
            self._draw(self.clock())

    def show(self) -> None:
        """Draw the line now, whatever the interval (a long first step is not silent: its total shows at once)."""
        if self.parent is None and self.enabled:
            self.last = time.perf_counter()
            self._draw(self.clock())

    def line(self, now: float, final: bool = False) -> str:
        """The progress line at clock time ``now`` (``final``: the closing line, without an ETA)."""
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0  # this process's work only
        parts = [self.desc] if self.desc else []
        if self.total:
            parts.append(f"{_fmt_count(self.n)}/{'~' if self.approximate else ''}{_fmt_count(self.total)} {self.unit}")
        else:
            parts.append(f"{_fmt_count(self.n)} {self.unit}")
        shown = format_rate(rate, self.unit)
        if shown:
            parts.append(shown)
        for k, v in self.fields.items():
            if k == "loss" and isinstance(v, float) and self.loss_unit:
                parts.append(f"loss {v:.4g} {self.loss_unit}")
            else:
                parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
        parts.append(f"{self.clock_label} {_fmt_time(elapsed)}")
        if self.total and rate > 0 and not final:
            eta = max(0.0, self.total - self.n) / rate
            if self.time_limit is not None:
                limit = max(0.0, self.time_limit - elapsed)
                eta = limit if self.until_time_limit else min(eta, limit)
            wall = ""
            if self.clock is time.process_time and elapsed > 0:  # CPU seconds: the wall time they will take here
                per_cpu_s = max(1.0, (self.wall_clock() - self.wall_start) / elapsed)
                wall = f" (wall ~{_fmt_time(eta * per_cpu_s)})"
            parts.append(f"ETA {_fmt_time(eta)}{wall}")
        return " | ".join(parts)

    def _draw(self, now: float, final: bool = False) -> None:
        line = self.line(now, final)
        self.stream.write(("\r\x1b[2K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.parent is not None:
            return
        if self.enabled:
            self._draw(self.clock(), final=True)
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
