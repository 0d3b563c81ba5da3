"""Reliability and security of run directories: no pickle is executed, derived files are tied to the
weights they came from, the run lock, SIGINT/SIGTERM saving, divergence, a directory without a
manifest, the unknown-symbol warning, a signal before training starts or during the final validation, fresh
output names and one-line warnings. (kill -9: test_fault_injection.py; bad input: test_bad_input.py; the
state counted by the memory estimate: test_state_size.py.)"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
import signal
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fastweights.cli import main
from helpers import HANG_GUARD_S, signal_at_step

TINY = ["--preset", "tiny", "--quiet"]
SHORT = [*TINY, "--set", "train.max_steps=6", "--set", "train.eval_every=0"]


@pytest.fixture
def run(tiny_run):
    return tiny_run  # conftest: the tiny preset trained once per session (copied before any change)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3)
    return str(path)


def _copy(run, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1] if err else ""


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # unpickling would create the marker file


def test_a_directory_without_a_manifest_is_not_resumed_and_a_pickle_in_it_never_runs(run, doc, tmp_path, capsys):
    ckpt = _copy(run, tmp_path, "crafted")
    (ckpt / "checkpoint.json").unlink()
    (ckpt / "trainer_state.safetensors").unlink()
    marker = tmp_path / "code-was-run"
    with open(ckpt / "trainer_state.pt", "wb") as f:
        pickle.dump({"step": 3, "payload": _RunsCode(marker)}, f)
    assert main(["train", "--resume", "--quiet", "--out", str(ckpt)]) == 2
    assert "holds no checkpoint to resume" in _err_line(capsys)
    assert not marker.exists()
    # the weights of such a directory load for eval only when asked (they are safetensors: no code runs)
    assert main(["eval", "--checkpoint", str(ckpt), "--quiet", "--json", "--data", doc]) == 2
    assert main(["eval", "--checkpoint", str(ckpt), "--quiet", "--json", "--data", doc, "--unverified"]) == 0


def test_a_crafted_trainer_state_safetensors_is_refused(run, tmp_path, capsys):
    import hashlib

    from safetensors.torch import save_file

    ckpt = _copy(run, tmp_path, "crafted-st")
    state = json.dumps({"step": 6, "x": {"$ndarray": "|O", "shape": [1], "data": ["os.system"]}})
    save_file({}, str(ckpt / "trainer_state.safetensors"),
              metadata={"format": "fastweights-trainer-state", "version": "1", "state": state})
    m = json.loads((ckpt / "checkpoint.json").read_text())
    data = (ckpt / "trainer_state.safetensors").read_bytes()
    m["files"]["trainer_state.safetensors"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checkpoint.json").write_text(json.dumps(m))
    assert main(["train", "--resume", "--quiet", "--out", str(ckpt)]) == 2
    assert "corrupt trainer state" in _err_line(capsys)


def test_trainer_state_round_trip_without_pickle(tmp_path):
    from fastweights.checkpoints.format import parse_trainer_state, save_trainer_state

    rng = random.Random(3)
    state = {"step": 7, "history": [{"step": 5, "val_loss": float("nan")}], "rng": {"python": rng.getstate(),
             "numpy": np.random.RandomState(1).get_state(), "torch": torch.get_rng_state()},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(3, 2), "step": torch.tensor(7.0)}},
                           "param_groups": [{"betas": (0.9, 0.99), "params": [0], "fused": None}]},
             "carried": [None, {"S": torch.zeros(2, 2, dtype=torch.bfloat16), "pos": 12}]}
    save_trainer_state(state, tmp_path / "s.safetensors")
    back = parse_trainer_state((tmp_path / "s.safetensors").read_bytes(), "test")
    assert back["rng"]["python"] == rng.getstate()
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["carried"][1]["pos"] == 12 and back["carried"][1]["S"].dtype == torch.bfloat16
    assert math.isnan(back["history"][0]["val_loss"])
    np.testing.assert_array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])


def test_derived_files_are_tied_to_their_weights(run, tmp_path, capsys):
    from fastweights.adapt.setup import DynamicSettings, build_evaluator
    from fastweights.adapt.grad_stats import GradStats
    from fastweights.adapt.tune import save_tuned
    from fastweights.models.loading import load_checkpoint
    from fastweights.checkpoints.format import weights_fingerprint
    from fastweights.core.errors import UserError

    ckpt = _copy(run, tmp_path, "derived")
    doc = tmp_path / "doc.txt"
    doc.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3)
    base = ["dynamic", "eval", "--checkpoint", str(ckpt), "--data", str(doc), "--quiet", "--segment-len", "10"]
    # statistics made by `dynamic stats` record the weights; `dynamic eval` uses them
    assert main(["dynamic", "stats", "--checkpoint", str(ckpt), "--max-batches", "2", "--batch-size", "2",
                 "--segment-len", "10", "--quiet"]) == 0
    assert main([*base, "--json"]) == 0
    capsys.readouterr()
    # ... and refuses statistics or tuned settings made from other weights
    stats = GradStats.load(ckpt / "grad_stats.safetensors")
    stats.extra["weights_sha256"] = "ab" * 32
    stats.save(ckpt / "grad_stats.safetensors")
    assert main(base) == 2
    assert "grad_stats.safetensors was made from other weights" in _err_line(capsys)
    (ckpt / "grad_stats.safetensors").unlink()
    result = {"best": {"lr": 1e-3, "decay": 0.0}, "settings": {"rule": "sgd", "segment_len": 10, "sparse_units": None},
              "static": {}, "tokens": 1, "grid": []}
    tuned = ckpt / "dynamic_tuned.json"
    save_tuned(result, tuned, weights_sha256="cd" * 32)
    model, tok, cfg = load_checkpoint(ckpt)
    args = DynamicSettings(tuned=str(tuned), rule="sgd", segment_len=10)
    with pytest.raises(UserError, match="dynamic_tuned.json was made from other weights"):
        build_evaluator(args, model, tok, cfg, ckpt)
    save_tuned(result, tuned, weights_sha256=weights_fingerprint(ckpt))
    ev, _ = build_evaluator(args, model, tok, cfg, ckpt)
    assert ev.update_rule.lr == 1e-3  # the file tuned for these weights is used
    # a crafted tuned file is data: refused when malformed, never executed
    tuned.write_text(json.dumps({"best": {"lr": "__import__('os').system('x')", "decay": 0}, "rule": "sgd",
                                "settings": {}}))
    with pytest.raises(UserError, match="is not a tuning result"):
        build_evaluator(args, model, tok, cfg, ckpt)
    # --overwrite removes what was derived from the replaced weights
    stats.save(ckpt / "grad_stats.safetensors")
    assert main(["train", *SHORT, "--out", str(ckpt), "--overwrite"]) == 0
    assert not (ckpt / "grad_stats.safetensors").exists() and not (ckpt / "dynamic_tuned.json").exists()


def test_run_lock(run, tmp_path, capsys):
    from fastweights.checkpoints.run_dir import RunLock

    out = tmp_path / "locked"
    with RunLock(out):
        before = sorted(p.name for p in out.iterdir())
        assert main(["train", *SHORT, "--out", str(out)]) == 2
        line = _err_line(capsys)
        assert "in use by another training run" in line and f"process {os.getpid()}" in line
        assert sorted(p.name for p in out.iterdir()) == before
    # a lock file left by a dead process (kill -9) is stale: the next run takes it over and removes it at the end
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": "x"}))
    assert main(["train", *SHORT, "--out", str(stale)]) == 0
    assert not (stale / ".lock").exists()


def _not_json(constant: str):
    raise AssertionError(f"{constant} is not JSON (RFC 8259): an interrupted run's summary.json held it (issue 49)")


def test_json_text_writes_a_non_finite_number_as_null():
    from fastweights.core.files import json_text

    text = json_text({"a": float("nan"), "b": [float("inf"), 1.5, (float("-inf"),)], "c": {"d": 2}}, indent=None)
    assert json.loads(text, parse_constant=_not_json) == {"a": None, "b": [None, 1.5, [None]], "c": {"d": 2}}
    assert json_text({"a": [1.5]}) == '{\n  "a": [\n    1.5\n  ]\n}'  # by default indented for a reader, as results are


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_and_resume_is_bit_exact(signum, code, tmp_path, capsys):
    args = [*TINY, "--set", "train.max_steps=30", "--set", "train.eval_every=10", "--set", "train.log_every=1"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["train", *args, "--out", str(straight)]) == 0
    with signal_at_step(stopped / "metrics.jsonl", 4, signum):
        assert main(["train", *args, "--out", str(stopped)]) == code
    line = _err_line(capsys)
    k = json.loads((stopped / "checkpoint.json").read_text())["step"]
    summary = json.loads((stopped / "summary.json").read_text(), parse_constant=_not_json)  # strict JSON: no NaN
    assert 4 <= k < 30 and summary["steps"] == k and summary["interrupted_by"] == signal.Signals(signum).name
    assert f"holds the checkpoint of step {k}" in line and signal.Signals(signum).name in line
    assert main(["train", "--resume", "--quiet", "--out", str(stopped)]) == 0
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(stopped / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # bit-exact
    steps = [json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (straight / "metrics.jsonl").read_text().splitlines()]


def test_divergence_stops_with_one_line_and_saves_nothing_non_finite(doc, tmp_path, capsys):
    out = tmp_path / "diverge"
    assert main(["train", *TINY, "--out", str(out), "--set", "train.lr=1e5", "--set", "train.grad_clip=0",
                 "--set", "train.warmup_steps=0", "--set", "train.save_every=1", "--set", "train.max_steps=50"]) == 2
    line = _err_line(capsys)
    saved = json.loads((out / "checkpoint.json").read_text())["step"]
    assert "training diverged at step" in line and f"holds the checkpoint of step {saved}" in line
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "model.safetensors")).values())
    from fastweights.models.loading import load_checkpoint

    load_checkpoint(out)  # finite weights load; scores that overflow are refused in one line, never printed as nan
    rc = main(["eval", "--checkpoint", str(out), "--quiet", "--json", "--data", doc])
    assert rc == 0 or (rc == 2 and "not a number to report" in _err_line(capsys))
    capsys.readouterr()


def test_unknown_characters_are_reported(run, tmp_path, capsys):
    cjk = tmp_path / "cjk.txt"
    cjk.write_text("天地玄黃宇宙洪荒日月盈昃辰宿列張" * 10)
    assert main(["eval", "--checkpoint", str(run), "--data", str(cjk), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: 160 of 160 characters of the evaluation text are not in the model's char vocabulary" in err
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO: 你好", "--max-tokens", "2"]) == 0
    assert "2 of 9 characters of the prompt" in capsys.readouterr().err


def test_truncate_metrics_drops_a_validation_written_after_the_checkpoint(tmp_path):
    """The final validation follows the last save: a run killed after writing it and resumed at that step
    writes it again, so the old record goes (found by the kill -9 test under load)."""
    import json as _json

    from fastweights.checkpoints.run_dir import truncate_metrics

    recs = [{"step": 39, "loss": 1.0}, {"step": 40, "loss": 0.9}, {"step": 40, "val_loss": 2.0},
            {"step": 41, "loss": 0.8}]
    path = tmp_path / "metrics.jsonl"
    for validated, want in ((True, recs[:3]), (False, recs[:2])):
        path.write_text("".join(_json.dumps(r) + "\n" for r in recs) + '{"step": 42, "lo')  # a torn last line
        truncate_metrics(path, 40, validated=validated)
        assert [_json.loads(line) for line in path.read_text().splitlines()] == want


@pytest.mark.parametrize("signum, code, existed, host_handler",
                         [(signal.SIGINT, 130, False, False), (signal.SIGTERM, 143, True, False),
                          (signal.SIGINT, 130, False, True)],
                         ids=["SIGINT-new-out", "SIGTERM-existing-out", "SIGINT-host-replaced-its-handler"])
def test_a_signal_before_training_starts_leaves_out_as_it_was(signum, code, existed, host_handler, tmp_path,
                                                              monkeypatch, capsys, request):
    """Ctrl-C (or SIGTERM) while the corpus is encoded: what this run created goes, what was there stays; also
    in a process whose SIGINT handler is not Python's (a notebook, a test runner's worker: the suite once failed
    when an earlier test in the same worker left one)."""
    if host_handler:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    import fastweights.loops.train as train_module

    real = train_module.prepare_data

    def encode_then_signal(*args, **kw):
        real(*args, **kw)  # the token cache is now written under OUT/data
        assert (out / "data").is_dir()
        # raised in this (the main) thread: os.kill lets any thread take it, and a thread left by an earlier test
        # then takes it while the main thread sleeps on (seen in one process running the whole suite)
        signal.raise_signal(signum)
        for _ in range(100):
            time.sleep(0.01)  # the handler raises here, at the first check between two calls
        raise AssertionError("the signal did not stop the run")

    out = tmp_path / "parent" / "out"
    if existed:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(train_module, "prepare_data", encode_then_signal)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["train", *SHORT, "--out", str(out)]) == code
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored
    line = _err_line(capsys)
    assert line == (f"interrupted by {signal.Signals(signum).name} before training started: nothing was saved and "
                    f"{out} is as it was"), line
    if existed:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not (tmp_path / "parent").exists()


def test_a_signal_during_the_final_validation_is_reported(tmp_path, monkeypatch, capsys):
    """The validation and the save finish; the run then exits 130 naming the checkpoint it saved."""
    import fastweights.loops.train as train_module

    real = train_module.estimate_loss
    calls = []

    def signal_then_validate(*args, **kw):
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # recorded by the run's handler; the validation goes on
        return real(*args, **kw)

    out = tmp_path / "final"
    monkeypatch.setattr(train_module, "estimate_loss", signal_then_validate)
    assert main(["train", *SHORT, "--out", str(out)]) == 130  # eval_every=0: the final validation only
    assert calls == [1]
    line = _err_line(capsys)
    assert line == (f"interrupted by SIGINT: {out} holds the checkpoint of step 6; training had finished (the final "
                    "validation and save completed)"), line
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted_by"] == "SIGINT" and math.isfinite(summary["val_loss"])
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in json.loads(r)] == [6]
    monkeypatch.setattr(train_module, "estimate_loss", real)
    before = load_file(str(out / "model.safetensors"))
    assert main(["train", "--resume", "--quiet", "--out", str(out)]) == 0  # nothing left to do
    after = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_train_without_out_makes_a_dated_directory_and_warnings_are_one_line(tmp_path):
    """A fresh runs/PRESET-DATE-TIME (never runs/latest or an earlier run); a library warning (here the FWL
    head's segment warning) is one line without the file that raised it. A real process: pytest's own
    warning capture would hide the format."""
    import re
    import subprocess
    import sys

    latest = tmp_path / "runs" / "latest"
    latest.mkdir(parents=True)
    (latest / "checkpoint.json").write_text("{}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "fastweights", "train", "--preset", "tiny", "--quiet", "--set", 'model.head="fwl"',
            "--set", "train.max_steps=1", "--set", "train.eval_every=0", "--set", "train.eval_tokens=64",
            "--set", "train.warmup_steps=0"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(made) == 1 and re.fullmatch(r"tiny-\d{8}-\d{6}", made[0]), made
    assert (tmp_path / "runs" / made[0] / "checkpoint.json").is_file()
    assert sorted(p.name for p in latest.iterdir()) == ["checkpoint.json"]
    assert (latest / "checkpoint.json").read_text() == "{}"
    assert f"-> runs/{made[0]}" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: fwl: training windows of 32 tokens"), proc.stderr
    assert ".py" not in warnings[0] and "warnings.warn" not in proc.stderr


def test_eval_stream_without_out_writes_fresh_names(run, doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "stream.json").write_text("earlier")
    for _ in range(2):  # twice within one second: two names
        assert main(["eval", "--checkpoint", str(run), "--stream", "--data", doc, "--quiet", "--json"]) == 0
    capsys.readouterr()
    made = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "stream.json")  # one directory per run
    assert len(made) == 2 and all(sorted(q.name for q in d.iterdir()) == ["stream.json", "stream.png"] for d in made), made
    assert all(d.name.startswith("stream-") for d in made)
    assert (tmp_path / "runs" / "stream.json").read_text() == "earlier"


def test_train_names_the_unit_eval_names(tmp_path, capsys):
    """A character model's validation loss is bits per char in train's last line, as in eval's (issue 49: train
    said bits/token)."""
    assert main(["train", *TINY, "--set", "train.max_steps=2", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "bits/char ->" in out and "bits/token" not in out


def test_overwrite_never_clears_a_users_files(tmp_path, capsys):
    """Issue 52: a folder holding only a user's config.json was described as a run, the message suggested
    --overwrite, and --overwrite deleted the config.json and the folder's whole tensorboard/ tree."""
    user = tmp_path / "user"
    (user / "tensorboard").mkdir(parents=True)
    (user / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (user / "tensorboard" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert main(["train", *TINY, "--set", "train.max_steps=1", "--set", "train.warmup_steps=0", "--out", str(user), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "not a fastweights run" in err and "--overwrite" not in err.split("holds")[0] and len(err.splitlines()) == 1
    assert (user / "config.json").read_text().startswith('{"architectures"')
    assert (user / "tensorboard" / "notes.txt").read_text() == "mine"
    # a run of ours with tensorboard events and a user's file in tensorboard/: --overwrite removes only the events
    run = tmp_path / "run"
    assert main(["train", *TINY, "--set", "train.max_steps=1", "--set", "train.log=tensorboard", "--out", str(run)]) == 0
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    (run / "tensorboard" / "notes.txt").write_text("mine")
    old = {p.name for p in (run / "tensorboard").rglob("events.out.tfevents.*")}
    assert main(["train", *TINY, "--set", "train.max_steps=1", "--set", "train.log=tensorboard", "--out", str(run),
                 "--overwrite"]) == 0
    assert (run / "tensorboard" / "notes.txt").read_text() == "mine"
    assert not old & {p.name for p in (run / "tensorboard").rglob("events.out.tfevents.*")}


def test_overwrite_removes_only_the_runs_event_files_from_tensorboard(tmp_path):
    """``--overwrite``'s clean-up of tensorboard/: the run's event files go, a folder of the user's that happens to
    carry an event file's name stays with what it holds, as does a link named so (seed-16 mutation draw: ``or``)."""
    from fastweights.checkpoints.run_dir import remove_run

    board = tmp_path / "run" / "tensorboard"
    (board / "sub").mkdir(parents=True)
    (board / "events.out.tfevents.1").write_text("ours")
    (board / "sub" / "events.out.tfevents.2").write_text("ours")
    (board / "events.out.tfevents.folder").mkdir()
    (board / "events.out.tfevents.folder" / "notes.txt").write_text("the user's")
    (tmp_path / "elsewhere.txt").write_text("the user's")
    (board / "events.out.tfevents.link").symlink_to(tmp_path / "elsewhere.txt")
    remove_run(tmp_path / "run")
    left = sorted(str(p.relative_to(board)) for p in board.rglob("*"))
    assert left == ["events.out.tfevents.folder", "events.out.tfevents.folder/notes.txt", "events.out.tfevents.link"]
    assert (tmp_path / "elsewhere.txt").read_text() == "the user's"
