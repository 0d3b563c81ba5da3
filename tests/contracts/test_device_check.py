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
    compared = [(r, line) for r, line in zip(rows, printed) if "worst" in r["fp32_cpu_vs_device"]]
    assert compared and all(f": max rel diff 0.00e+00 ({r['fp32_cpu_vs_device']['worst']['tensor']})" in line
                            for r, line in compared)  # the worst tensor named on its row's line
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


def _two_calls_standin(monkeypatch, ref, got):
    """compare_devices' two runs stood in for: the CPU's tensors ``ref``, the device's ``got``."""
    from torch import nn

    built = []
    monkeypatch.setattr(dc.contract, "build", lambda kind, name, raw: built.append((kind, name, raw)) or nn.Linear(2, 2))
    runs = iter([ref, got])
    devices = []

    def two_calls(layer, kind, x, tokens, weights, device):
        devices.append((device.type, layer, kind, x, tokens, weights((2, 3))))
        return next(runs)

    monkeypatch.setattr(dc, "two_calls", two_calls)
    return devices, built


def test_compare_devices_takes_the_worst_difference_of_each_kind_and_names_what_is_missing(monkeypatch):
    t = torch.tensor
    ref = {"output_1": t([1.0, 2.0]), "output_2": t([4.0, -4.0]), "input_grad_1": t([2.0, 2.0]),
           "input_grad_2": t([1.0, 1.0]), "state[S]": t([10.0, 10.0]), "param_grad[w]": t([1.0, 1.0]),
           "param_grad[v]": t([2.0])}
    got = {"output_1": t([1.0, 2.5]), "output_2": t([4.0, -4.0]), "input_grad_1": t([2.0, 1.0]),
           "input_grad_2": t([1.0, 1.0]), "state[S]": t([10.0, 11.0]), "param_grad[w]": t([1.0, 1.25]),
           "state": t([0.0])}
    calls, built = _two_calls_standin(monkeypatch, ref, got)
    out = dc.compare_devices("mixer", "delta", {"raw": 1}, torch.device("cpu"))
    assert built == [("mixer", "delta", {"raw": 1})] and [c[0] for c in calls] == ["cpu", "cpu"]
    (_, cpu_layer, kind, x, tokens, w), (_, dev_layer, kind2, x2, tokens2, w2) = calls
    assert kind == kind2 == "mixer" and dev_layer is not cpu_layer and dev_layer.weight is not cpu_layer.weight
    assert torch.equal(dev_layer.weight, cpu_layer.weight)  # a deep copy of the CPU's layer
    g = torch.Generator().manual_seed(2)  # seeded inputs, the same on both devices
    want_x = [torch.randn(dc.reg.B, dc.reg.T, dc.reg.D, generator=g) for _ in range(2)]
    want_tokens = [torch.randint(0, dc.reg.V, (dc.reg.B, dc.reg.T), generator=g) for _ in range(2)]
    gw = torch.Generator().manual_seed(3)
    want_w = (torch.randn((2, 3), generator=gw), torch.randn((2, 3), generator=gw))
    for xs, ts, ws in ((x, tokens, w), (x2, tokens2, w2)):
        assert all(torch.equal(a, b) for a, b in zip(xs + ts + list(ws), want_x + want_tokens + list(want_w)))
    assert out == {"max_abs_diff_outputs": 0.5, "max_rel_diff_outputs": 0.25, "max_abs_diff_input_grads": 1.0,
                   "max_rel_diff_input_grads": 0.5, "max_rel_diff_state": 0.1, "max_rel_diff_param_grads": 0.25,
                   "worst": {"tensor": "input_grad_1", "abs": 1.0, "rel": 0.5}, "tensors_compared": 6,
                   "problems": ["param_grad[v] only on cpu", "state only on cpu"], "pass": False}


def test_compare_devices_passes_within_the_tolerance_and_names_a_tensor_on_the_wrong_device(monkeypatch):
    t = torch.tensor
    ref = {"output_1": t([1.0, -2.0]), "input_grad_1": t([1.0])}
    _two_calls_standin(monkeypatch, ref, {"output_1": t([1.0, -2.0]), "input_grad_1": t([1.0])})
    same = dc.compare_devices("mixer", "delta", {}, torch.device("cpu"))
    assert same["pass"] is True and same["problems"] == [] and same["worst"] == {"tensor": "input_grad_1", "abs": 0.0,
                                                                                "rel": 0.0}
    assert (same["max_rel_diff_state"], same["max_rel_diff_param_grads"]) == (0.0, 0.0)  # none compared: 0
    _two_calls_standin(monkeypatch, ref, {"output_1": t([1.0, -2.0 - 1e-4]), "input_grad_1": t([1.0])})
    near = dc.compare_devices("mixer", "delta", {}, torch.device("cpu"))
    assert near["pass"] is True and near["worst"]["tensor"] == "output_1"  # 0.5e-4 relative: within 1e-4
    _two_calls_standin(monkeypatch, ref, {"output_1": t([1.0, -2.0 - 3e-4]), "input_grad_1": t([1.0])})
    assert dc.compare_devices("mixer", "delta", {}, torch.device("cpu"))["pass"] is False  # 1.5e-4: beyond
    assert 1.0 / 10000.0 == dc.FP32_REL_TOL
    _two_calls_standin(monkeypatch, {"output_1": t([10000.0])}, {"output_1": t([10001.0])})
    assert dc.compare_devices("mixer", "delta", {}, torch.device("cpu"))["pass"] is True  # exactly at it
    _two_calls_standin(monkeypatch, ref, dict(ref))
    elsewhere = dc.compare_devices("mixer", "delta", {}, torch.device("meta"))  # the device's tensors came back on the cpu
    assert elsewhere["problems"] == ["input_grad_1 is on cpu, not meta", "output_1 is on cpu, not meta"]
    assert elsewhere["pass"] is False
    _two_calls_standin(monkeypatch, {"output_1": t([1.0]), "a": t([1.0])}, {"output_1": t([1.0]), "b": t([1.0])})
    missing = dc.compare_devices("mixer", "delta", {}, torch.device("meta"))
    assert missing["problems"] == ["a only on cpu", "b only on meta", "output_1 is on cpu, not meta"]
    _two_calls_standin(monkeypatch, {}, {})
    empty = dc.compare_devices("mixer", "delta", {}, torch.device("cpu"))
    assert empty["worst"] == {"tensor": None, "abs": 0.0, "rel": 0.0} and empty["tensors_compared"] == 0
    assert [empty[k] for k in ("max_abs_diff_outputs", "max_rel_diff_outputs", "max_abs_diff_input_grads",
                               "max_rel_diff_input_grads")] == [0.0] * 4


def test_err_text_names_a_frame_only_inside_our_package_or_flas(tmp_path):
    """A path that merely contains "fastweights" or "fla" (a clone in ~/fastweights, a user's flask app, a mutation
    tool's copy of the tests) is not our code: the line names the last frame inside the package itself."""
    import importlib.util

    src = tmp_path / "fastweights-clone" / "flask_app.py"
    src.parent.mkdir()
    src.write_text("def boom():\n    raise ValueError('outside')\n")
    spec = importlib.util.spec_from_file_location("flask_app_for_err_text", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.boom()
    except ValueError as e:
        assert dc.err_text(e) == "ValueError: outside"
    try:
        dc.rel_diff(torch.ones(2), None)  # raised inside the package, called from here
    except AttributeError as e:
        assert "(at device_check.py:" in dc.err_text(e)


def test_err_text_names_a_frame_inside_flas_package_imported_or_not(tmp_path, monkeypatch):
    import importlib.util
    import sys

    pkg = tmp_path / "site" / "fla"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernel.py").write_text("def boom():\n    raise RuntimeError('in fla')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    spec = importlib.util.spec_from_file_location("fla_kernel_for_err_text", pkg / "kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for imported in (False, True):  # fla found on the path without importing it, then imported
        if imported:
            import fla  # noqa: F401
        try:
            mod.boom()
        except RuntimeError as e:
            assert dc.err_text(e) == "RuntimeError: in fla (at kernel.py:2)", imported


def test_a_parts_problems_are_printed_joined_and_fla_calls_counted(monkeypatch, capsys):
    """A part that returns problems (not an error): its row's line lists them joined by '; '. The fla counter counts
    every call and every refusal, and starts again after each row (seed-14 mutation draw: a count set to 1)."""
    rows = dc.component_rows(tiny=True)[:1]
    monkeypatch.setitem(dc.PARTS, "bf16_training", lambda *a: {"pass": False, "problems": ["loss NaN", "no grad"]})
    dc.component_pass(rows, "bf16_training", torch.device("cpu"), deadline=math.inf)
    assert capsys.readouterr().out.rstrip().endswith(": loss NaN; no grad")
    outcomes = iter([None, None, ValueError("refused"), None])

    def inner(*a, **k):
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome
        return "out"

    monkeypatch.setattr(dc.dr, "_delta_rule_fla", inner)  # the module fla's calls go through
    counter = dc.FlaCounter()
    assert counter() == "out" and counter() == "out"
    with pytest.raises(ValueError):
        counter()
    assert counter.take() == {"fla_calls": 2, "fla_refused": 1}
    counter()
    assert counter.take() == {"fla_calls": 1, "fla_refused": 0}


def test_the_package_roots_without_fla_or_with_a_stand_in(monkeypatch):
    """Where fla is neither installed nor imported, and where a stand-in module (no __path__, no spec: the CPU
    tests' fla) is in sys.modules, the roots are our package's folder alone, without an error."""
    import importlib.util
    import sys
    import types
    from pathlib import Path

    ours = [Path(dc.__file__).resolve().parents[1]]
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # not installed
    assert dc._package_roots() == ours
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    assert dc._package_roots() == ours


def test_two_calls_differentiates_the_fixed_weighted_sum_of_both_outputs():
    """The backward is of sum(y1 * w1) + sum(y2 * w2): the second input's gradient is linear in w2 (seed 18:
    `y2 / w2` survived, as both devices ran the same wrong sum)."""
    (kind, name), variants = next(iter(dc.reg.VARIANTS.items()))
    raw = next(iter(variants.values()))  # the first variant's options
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(dc.reg.B, dc.reg.T, dc.reg.D, generator=g) for _ in range(2)]
    tokens = [torch.randint(0, dc.reg.V, (dc.reg.B, dc.reg.T), generator=g) for _ in range(2)]
    cpu = torch.device("cpu")

    def grads(scale):
        layer = dc.contract.build(kind, name, raw)
        w = lambda shape: (torch.ones(shape), scale * torch.ones(shape))  # noqa: E731
        return dc.two_calls(layer, kind, x, tokens, w, cpu)["input_grad_2"]

    one, three = grads(1.0), grads(3.0)
    assert one.abs().max() > 0
    torch.testing.assert_close(three, 3 * one, rtol=1e-5, atol=1e-6)


class _WithAuxLoss(torch.nn.Module):
    """A stand-in part with an outer training loss (``components.AuxLoss``): y = x * w, aux_loss = 5 |w|^2. No
    registered part has one yet; a user's registered part may."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(dc.reg.D))
        self.aux_loss = None

    def forward(self, x, state=None):
        self.aux_loss = 5 * self.w.square().sum()
        return x * self.w, None


def test_the_device_checks_add_a_parts_auxiliary_loss():
    """two_calls differentiates the part's aux_loss with the weighted sum, and the training check adds it to each
    step's loss (seed 18: `getattr(layer, "AUX_LOSS", None)` survived, as no registered part sets one)."""
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(dc.reg.B, dc.reg.T, dc.reg.D, generator=g) for _ in range(2)]
    tokens = [torch.zeros(dc.reg.B, dc.reg.T, dtype=torch.long) for _ in range(2)]
    out = dc.two_calls(_WithAuxLoss(), "mixer", x, tokens, lambda shape: (torch.ones(shape), torch.ones(shape)),
                       torch.device("cpu"))
    want = (x[0] + x[1]).sum((0, 1)) + 10  # d/dw of sum(x1 w) + sum(x2 w) + 5 |w|^2 at w = 1
    torch.testing.assert_close(out["param_grad[w]"], want)


def test_the_training_check_adds_a_parts_auxiliary_loss(monkeypatch):
    monkeypatch.setattr(dc.contract, "build", lambda kind, name, raw: _WithAuxLoss())
    losses, _, _ = dc.contract.train("mixer", "stand-in", {}, bf16=False)
    assert losses[0] == 5 * dc.reg.D  # y = x at w = 1: the reconstruction loss is 0, the aux loss 5 |w|^2
