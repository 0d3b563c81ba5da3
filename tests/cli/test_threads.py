"""Thread defaults (fastweights.core.threads, issue 40): scoring uses one thread; training takes the cores idle
when it starts, unless OMP_NUM_THREADS or train.threads decides; the demo trains a fixed number of steps and
says when the machine is much slower than the one it was sized on."""

import pytest
import torch

import fastweights.core.threads as threads_module
from fastweights.core.config import make_config
from fastweights.experiments import demo
from fastweights.loops.train import train


@pytest.mark.parametrize("cores, busy, want", [(2, 0.1, 2), (2, 0.9, 1), (2, 3.5, 1), (1, 0.0, 1), (8, 2.4, 6)])
def test_training_threads_are_the_idle_cores(monkeypatch, cores, busy, want):
    monkeypatch.setattr(threads_module, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads_module, "busy_cores", lambda sample_s=0.0: busy)
    assert threads_module.training_threads() == want


def test_busy_cores_sees_a_busy_process():
    import subprocess
    import sys

    idle = threads_module.busy_cores(0.3)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        loaded = threads_module.busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert loaded >= 0.6 and loaded > idle - 0.5  # one core spinning reads as about one busy core


def test_busy_cores_counts_iowait_as_idle(monkeypatch):
    """A core waiting on the disk (iowait in /proc/stat) is free for training's threads: between two readings
    where only iowait grew the machine reads as idle, and where user time grew by half the jiffies as half its
    cores busy. Read from two stand-in /proc/stat first lines (user nice system idle iowait irq softirq steal
    guest guest_nice), on 4 cores. Mutation caught: iowait counted as busy (``idle = fields[3]``, issue 49)."""
    import io
    import os

    lines = iter(["cpu  100 0 100 1000 0 0 0 0 0 0\n", "cpu  100 0 100 1000 400 0 0 0 0 0\n",
                  "cpu  100 0 100 1000 0 0 0 0 0 0\n", "cpu  300 0 100 1200 0 0 0 0 0 0\n"])
    monkeypatch.setattr(threads_module, "open", lambda path, *a, **k: io.StringIO(next(lines)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert threads_module.busy_cores(0.0) == 0.0  # only iowait grew
    assert threads_module.busy_cores(0.0) == pytest.approx(2.0)  # 200 of 400 jiffies busy on 4 cores
    # kernels before 2.5.41 write four fields (no iowait): read, not an IndexError
    lines = iter(["cpu  100 0 100 1000\n", "cpu  200 0 100 1100\n"])
    assert threads_module.busy_cores(0.0) == pytest.approx(2.0)
    # no /proc/stat: the 1-minute load average, and where there is none either (Windows), an idle machine
    monkeypatch.setattr(threads_module, "_cpu_times", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 0.5))
    assert threads_module.busy_cores(0.0) == 1.5
    monkeypatch.delattr(os, "getloadavg")
    assert threads_module.busy_cores(0.0) == 0.0


@pytest.mark.parametrize("omp, set_threads, want", [(None, 0, 2), ("1", 0, 1), (None, 3, 3), ("1", 3, 3)])
def test_train_takes_idle_cores_unless_told(tmp_path, monkeypatch, omp, set_threads, want):
    monkeypatch.setattr(threads_module, "training_threads", lambda: 2)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    torch.set_num_threads(1)  # what the process had (conftest; torchrun's OMP_NUM_THREADS=1 too)
    cfg = make_config("tiny", ["train.max_steps=2", f"train.threads={set_threads}"])
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["threads"] == want


def test_the_demo_warns_only_a_machine_much_slower_than_the_one_it_was_sized_on():
    assert demo.slow_machine_warning(demo.DEMO_STEPS, demo.DEMO_STEPS_PER_S) is None
    assert demo.slow_machine_warning(demo.DEMO_STEPS, demo.DEMO_STEPS_PER_S / 1.2) is None
    warning = demo.slow_machine_warning(demo.DEMO_STEPS, demo.DEMO_STEPS_PER_S / 3)
    assert warning.startswith("warning: ") and "same" in warning


def test_the_demo_times_its_own_training_step():
    cfg = make_config(demo.PRESET, [f"train.max_steps={demo.DEMO_STEPS}", "train.max_minutes=0"])
    assert 0 < demo.timed_steps_per_s(cfg, steps=1) < 1e4


def test_the_demos_timed_rate_counts_only_the_timed_steps(monkeypatch):
    """The rate the slow-machine warning is judged on is the timed steps over their time: on a stand-in clock
    that each optimizer step moves by half a second, 2 timed steps after the :data:`demo.WARMUP_STEPS` untimed
    ones read as 2.0 steps/s, whatever the warm-up cost. Mutation caught: the warm-up steps counted in the rate
    (``(steps + WARMUP_STEPS) / ...``: 5 steps/s, the warning given too rarely; issue 49)."""
    import types

    import fastweights.loops.schedule as schedule

    clock = [0.0]
    real = schedule.make_optimizer

    def ticking(model, cfg):
        opt = real(model, cfg)
        step = opt.step
        opt.step = lambda *a, **k: (clock.__setitem__(0, clock[0] + 0.5), step(*a, **k))[1]
        return opt

    monkeypatch.setattr(schedule, "make_optimizer", ticking)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = make_config(demo.PRESET, [f"train.max_steps={demo.DEMO_STEPS}", "train.max_minutes=0"])
    assert demo.timed_steps_per_s(cfg, steps=2) == pytest.approx(2.0)
    assert clock[0] == pytest.approx(0.5 * (2 + demo.WARMUP_STEPS))  # the warm-up steps did run


def test_every_front_end_resolves_its_threads_by_its_kind_of_work():
    import inspect

    from fastweights.cli import build_parser
    from fastweights.harness.models import FastweightsLM

    assert inspect.signature(FastweightsLM.__init__).parameters["threads"].default == 0
    for argv, work in ((["eval", "--checkpoint", "x"], "scoring"), (["generate", "--checkpoint", "x"], "scoring"),
                       (["dynamic", "eval", "--checkpoint", "x", "--data", "y"], "scoring"),
                       (["task", "assoc"], "task")):
        args = build_parser().parse_args(argv)
        assert (args.threads, args.thread_work) == (0, work)
    for argv in (["demo"], ["train", "--preset", "tiny"]):  # resolved inside run_demo / train (train.threads)
        assert getattr(build_parser().parse_args(argv), "thread_work", None) is None
    # the demo trains on the idle cores unless told (0), as train does (seed-4 mutation draw: a default of 1 passed)
    assert build_parser().parse_args(["demo"]).threads == 0
    assert build_parser().parse_args(["train", "--preset", "tiny"]).threads is None  # the preset's train.threads


@pytest.mark.parametrize("work, omp, requested, want", [
    ("scoring", None, 0, 1), ("task", None, 0, 1), ("training", None, 0, 2), ("training", "1", 0, 1),
    ("scoring", "2", 0, 2), ("scoring", "2", 3, 3), ("training", "x", 0, 2), ("scoring", None, 2, 2),
    ("benchmark", None, 0, 3), ("benchmark", "2", 1, 1)])
def test_use_threads_takes_the_request_then_omp_num_threads_then_the_work_default(monkeypatch, work, omp, requested,
                                                                                   want):
    monkeypatch.setattr(threads_module, "training_threads", lambda: 2)
    # a benchmark's default told apart from scoring's (both 1 as shipped; seed 18: `work != "benchmark"` survived)
    monkeypatch.setattr(threads_module, "BENCHMARK_THREADS", 3)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    try:
        assert threads_module.use_threads(work, requested) == want
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_torch_threads_are_set_in_one_place():
    import pathlib

    src = pathlib.Path(threads_module.__file__).parents[1]
    callers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                     if "torch.set_num_threads(" in p.read_text())
    assert callers == ["core/threads.py"]


def test_the_command_line_lets_idle_openmp_threads_sleep_unless_told_otherwise():
    import os
    import subprocess
    import sys

    code = "import fastweights.cli, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"  # the user's setting stands
    code = "import torch, fastweights.cli, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"  # torch (and OpenMP) already loaded: too late, so nothing is set


def test_the_demo_continues_its_own_run_and_refuses_any_other(tmp_path):
    """An interrupted demo continues on the same --out (issue 49: it had no --resume and its message said to use
    one); a folder holding another run is refused, never replaced (issue 52)."""
    from fastweights.core.errors import UserError

    cfg = make_config(demo.PRESET, ["train.max_steps=3", "train.max_minutes=0", "train.threads=1",
                                    "train.eval_every=0"])
    assert demo.demo_run_step(tmp_path / "none", cfg) is None
    train(make_config(demo.PRESET, ["train.max_steps=2", "train.max_minutes=0", "train.threads=1",
                                    "train.eval_every=0"]), tmp_path / "other_steps", progress=False)
    train(cfg, tmp_path / "own", progress=False)
    assert demo.demo_run_step(tmp_path / "own", cfg) == 3
    # the thread count is not part of the run: another machine continues it
    assert demo.demo_run_step(tmp_path / "own", make_config(demo.PRESET, [
        "train.max_steps=3", "train.max_minutes=0", "train.threads=2", "train.eval_every=0"])) == 3
    with pytest.raises(UserError, match="never replaces"):
        demo.demo_run_step(tmp_path / "other_steps", cfg)
    train(make_config("tiny", ["train.max_steps=1"]), tmp_path / "tiny", progress=False)
    with pytest.raises(UserError, match="never replaces"):
        demo.demo_run_step(tmp_path / "tiny", cfg)
    import json

    from fastweights.checkpoints.format import MANIFEST

    manifest = json.loads((tmp_path / "own" / MANIFEST).read_text())
    (tmp_path / "own" / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if k != "step"}))
    with pytest.raises(UserError, match="never replaces"):  # no step recorded: one line, not a traceback
        demo.demo_run_step(tmp_path / "own", cfg)
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="never replaces"):
        demo.demo_run_step(tmp_path / "loose", cfg)


@pytest.mark.parametrize("cores, busy, threads, warned", [(2, 0.1, 2, False), (2, 0.9, 2, True), (2, 0.9, 1, False),
                                                          (2, 1.9, 1, True), (8, 2.0, 4, False)])
def test_a_cpu_budget_on_a_busy_machine_is_warned_about(monkeypatch, cores, busy, threads, warned):
    """Issue 49: the niah-token preset's 15 CPU-minutes took hours of wall time on a busy machine, unannounced."""
    monkeypatch.setattr(threads_module, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads_module, "busy_cores", lambda sample_s=0.0: busy)
    warning = threads_module.busy_machine_warning(threads, 900.0)
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith("warning: ") and "15.0 CPU-minutes" in warning


def test_train_warns_of_a_busy_machine_only_for_a_cpu_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(threads_module, "busy_cores", lambda sample_s=0.0: 5.0)
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 2)
    for clock, warned in (("cpu", True), ("wall", False)):
        cfg = make_config("tiny", ["train.max_steps=1", "train.max_minutes=5", f"train.budget_clock={clock}"])
        train(cfg, tmp_path / clock, progress=True)
        assert ("CPU-minutes" in capsys.readouterr().err) == warned


def test_a_thread_count_past_four_per_core_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """Issue 52: --threads 5000 hung a 2-core machine and 100000 crashed torch; now one line, exit 2, nothing
    written."""
    from fastweights.cli import main
    from fastweights.core.errors import UserError

    monkeypatch.setattr(threads_module, "usable_cores", lambda: 2)
    assert threads_module.use_threads("scoring", 8) == 8
    torch.set_num_threads(1)
    with pytest.raises(UserError, match="at most 8"):
        threads_module.use_threads("scoring", 9)
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--set", "train.threads=5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("speed, slow", [(1.0, False), (0.05, True)])  # x the idle 2-core machine's rate
def test_the_demos_estimate_counts_only_the_steps_left(speed, slow, tmp_path, monkeypatch, capsys):
    """Continuing at step 400 of 1,000 at ``rate`` steps/s: the line says 600 steps and their minutes, and the
    slow-machine warning weighs those 600 (mutations caught: steps + done, left * rate, the warning's step count
    dropped)."""
    def stop(*a, **k):
        raise _Stop

    rate = speed * demo.DEMO_STEPS_PER_S
    monkeypatch.setattr(demo, "demo_run_step", lambda out, cfg: 400)
    monkeypatch.setattr(demo, "timed_steps_per_s", lambda cfg: rate)
    monkeypatch.setattr("fastweights.loops.train.train", stop)
    with pytest.raises(_Stop):
        demo.run_demo(tmp_path / "run", steps=1000, threads=1)
    out, err = capsys.readouterr()
    assert f"from step 400: 600 steps on 1 CPU thread (about {600 / rate / 60:.0f} minutes here)" in out, out
    assert ("warning: this machine trains the demo" in err) is slow
    if slow:
        assert f"about {600 / rate / 60:.0f} minutes for 600 steps" in err, err


@pytest.mark.parametrize("requested", [None, 0, -1])
def test_a_count_that_is_not_positive_is_the_default(requested, monkeypatch):
    """Only a positive count is taken as given; None, 0 and a negative one (a caller's) fall to OMP_NUM_THREADS,
    else the work's default. Mutation caught (issue 49, seed 9): a negative count handed to torch."""
    import torch

    from fastweights.core.threads import SCORING_THREADS, use_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert use_threads("scoring", requested) == SCORING_THREADS == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value, count", [("3", 3), (" 2 ", 2), ("0", None), ("", None), ("four", None), ("-1", None)])
def test_omp_num_threads_counts_only_as_a_positive_integer(monkeypatch, value, count):
    """torch ignores OMP_NUM_THREADS=0 and anything that is not a positive integer, so the library does too
    (seed-15 mutation draw: 0 taken as a count)."""
    from fastweights.core.threads import _omp_threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert _omp_threads() == count


def test_the_demo_trains_on_the_threads_it_is_given(tmp_path, monkeypatch):
    """--threads reaches the demo's run settings (not the training default, which is one thread on a 2-core
    machine)."""
    seen = []

    def stop(out, cfg):
        seen.append(cfg.train.threads)
        raise _Stop

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "demo_run_step", stop)
    before = torch.get_num_threads()
    try:
        with pytest.raises(_Stop):
            demo.run_demo(tmp_path / "run", steps=10, threads=3)
    finally:
        torch.set_num_threads(before)  # the demo set this process's count
    assert seen == [3]
