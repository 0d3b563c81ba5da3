"""No test depends on how fast the machine is (issue 49: a subprocess timeout of 60 s failed a test under load
that takes 21 s alone): every timeout a test passes is ``helpers.HANG_GUARD_S`` (10 minutes) or longer."""

import re
from pathlib import Path

from helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def test_no_test_passes_a_timeout_shorter_than_the_hang_guard():
    assert HANG_GUARD_S >= 600
    short = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             for m in re.finditer(r"\btimeout\s*[:=]\s*(?:float\s*=\s*)?(\d+(?:\.\d+)?)\b", line)
             if float(m.group(1)) < HANG_GUARD_S]
    assert short == []
