"""``testing.device_check`` (the device contract ``benchmarks/gpu/cuda_check.py`` runs on a GPU) on the CPU in this
process: the CPU against itself passes every row, a failing part is recorded in its row (not raised), a spent time
budget skips, and the summary counts verdicts over both parts."""

import math

import torch

from fastweights.testing import device_check as dc


def test_the_cpu_against_itself_passes_every_first_variant(capsys):
    rows = dc.component_rows(tiny=True)
    assert len({r["component"] for r in rows}) == len(rows)  # tiny: one variant a component
    cpu = torch.device("cpu")
    dc.component_pass(rows, "fp32_cpu_vs_device", cpu, deadline=math.inf)
    assert all(r["fp32_cpu_vs_device"]["pass"] for r in rows), [r for r in rows if not r["fp32_cpu_vs_device"]["pass"]]
    assert all(r["fp32_cpu_vs_device"]["worst"]["rel"] == 0.0 for r in rows if "worst" in r["fp32_cpu_vs_device"])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(rows) and all(line.startswith("  PASS ") for line in printed)
    summary = dc.component_summary(rows)  # the bf16 part not run: every row undecided
    assert summary["tolerance"]["fp32_rel"] == dc.FP32_REL_TOL and summary["tolerance"]["bf16_loss_rel"] == dc.BF16_LOSS_TOL
    assert summary["checked"] == 0 and len(summary["skipped"]) == len(rows) and summary["variants"] == len(rows)


def test_a_failure_is_recorded_in_its_row_and_a_spent_budget_skips(monkeypatch):
    rows = dc.component_rows(tiny=True)[:3]

    def broken(kind, name, raw, device):
        raise ValueError("no such kernel\nsecond line")

    monkeypatch.setitem(dc.PARTS, "bf16_training", broken)
    dc.component_pass(rows[:2], "bf16_training", torch.device("cpu"), deadline=math.inf)
    dc.component_pass(rows[2:], "bf16_training", torch.device("cpu"), deadline=-1.0)
    assert rows[0]["bf16_training"]["pass"] is False and rows[0]["bf16_training"]["error"].startswith(
        "ValueError: no such kernel (at device_check.py:")  # the deepest frame of the package
    assert rows[2]["bf16_training"] == {"skipped": "time budget of the bf16_training pass spent", "pass": None}
    for row in rows:
        row["fp32_cpu_vs_device"] = {"pass": True}
    summary = dc.component_summary(rows)
    assert (summary["checked"], summary["passed"]) == (2, 0) and len(summary["failed"]) == 2
    assert summary["skipped"] == [f"{rows[2]['component']} {rows[2]['variant']}"]


def test_rel_diff_is_the_largest_difference_over_the_largest_reference():
    ref = torch.tensor([1.0, -4.0])
    assert dc.rel_diff(ref, ref) == (0.0, 0.0)
    assert dc.rel_diff(torch.tensor([1.5, -4.0]), ref) == (0.5, 0.125)
    assert dc.rel_diff(torch.ones(3), ref) == (math.inf, math.inf)  # another shape
    assert dc.rel_diff(torch.tensor([1, 2]), torch.tensor([1, 2])) == (0.0, 0.0)  # integers: exactly
    assert dc.rel_diff(torch.tensor([1, 3]), torch.tensor([1, 2])) == (math.inf, math.inf)
    assert dc.rel_diff(torch.tensor([float("nan"), 1.0]), ref) == (math.inf, math.inf)
