"""tools/stamp_probes.py: a format change re-stamps the stored results without re-running them, and
only those its commit's own tools call current (issue 38 scope 4: the tool is kept, so it is tested)."""

import json
import subprocess
import sys

from helpers import HANG_GUARD_S, ROOT, TOOLS

sys.path.insert(0, str(TOOLS))

import probes  # noqa: E402


def _record(name: str, spec: dict, summary: dict) -> dict:
    return {"command": f"python benchmarks/speed/{name}.py", "git": {"commit": "0" * 40},
            "result_file": f"benchmarks/results/{name}.json", "probes": [{**spec, "summary": summary}], "value": 1.0}


def test_current_results_are_stamped_and_stale_ones_refused_untouched(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    spec = probes.probe("ops", op="delta_rule")
    summary = probes.run_probe(spec)
    moved = {**summary, "y": summary["y"].split(": ")[0] + ": " + " ".join(
        str(float(v) * 1.5) for v in summary["y"].split(": ")[1].split())}  # measured when the operator differed
    (tmp_path / "good.json").write_text(json.dumps(_record("good", spec, summary)))
    stale = json.dumps(_record("stale", spec, moved))
    (tmp_path / "stale.json").write_text(stale)
    out = subprocess.run([sys.executable, str(TOOLS / "stamp_probes.py"), "--verified-at", "HEAD",
                          "--commit-probe-dtype", "float64", "--capability", "default", "--results", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert "stamped 1 of 2 results" in out.stdout and "refused: stale: stale at" in out.stdout
    good = json.loads((tmp_path / "good.json").read_text())
    assert good["probes_stamped"]["verified_current_at"] == head and good["value"] == 1.0
    assert good["probes"] == [{**spec, "summary": summary}]  # the same code: the same summary
    assert (tmp_path / "stale.json").read_text() == stale  # refused: left as it was


def test_a_name_that_is_no_commit_is_one_line_and_status_2(tmp_path):
    out = subprocess.run([sys.executable, str(TOOLS / "stamp_probes.py"), "--verified-at", "nosuchrev",
                          "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == ["error: 'nosuchrev' is no commit of this repository"]


def test_a_probe_that_now_outputs_nan_disagrees_and_nan_is_no_tolerance():
    """Issue 52: a probe whose output became NaN was taken as agreeing (nan_to_num of the difference), and
    --tolerance nan was accepted."""
    import argparse

    import pytest
    import torch

    import stamp_probes

    old = {"logits": torch.tensor([1.0, 2.0, 3.0])}
    assert stamp_probes._disagreement(old, {"logits": torch.tensor([1.0, 2.0, 3.0])}, 1e-6) is None
    assert stamp_probes._disagreement(old, {"logits": torch.tensor([1.0, float("nan"), 3.0])}, 1e-6) is not None
    assert stamp_probes._disagreement(old, {"logits": torch.tensor([1.0, 2.0, float("inf")])}, 1e-6) is not None
    both = {"logits": torch.tensor([float("nan"), 2.0])}
    assert stamp_probes._disagreement(both, {"logits": torch.tensor([float("nan"), 2.0])}, 1e-6) is None
    for bad in ("nan", "inf", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            stamp_probes._tolerance(bad)
    assert stamp_probes._tolerance("1e-5") == 1e-5
