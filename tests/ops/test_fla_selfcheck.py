"""The gradient self-check of fla's gated backward (issue 51, scope 1), on a CPU with the stand-in fla.

``fastweights.testing.fla_standin`` imitates fla 0.6 on a Hopper GPU with Triton 3.6.0 (``refuse_gated_backward``): its
gated kernel's backward raises unless ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1`` is True when the backward runs,
and ``WRONG_GATED`` halves its gated gradients of k and g (what fla issue 640 reports). Here: right gradients take
fla with its guard lifted for the backward, wrong ones keep the compiled form; the verdict is cached per key (a new
Triton or fla version checks again, the same key does not); an error in the check keeps the compiled form;
``FASTWEIGHTS_FLA_GATED_BACKWARD`` forces either path; a corrupt cache file is ignored and rewritten. Each test names
the one-line bug it catches (``tests/mutants/issue51_bar.json``).
"""

import importlib
import json
import logging
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fastweights.testing import fla_standin

from fastweights.core.errors import UserError
from fastweights.ops.delta_rule import delta_rule

dr = importlib.import_module("fastweights.ops.delta_rule")
sc = importlib.import_module("fastweights.ops.fla_selfcheck")
BF16 = torch.bfloat16
T = 19  # the training call's length (the check's is sc.CHECK_SHAPE["T"])
# the sums of the check's problem (q, k, v, beta, g, h0, do, dht) for K=8, V=4: see the test that reads them
PINNED_PROBLEM_SUMS = [320.19, -72.04, -39.72, 505.3, -51.99, -2.73, 32.66, 8.98]


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    """The stand-in fla refusing its gated backward as on a Hopper GPU with Triton 3.6.0; verdicts in tmp_path."""
    calls = fla_standin.install(monkeypatch)
    fla_standin.refuse_gated_backward(monkeypatch, triton="3.6.0")
    monkeypatch.setattr(dr, "_fla_refuses", lambda device: True)
    monkeypatch.setattr(dr, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(dr, "_COMPILED", {})
    monkeypatch.setattr(fla_standin, "WRONG_GATED", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(sc.MODE_ENV, raising=False)
    yield calls
    monkeypatch.undo()
    fla_standin.uninstall()


@pytest.fixture
def checks(monkeypatch):
    """The self-check's runs (each a call of run_gated_backward_check)."""
    runs = []
    real = sc.run_gated_backward_check

    def spy(*args):
        runs.append(args)
        return real(*args)

    monkeypatch.setattr(sc, "run_gated_backward_check", spy)
    return runs


def guard_lifted() -> bool:
    return sys.modules[fla_standin.GUARD_MODULE].TRITON_ABOVE_3_7_1


def train_gated(calls) -> str:
    """One gated training step of the delta rule on ``auto`` (bf16, as the gdn layer under autocast feeds it);
    returns the path it took: "fla" (the stand-in ran this call) or "compiled"."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, 2, 8, generator=g) for _ in range(3))
    beta, log_decay = torch.rand(2, T, 2, generator=g), -torch.rand(2, T, 2, generator=g) * 0.3
    leaves = [x.to(BF16).requires_grad_() for x in (q, F.normalize(k, dim=-1), v, beta)]
    log_decay.requires_grad_()
    before = len([c for c in calls if c["q"].shape[1] == T])
    o, _ = delta_rule(*leaves, log_decay=log_decay, qk_l2norm=True)
    o.float().square().sum().backward()  # the stand-in's guard raises here unless it is lifted now
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (*leaves, log_decay))
    return "fla" if len([c for c in calls if c["q"].shape[1] == T]) > before else "compiled"


def lines(caplog):
    """The self-check's log lines (one per decision)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "fastweights.ops.delta_rule" and "fla's gated backward, which fla refuses" in r.getMessage()]


def cached(tmp_path) -> dict:
    return json.loads((tmp_path / "cache" / "fastweights" / sc.CACHE_FILE).read_text())


def new_process():
    """What a new process starts from: no decision made, fla's guard as fla sets it (the cache file stays)."""
    sc._DECISIONS.clear()
    sys.modules[fla_standin.GUARD_MODULE].TRITON_ABOVE_3_7_1 = False


# catches: the guard lifted only around the check (the backward of the training call then refused), and the
# dispatch not consulting the check (refuses = True)
def test_right_gradients_take_fla_with_its_guard_lifted_while_the_backward_runs(hopper, checks, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert train_gated(hopper) == "fla"
        assert train_gated(hopper) == "fla"
    assert len(checks) == 1 and guard_lifted()
    (line,) = lines(caplog)
    assert "by version, TAKEN for K=8 V=8 bfloat16" in line and "passed" in line and "largest relative error" in line
    assert "TRITON_ABOVE_3_7_1 set True for the whole process" in line and "K=8 V=8 bfloat16" in line
    (verdict,) = cached(tmp_path).values()
    assert verdict["passed"] and verdict["rel_err"]["dk"] <= sc.BF16_GRAD_TOL


# catches: the check's result ignored (fla taken though its gradients are wrong)
def test_wrong_gradients_keep_the_compiled_form(hopper, checks, caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(fla_standin, "WRONG_GATED", True)
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert train_gated(hopper) == "compiled"
    assert len(checks) == 1 and not guard_lifted()
    (line,) = lines(caplog)
    assert "not taken (the compiled form)" in line and "failed" in line
    (verdict,) = cached(tmp_path).values()
    assert not verdict["passed"] and {"dk", "dg"} <= set(verdict["wrong"])
    new_process()  # a failed verdict is cached too: the next process keeps the compiled form without checking
    assert train_gated(hopper) == "compiled" and len(checks) == 1


# catches: the check's tolerance comparison dropped (wrong = [])
def test_the_check_compares_every_gradient_with_the_queues_tolerances(hopper, monkeypatch):
    right = sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
    assert right["passed"] and set(right["rel_err"]) == {"o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dh0"}
    assert right["tolerance"]["dk"] == sc.BF16_GRAD_TOL and right["tolerance"]["o"] == sc.BF16_OUT_TOL
    monkeypatch.setattr(fla_standin, "WRONG_GATED", True)
    wrong = sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
    assert not wrong["passed"] and wrong["wrong"] == ["dg", "dk"] and wrong["worst"] in ("dg", "dk")
    assert not guard_lifted()  # the check leaves fla's guard as it found it, passing or not


# catches: an exception in the check propagating (except ValueError), or choosing fla (return True)
@pytest.mark.parametrize("error", ["the check raises", "fla without the guard flag"])
def test_an_error_in_the_check_keeps_the_compiled_form(hopper, caplog, monkeypatch, tmp_path, error):
    if error == "the check raises":
        def broken(*args):
            raise RuntimeError("out of memory in the check")
        monkeypatch.setattr(sc, "run_gated_backward_check", broken)
    else:
        monkeypatch.delattr(sys.modules[fla_standin.GUARD_MODULE], "TRITON_ABOVE_3_7_1")
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert train_gated(hopper) == "compiled"
    (line,) = lines(caplog)
    assert "not taken" in line and "the check could not run (RuntimeError" in line
    assert not (tmp_path / "cache" / "fastweights" / sc.CACHE_FILE).exists()  # an error is no verdict


# catches: the cache key without Triton's version, and the cached verdict ignored (the check run every process)
def test_a_new_triton_or_fla_version_checks_again_the_same_key_does_not(hopper, checks, monkeypatch, tmp_path,
                                                                         caplog):
    assert train_gated(hopper) == "fla" and len(checks) == 1
    new_process()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert train_gated(hopper) == "fla" and len(checks) == 1  # the same key: the cached verdict
    (line,) = lines(caplog)
    assert "TAKEN" in line and "the verdict cached in" in line and "passed" in line
    new_process()
    fla_standin.refuse_gated_backward(monkeypatch, triton="3.6.1")
    assert train_gated(hopper) == "fla" and len(checks) == 2
    new_process()
    monkeypatch.setattr(sys.modules["fla"], "__version__", "0.6.1")
    assert train_gated(hopper) == "fla" and len(checks) == 3
    keys = sorted(cached(tmp_path))
    assert len(keys) == 3 and any("triton=3.6.1|fla=0.6.0+standin" in key for key in keys)
    assert all(f"torch={torch.__version__}" in key and "|K=8|V=8|dtype=bfloat16" in key for key in keys)


# catches: FASTWEIGHTS_FLA_GATED_BACKWARD ignored (mode = "check")
def test_the_variable_forces_either_path_without_checking(hopper, checks, caplog, monkeypatch):
    monkeypatch.setenv(sc.MODE_ENV, "safe")
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert train_gated(hopper) == "compiled"  # right gradients, but forced safe
        monkeypatch.setattr(fla_standin, "WRONG_GATED", True)
        monkeypatch.setenv(sc.MODE_ENV, "fla")
        assert train_gated(hopper) == "fla"  # wrong gradients, but forced fla
    assert checks == [] and guard_lifted()
    safe, forced = lines(caplog)
    assert "not taken" in safe and f"{sc.MODE_ENV}=safe" in safe
    assert "TAKEN" in forced and f"{sc.MODE_ENV}=fla, unchecked" in forced
    monkeypatch.setenv(sc.MODE_ENV, "yes")
    with pytest.raises(UserError, match="must be one of check, fla, safe"):
        train_gated(hopper)


# catches: a corrupt cache file's error propagating from the load (except OSError only)
@pytest.mark.parametrize("content", ["{not json", json.dumps({"x": 1}) + "trailing", "[1, 2]", "corrupt entry",
                                     "entry without its worst error"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(hopper, checks, tmp_path, content):
    path = tmp_path / "cache" / "fastweights" / sc.CACHE_FILE
    path.parent.mkdir(parents=True)
    key = sc.check_key(torch.device("cpu"), 8, 8, BF16)
    if content == "corrupt entry":
        content = json.dumps({key: {"passed": "yes"}})
    elif content == "entry without its worst error":
        content = json.dumps({key: {"passed": False, "rel_err": {"dk": 0.5}, "worst": "dg"}})
    path.write_text(content)
    assert train_gated(hopper) == "fla" and len(checks) == 1
    (verdict,) = json.loads(path.read_text()).values()
    assert verdict["passed"] is True


def test_a_verdict_without_tolerances_is_described_against_the_default_one():
    """A cached verdict of an older check names no per-gradient tolerance: its line compares with the default."""
    assert sc._describe({"worst": "dk", "rel_err": {"dk": 0.5}}) == \
        f"largest relative error 0.5 in dk against {sc.BF16_GRAD_TOL:g}"
    assert sc._describe({"worst": "dg", "rel_err": {"dg": 0.25}, "tolerance": {"dg": 0.125}}) == \
        "largest relative error 0.25 in dg against 0.125"


@pytest.mark.parametrize("triton, refused", [("3.3.9", False), ("3.4.0", True), ("3.6.0", True), ("3.7.1", False),
                                             ("4.0.0", False)])
def test_the_stand_in_refuses_as_fla_does_for_each_triton(monkeypatch, triton, refused):
    """fla 0.6 refuses its gated backward on Hopper for Triton in [3.4.0, 3.7.1): the stand-in's flags, for each
    version the self-check may read (seed-3 mutation draw: the upper bound was never tried)."""
    import sys

    fla_standin.install(monkeypatch)
    try:
        fla_standin.refuse_gated_backward(monkeypatch, triton=triton)
        flags = sys.modules[fla_standin.GUARD_MODULE]
        assert (flags.IS_NVIDIA_HOPPER and flags.TRITON_ABOVE_3_4_0 and not flags.TRITON_ABOVE_3_7_1) is refused
    finally:
        fla_standin.uninstall()


def test_the_checks_inputs_are_the_same_at_every_run():
    """The self-check's inputs come from its own seeded generator, so a verdict (and the error it records) can be
    reproduced (seed-3 mutation draw: an input drawn from the global generator passed)."""
    torch.manual_seed(0)
    first = sc._check_inputs(torch.device("cpu"), 16, 16, torch.float32)
    torch.manual_seed(1)
    again = sc._check_inputs(torch.device("cpu"), 16, 16, torch.float32)
    for a, b in zip([*first[0], *first[1]], [*again[0], *again[1]]):
        assert torch.equal(a, b)


def test_the_recorded_gpu_is_the_device_checked_not_the_current_one(monkeypatch):
    """The self-check's verdict names the GPU it ran on: on a machine of several, cuda:1's name and compute
    capability, not those of the current device (a stand-in torch.cuda: no GPU here)."""
    import torch

    from fastweights.ops import fla_selfcheck

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: asked.append(d) or "H200")
    assert fla_selfcheck._device_name(torch.device("cuda", 1)) == "H200 sm_90"
    assert asked == [torch.device("cuda", 1)] * 2
    assert fla_selfcheck._device_name(torch.device("cpu")) == "cpu"


def test_the_checks_problem_draws_the_delta_rules_beta_inside_zero_one():
    """The self-check's random problem is one a layer would hand fla: beta (the write strength, a sigmoid's output in
    every layer) strictly inside (0, 1), the gate's log decay g in (-0.1, 0], drawn the same on every call."""
    from fastweights.ops.fla_selfcheck import _check_inputs

    (q, k, v, beta), (g, h0, do, dht) = _check_inputs(torch.device("cpu"), 8, 4, torch.float32)
    assert 0.05 <= beta.min() and beta.max() <= 0.95 and beta.std() > 0.2
    assert -0.1 <= g.min() and g.max() <= 0
    again = _check_inputs(torch.device("cpu"), 8, 4, torch.float32)
    assert torch.equal(again[0][3], beta) and torch.equal(again[1][0], g)


# ------------------------------------------------------------------ the check's parts, one by one (issue 49: every
# mutant of this module run against this file; the survivors named below were killed by these tests)


def test_triton_version_text_reads_the_triton_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    assert sc.triton_version_text() == "3.6.0"


def test_the_cache_key_names_every_field_in_order(hopper):
    key = sc.check_key(torch.device("cpu"), 8, 4, BF16)
    assert key == (f"device=cpu|torch={torch.__version__}|triton=3.6.0|fla={sys.modules['fla'].__version__}|K=8|V=4"
                   "|dtype=bfloat16")


def test_the_guard_is_lifted_returning_its_value_before_and_a_missing_flag_is_said(hopper, monkeypatch):
    flags = sys.modules[fla_standin.GUARD_MODULE]
    flags.TRITON_ABOVE_3_7_1 = False
    assert sc.lift_fla_guard() is False and flags.TRITON_ABOVE_3_7_1 is True
    assert sc.lift_fla_guard() is True
    monkeypatch.delattr(flags, "TRITON_ABOVE_3_7_1")
    with pytest.raises(RuntimeError) as e:
        sc.lift_fla_guard()
    assert str(e.value) == ("fla.ops.common.chunk_o has no TRITON_ABOVE_3_7_1: not the guard of fla 0.6 this check "
                            "lifts")


def test_the_checks_problem_has_its_shapes_devices_dtypes_and_values():
    """The kernel inputs in the dtype checked, the fp32 ones (g, h0, do, dht) too, all on the device checked (the
    meta device stands in for a GPU); shapes from CHECK_SHAPE; the initial state about 0.1 in size. The problem is
    pinned by its sums: a verdict cached on one machine was computed on exactly this problem, and the cache key does
    not name it (change CACHE_FILE with the problem)."""
    b, t, h = sc.CHECK_SHAPE["B"], sc.CHECK_SHAPE["T"], sc.CHECK_SHAPE["H"]
    (q, k, v, beta), (g, h0, do, dht) = sc._check_inputs(torch.device("meta"), 8, 4, BF16)
    shapes = [(b, t, h, 8), (b, t, h, 8), (b, t, h, 4), (b, t, h), (b, t, h), (b, h, 8, 4), (b, t, h, 4), (b, h, 8, 4)]
    assert [tuple(x.shape) for x in (q, k, v, beta, g, h0, do, dht)] == shapes
    assert all(x.device.type == "meta" for x in (q, k, v, beta, g, h0, do, dht))
    assert [x.dtype for x in (q, k, v, beta, g, h0, do, dht)] == [BF16] * 4 + [torch.float32] * 4
    (q, k, v, beta), (g, h0, do, dht) = sc._check_inputs(torch.device("cpu"), 8, 4, torch.float32)
    assert 0.08 < h0.std() < 0.13
    sums = [round(float(x.double().sum()), 2) for x in (q, k, v, beta, g, h0, do, dht)]
    assert sums == pytest.approx(PINNED_PROBLEM_SUMS, abs=0.02), sums


def test_the_check_runs_on_its_device_and_computes_the_reference_without_tf32(hopper, monkeypatch):
    """The problem is drawn for the device checked, the fp32 reference runs with TF32 off (TF32's 10-bit products
    would make the reference itself the error) and the setting is restored after."""
    asked, tf32 = [], []
    real_inputs, real_reference = sc._check_inputs, sc.delta_rule_chunk_major
    monkeypatch.setattr(sc, "_check_inputs", lambda device, *a: asked.append(device) or real_inputs(device, *a))
    monkeypatch.setattr(sc, "delta_rule_chunk_major",
                        lambda *a: tf32.append(torch.backends.cuda.matmul.allow_tf32) or real_reference(*a))
    before = torch.backends.cuda.matmul.allow_tf32  # a property of torch's: set and restored by hand
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
        assert asked == [torch.device("cpu")] and tf32 == [False] and torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_verdict_names_its_shape_tolerances_worst_error_and_time(hopper, monkeypatch):
    """Each error is compared with its own tolerance (outputs BF16_OUT_TOL, gradients BF16_GRAD_TOL, an error equal
    to its tolerance passes, a NaN fails); the worst is the largest error over its tolerance, a NaN before any;
    errors are kept to 6 decimals and the seconds to 2 (the errors come from a stand-in here)."""
    keys = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dh0"]
    for errors, worst, wrong in (([0.019, 0.02, 0.03, 0.0123456789, 0, 0, 0, 0.045], "final_state", []),
                                 ([0.001, 0, 0, 0.06, 0, float("nan"), 0, 0], "dbeta", ["dbeta", "dk"])):
        values = iter(errors)
        monkeypatch.setattr(sc, "relative_error", lambda a, b: next(values))
        verdict = sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
        assert verdict["tolerance"] == {k: sc.BF16_OUT_TOL if k in ("o", "final_state") else sc.BF16_GRAD_TOL
                                        for k in keys}
        assert verdict["worst"] == worst and verdict["wrong"] == wrong and verdict["passed"] is (not wrong)
        assert verdict["shape"] == {"B": 2, "T": 256, "H": 2, "K": 8, "V": 4}
        assert 0 <= verdict["seconds"] < 600 and verdict["seconds"] == round(verdict["seconds"], 2)
    assert verdict["rel_err"]["dk"] == 0.06
    monkeypatch.setattr(sc, "relative_error", lambda a, b: 0.0123456789)
    clock = iter([10.0, 10.123456])  # the check's start and end on a stand-in clock
    monkeypatch.setattr(sc.time, "perf_counter", lambda: next(clock))
    verdict = sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
    assert verdict["rel_err"]["o"] == 0.012346 and verdict["seconds"] == 0.12


def test_the_check_leaves_the_guard_as_it_found_it_whatever_it_was(hopper):
    flags = sys.modules[fla_standin.GUARD_MODULE]
    for before in (False, True):
        flags.TRITON_ABOVE_3_7_1 = before
        sc.run_gated_backward_check(torch.device("cpu"), 8, 4, BF16)
        assert flags.TRITON_ABOVE_3_7_1 is before


def test_an_unwritable_verdict_cache_is_said_at_debug_level(hopper, monkeypatch, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    with caplog.at_level(logging.DEBUG, logger=sc.logger.name):
        sc._store_verdict("key", {"passed": True})
    assert re.fullmatch(r"fla gated-backward verdict not stored \(\[Errno \d+\] .+\)", caplog.messages[-1])


def test_the_decision_is_logged_once_per_device_at_warning_unless_forced_safe(hopper, checks, caplog, monkeypatch):
    """A decision taken by the check (or forced to fla) is a WARNING naming the device and where the verdict came
    from; a forced safe path is INFO; each (mode, device, K, V, dtype) is decided and logged once."""
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert sc.fla_gated_backward_allowed(torch.device("cpu"), 8, 4, BF16)
        assert sc.fla_gated_backward_allowed(torch.device("cpu"), 8, 4, BF16)
        assert sc.fla_gated_backward_allowed(torch.device("meta"), 8, 4, BF16) is False  # another device: decided
    first, second = caplog.records
    assert first.levelno == logging.WARNING
    assert "TAKEN for K=8 V=4 bfloat16 on cpu: the check on this device (" in first.getMessage()
    assert "not taken (the compiled form) for K=8 V=4 bfloat16 on meta" in second.getMessage()
    caplog.clear()
    monkeypatch.setenv(sc.MODE_ENV, "safe")
    with caplog.at_level(logging.INFO, logger="fastweights.ops.delta_rule"):
        assert not sc.fla_gated_backward_allowed(torch.device("cpu"), 8, 4, BF16)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.getMessage().endswith(f"on cpu: {sc.MODE_ENV}=safe")
