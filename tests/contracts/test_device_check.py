"""``testing.device_check`` (the device contract ``benchmarks/gpu/cuda_check.py`` runs on a GPU) on the CPU in this
process: the CPU against itself passes every row, a failing part is recorded in its row (not raised), a spent time
budget skips, and the summary counts verdicts over both parts."""

import math

import pytest
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


class _Contract:
    """device_contract's train, compute_dtype_state and state_leaves stood in for: the fp32 and bf16 runs'
    losses, the bf16 run's last state and layer are chosen by the test; every call is recorded."""

    def __init__(self, monkeypatch, fp32, bf16, state, params, allowed=()):
        from torch import nn

        self.calls, self.layer = [], nn.Module()
        for i, p in enumerate(params):
            self.layer.register_parameter(f"p{i}", nn.Parameter(p, requires_grad=False))
        self.runs = {False: fp32, True: bf16}
        monkeypatch.setattr(dc.contract, "train", self.train)
        monkeypatch.setattr(dc.contract, "compute_dtype_state",
                            lambda kind, name: self.calls.append(("allowed", kind, name)) or set(allowed))
        monkeypatch.setattr(dc.contract, "state_leaves", lambda st: list(st.items()))
        self.state = state

    def train(self, kind, name, raw, bf16, device):
        self.calls.append(("train", kind, name, raw, bf16, device))
        return self.runs[bf16], (self.state if bf16 else None), (self.layer if bf16 else None)


def test_bf16_training_passes_close_finite_losses_with_fp32_parameters_and_state_on_the_device(monkeypatch):
    cpu = torch.device("cpu")
    c = _Contract(monkeypatch, [2.0, 1.5, 1.0], [2.0, 1.54, 1.04], {"mem.S": torch.zeros(2), "idx": torch.zeros(2,
                  dtype=torch.long), "mem.half": torch.zeros(2, dtype=torch.bfloat16)}, [torch.ones(2)],
                  allowed={"mem.half"})
    got = dc.bf16_training("mixer", "delta", {"raw": 1}, cpu)
    assert got == {"losses_fp32": [2.0, 1.5, 1.0], "losses_bf16": [2.0, 1.54, 1.04],
                   "max_rel_loss_diff": pytest.approx(0.04), "problems": [], "pass": True}
    assert c.calls == [("train", "mixer", "delta", {"raw": 1}, False, cpu), ("train", "mixer", "delta", {"raw": 1}, True, cpu),
                       ("allowed", "mixer", "delta")]


def test_bf16_training_names_every_problem(monkeypatch):
    cpu = torch.device("cpu")
    state = {"mem.S": torch.zeros(2, dtype=torch.bfloat16), "ok": torch.zeros(2), "meta": torch.zeros(2, device="meta")}
    _Contract(monkeypatch, [2.0, 1.0, 0.0], [2.0, math.nan, 0.1], state,
              [torch.ones(2), torch.tensor([1.0, math.inf])])
    got = dc.bf16_training("mixer", "delta", {}, cpu)
    assert got["problems"] == ["non-finite bf16 loss [2.0, nan, 0.1]",
                               "a parameter is not finite fp32 after the bf16 steps",
                               "bf16 loss differs from fp32 by 1e+29 (relative)",  # a zero fp32 loss: / 1e-30
                               "state 'mem.S' is torch.bfloat16 under bf16 autocast",
                               "state 'meta' is on meta"]
    assert got["pass"] is False and got["max_rel_loss_diff"] == pytest.approx(1e29)
    # a bf16 parameter is a problem too; the whole state may keep the compute dtype when "" is allowed
    _Contract(monkeypatch, [1.0], [1.06], {"mem.S": torch.zeros(2, dtype=torch.bfloat16)},
              [torch.ones(2, dtype=torch.bfloat16)], allowed={""})
    got = dc.bf16_training("mixer", "delta", {}, cpu)
    assert got["problems"] == ["a parameter is not finite fp32 after the bf16 steps",
                               "bf16 loss differs from fp32 by 0.06 (relative)"]
    # exactly at the tolerance: passes
    assert 1.0 / 20.0 == dc.BF16_LOSS_TOL
    _Contract(monkeypatch, [20.0], [21.0], {}, [torch.ones(1)])
    assert dc.bf16_training("mixer", "delta", {}, cpu)["pass"] is True


def test_the_summary_counts_verdicts_over_both_parts_and_fla_calls_in_bf16_training():
    rows = [{"component": "mixer", "variant": v, "fp32_cpu_vs_device": {"pass": a}, "bf16_training": b}
            for v, a, b in (("delta", True, {"pass": True, "fla_calls": 3}), ("gated", True, {"pass": False}),
                            ("sum", False, {"pass": True, "fla_calls": 2}), ("dpfp", True, {"pass": None}))]
    rows.append({"component": "head", "variant": "fwl", "fp32_cpu_vs_device": {"pass": True}})  # bf16 not run
    s = dc.component_summary(rows)
    assert [r["pass"] for r in rows] == [True, False, False, None, None]
    assert {k: s[k] for k in ("variants", "checked", "passed", "failed", "skipped", "fla_calls_in_bf16_training")} == {
        "variants": 5, "checked": 3, "passed": 1, "failed": ["mixer gated", "mixer sum"],
        "skipped": ["mixer dpfp", "head fwl"], "fla_calls_in_bf16_training": 5}
    assert s["tolerance"] == {
        "fp32_rel": 1e-4, "bf16_loss_rel": 0.05,
        "rule": "fp32: every output, input gradient, carried state and parameter gradient within fp32_rel of the CPU's "
                "(max |device - cpu| / max |cpu| per tensor), TF32 off; bf16: 3 Adam steps under autocast, finite, "
                "each loss within bf16_loss_rel of fp32's, fp32 parameters, fast-weight state fp32 (activation "
                "caches excepted, as in tests/contracts/test_device_contract.py)"}
    from fastweights.testing import registry_cases as reg

    assert s["shape"] == {"B": reg.B, "T": reg.T, "d_model": reg.D, "vocab": reg.V, "calls": 2}
    assert s["rows"] is rows and list(s) == ["tolerance", "shape", "variants", "checked", "passed", "failed", "skipped",
                                             "fla_calls_in_bf16_training", "rows"]
