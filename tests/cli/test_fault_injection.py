"""kill -9 at random instants of tiny training runs, saves included: the run directory always holds a
complete checkpoint (the last one written, or the one before), never a mix, and resuming from it
continues bit-exactly to the uninterrupted run: weights, AdamW state and the torch, batch-order, Python and
numpy RNG streams equal the reference's at the same step, and after every save that returns no temporary
file is left in the directory.

The test starts this file as a script (a fresh interpreter that has imported torch once); the
script forks a training process (``fastweights train`` through ``fastweights.cli.main``), sends it
SIGKILL at a random instant, checks the directory it left, and starts the next one with
``--resume``, until 24 kills have landed; the last run goes to the end. Forking keeps each start
to milliseconds, so 24 real kills of real processes fit in seconds. The save pauses a few
milliseconds at each of its phases (the test hook ``FASTWEIGHTS_TEST_SAVE_PAUSE`` in
``fastweights.models.loading``), so that many kills land inside a save.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

KILLS = 24
STEPS = 40
ARGS = ["train", "--preset", "tiny", "--quiet", "--set", f"train.max_steps={STEPS}", "--set", "train.save_every=1",
        "--set", "train.eval_every=25", "--set", "train.eval_tokens=256", "--set", "train.log_every=1",
        "--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "train.batch_size=4",
        "--set", "train.seq_len=16"]
PAUSE = "0.002"  # seconds at each phase of a save


def test_kill_9_at_random_instants_leaves_a_complete_checkpoint_that_resumes_bit_exactly(tmp_path):
    from helpers import HANG_GUARD_S  # here, not at the top: this file also runs as a script, without tests/ on the path

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kills"] >= 20
    assert report["kills_inside_a_save"] >= 3, report  # a temporary or committed-but-unswapped save was present
    print(report, f"{time.perf_counter() - t0:.1f} s")


# ----------------------------------------------------------------------------- the script


def _check_saves(root: Path) -> None:
    """In a training process: after every save that returns, the run directory holds no temporary (neither
    this save's nor one a killed process left); each save appends a line to ROOT/saves.txt."""
    import fastweights.loops.train as train_module
    from fastweights.checkpoints.format import PENDING, TMP_PREFIX

    real = train_module.save_model

    def save_and_check(model, directory, *args, step=None, **kw):
        out = real(model, directory, *args, step=step, **kw)
        left = sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(TMP_PREFIX) or p.name == PENDING)
        fd = os.open(root / "saves.txt", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (f"step {step} left {' '.join(left)}\n" if left else f"step {step} clean\n").encode())
        os.close(fd)
        return out

    train_module.save_model = save_and_check


def _fork_train(argv: list[str], pause: str | None, root: Path) -> int:
    import gc

    gc.freeze()  # the child's garbage collector then leaves the parent's objects (and their pages) alone
    pid = os.fork()
    if pid == 0:  # the child: a training process, silenced
        try:
            if pause:
                os.environ["FASTWEIGHTS_TEST_SAVE_PAUSE"] = pause
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            _check_saves(root)
            from fastweights.cli import main

            code = main(argv)
        except BaseException:  # noqa: BLE001 - any escape is a failure the parent reports
            code = 99
        os._exit(code)
    return pid


def _wait(pid: int, timeout: float) -> int | None:
    """Exit status if the child ends within ``timeout`` seconds, else None."""
    end = time.perf_counter() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.perf_counter() >= end:
            return None
        time.sleep(0.002)


def _reference(root: Path) -> Path:
    """An uninterrupted run; every checkpoint it writes is copied to ref-steps/<step>/."""
    import shutil

    import fastweights.loops.train as train_module

    import gc

    steps = root / "ref-steps"
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        try:
            real = train_module.save_model

            def save_and_copy(model, directory, *args, step=None, **kw):
                out = real(model, directory, *args, step=step, **kw)
                shutil.copytree(directory, steps / str(step), ignore=shutil.ignore_patterns("data", ".*", "*.jsonl"))
                return out

            train_module.save_model = save_and_copy
            _check_saves(root)
            from fastweights.cli import main

            code = main([*ARGS, "--out", str(root / "ref")])
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 99
        os._exit(code)
    assert _wait(pid, 240) == 0, "the reference run failed"
    return steps


def _tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check(run: Path, ref_steps: Path) -> int | None:
    """The checkpoint in ``run`` equals the reference's at its step, weights and trainer state; returns the step."""
    from safetensors.torch import load_file

    from fastweights.models.loading import load_checkpoint, load_for_resume
    from fastweights.checkpoints.format import PENDING, Checkpoint, parse_trainer_state

    if not (run / "checkpoint.json").is_file() and not (run / PENDING / "checkpoint.json").is_file():
        assert not (run / "model.safetensors").exists(), "weights without a manifest"
        return None
    model, _, _ = load_checkpoint(run)
    step = Checkpoint(run).step
    ref = ref_steps / str(step)
    assert _tensors_equal(model.state_dict(), load_file(str(ref / "model.safetensors"))), f"weights differ at {step}"
    unit = load_for_resume(run)
    want = parse_trainer_state((ref / "trainer_state.safetensors").read_bytes(), "reference")
    got = unit["state"]
    assert got["step"] == want["step"] == step
    for fqn, s in want["optimizer"]["state"].items():
        assert _tensors_equal(got["optimizer"]["state"][fqn], s), f"optimizer state of {fqn} differs at {step}"
    assert _tensors_equal({k: v for k, v in got["rng"].items() if k in ("torch", "batches")},
                          {k: v for k, v in want["rng"].items() if k in ("torch", "batches")}), f"torch RNG at {step}"
    assert got["rng"]["python"] == want["rng"]["python"], f"Python RNG differs at {step}"
    kind, keys, pos, has_gauss, gauss = got["rng"]["numpy"]
    assert (kind, pos, has_gauss, gauss) == tuple(want["rng"]["numpy"][i] for i in (0, 2, 3, 4)), step
    assert (keys == want["rng"]["numpy"][1]).all(), f"numpy RNG differs at {step}"
    return step


def _loss_records(path: Path) -> list[tuple]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in recs]


def script(root: Path) -> None:
    import shutil

    import torch

    torch.set_num_threads(1)
    import matplotlib
    import torch._dynamo  # noqa: F401 - imported once here rather than in every forked run (AdamW needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    import fastweights.cli  # noqa: F401
    from fastweights.checkpoints.format import PENDING, TMP_PREFIX

    ref_steps = _reference(root)
    rng = random.Random(19)
    kills = inside_save = chains = 0
    steps_seen = []
    # kill instants are drawn from [0, window); on a loaded machine a process may not reach its first save
    # within the default window, so the window widens whenever a kill finds nothing saved yet
    window = 0.8
    while kills < KILLS:  # chains of kill and resume, each run to its end (a second chain if the first ends early)
        run = root / f"run{chains}"
        chains += 1
        # the encoded corpus (a cache keyed by content and tokenizer), so that the first runs are not all
        # killed while encoding it
        shutil.copytree(root / "ref" / "data", run / "data")
        while True:
            resume = (run / "checkpoint.json").is_file() or (run / PENDING / "checkpoint.json").is_file()
            argv = [*ARGS, "--out", str(run), *(["--resume"] if resume else ["--overwrite"])]
            last = kills >= KILLS
            pid = _fork_train(argv, None if last else PAUSE, root)
            code = _wait(pid, 240 if last else rng.uniform(0.0, window))
            if code is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                kills += 1
                inside_save += any(p.name.startswith(TMP_PREFIX) or p.name == PENDING for p in run.iterdir())
                steps_seen.append(_check(run, ref_steps))
                if steps_seen[-1] is None:
                    window = min(2 * window, 8.0)
                continue
            assert code == 0, f"a training process exited with {code}"
            assert _check(run, ref_steps) == STEPS
            break
        # the end: bit-exact to the uninterrupted run (checked above), the same log, nothing temporary left
        assert _loss_records(run / "metrics.jsonl") == _loss_records(root / "ref" / "metrics.jsonl")
        leftovers = [p.name for p in run.iterdir() if p.name.startswith(".")]
        assert not leftovers, leftovers
    # after every save that returned, in the reference and in every run, no temporary was left
    saves = (root / "saves.txt").read_text().splitlines()
    dirty = [line for line in saves if not line.endswith(" clean")]
    assert not dirty, dirty
    assert len(saves) > STEPS, len(saves)  # the reference's saves and the chains'
    print(json.dumps({"kills": kills, "kills_inside_a_save": inside_save, "chains": chains,
                      "steps_after_kills": steps_seen, "saves_checked": len(saves)}))

if __name__ == "__main__":
    script(Path(sys.argv[1]))
