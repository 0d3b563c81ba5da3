"""Regenerate the README results table from benchmarks/results/*.json, so no number is typed by hand.

    python benchmarks/report.py            # rewrite the table between the README's results markers
    python benchmarks/report.py --check    # exit 1 if the README is out of date (used by the tests)

A result file contributes rows through its ``headline`` list:
``{"what": "...", "value": 1.23, "unit": "bits/char", "target": ">= 0.9"}`` (unit and target optional).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        return f"{int(v):,}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"


def table() -> str:
    rows = ["| result | value | target | source (command in the JSON) |", "|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        rec = json.loads(path.read_text())
        for h in rec.get("headline", []):
            value = _fmt(h["value"]) + (f" {h['unit']}" if h.get("unit") else "")
            rows.append(f"| {h['what']} | {value} | {h.get('target', '')} | `{path.relative_to(ROOT)}` |")
    return "\n".join(rows)


def render(readme: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    readme_path = ROOT / "README.md"
    old = readme_path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README results table is out of date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    readme_path.write_text(new)
    print(f"updated {readme_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
