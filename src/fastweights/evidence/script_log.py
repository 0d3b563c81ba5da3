"""The benchmark scripts' progress line: the time of day, then the message, flushed at once, so that a long run's
log says when each of its steps ended."""

from __future__ import annotations

import time


def log(msg: str) -> None:
    """Print ``[HH:MM:SS] msg`` to stdout, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
