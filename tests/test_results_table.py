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


def test_docs_block_lists_only_the_files_it_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    page = "intro\n<!-- results:start demo -->\nstale\n<!-- results:end -->\nmiddle\n<!-- results:start train_throughput demo -->\n<!-- results:end -->\nend\n"
    out = report.render(page, "page.md")
    first, second = out.split("middle")
    assert "benchmarks/results/demo.json" in first and "train_throughput.json" not in first and "stale" not in first
    assert second.index("train_throughput.json") < second.index("demo.json")  # in the order named
    assert out.startswith("intro\n") and out.endswith("end\n")
    assert report.render(out, "page.md") == out  # idempotent
