"""The README results table is generated from benchmarks/results/*.json and must be up to date."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_table_matches_json():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_result_records_its_command():
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        rec = json.loads(path.read_text())
        assert rec.get("command"), f"{path.name} does not say which command produced it"
