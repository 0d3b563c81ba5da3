"""The progress line: count, rate, fields, and an ETA bounded by a time budget."""

import io
import time

from fastweights.core.progress import Progress


def _line(bar: Progress, now_offset: float) -> str:
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.start + now_offset)
    return out.getvalue().strip()


def test_eta_from_rate():
    bar = Progress(100, "steps", desc="train", min_interval=0)
    bar.n = 10
    line = _line(bar, 10.0)  # 1 step/s, 90 to go
    assert line.startswith("train | 10/100 steps | 1.0 steps/s") and line.endswith("ETA 01:30")


def test_eta_never_exceeds_the_time_budget():
    bar = Progress(5000, "steps", desc="train", time_limit=300.0)
    bar.n = 40
    assert _line(bar, 10.0).endswith("ETA 04:50")  # the count would say 20:40; the budget ends it at 5:00
    assert _line(bar, 400.0).endswith("ETA 00:00")


def test_fields_and_final_line_have_no_eta():
    bar = Progress(None, "tok", min_interval=0)
    bar.update(5, loss=1.25)
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.start + 1.0, final=True)
    assert "loss 1.25" in out.getvalue() and "ETA" not in out.getvalue()


def test_cpu_clock_counts_cpu_seconds_for_the_budget():
    # train.budget_clock = "cpu": the budget is CPU seconds, so elapsed and ETA must be CPU seconds too
    fake = iter([100.0, 160.0])  # start, then 60 CPU seconds later
    bar = Progress(5000, "steps", desc="train", time_limit=120.0, clock=lambda: next(fake), min_interval=0)
    bar.n = 30
    out = io.StringIO()
    bar.stream, bar.tty = out, False
    bar._draw(bar.clock())
    line = out.getvalue().strip()
    assert "elapsed 01:00" in line and line.endswith("ETA 01:00")
    bar = Progress(10, clock=time.process_time)
    assert bar.clock_label == "cpu"
