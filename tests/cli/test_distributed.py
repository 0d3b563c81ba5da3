"""Data-parallel training with torchrun: 2 CPU processes (gloo) match one process with the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from fastweights.cli import main
from helpers import HANG_GUARD_S

COMMON = ["--preset", "tiny", "--quiet", "--set", "train.max_steps=6", "--set", "train.eval_every=0",
          "--set", "train.batch_size=8", "--set", "train.grad_accum=2", "--set", "train.threads=1"]


# A rank of a gloo run on a heavily loaded 2-core machine occasionally aborts in C++ ("terminate called
# without an active exception", exit -6; seen twice in this project, both while two other training jobs
# loaded the machine; not reproduced on an idle one, cause not found). Such a run is tried once more from
# scratch; any other failure, a second abort, or a wrong result still fails the test.
GLOO_ABORT = "terminate called without an active exception"


def torchrun(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "fastweights", "train", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S, cwd=tmp_path)
    if r.returncode != 0 and GLOO_ABORT in r.stderr and "--overwrite" not in args:
        r = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_match_one(tmp_path, fsdp):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert main(["train", *COMMON, "--out", str(single)]) == 0
    torchrun([*COMMON, "--out", str(multi), *(["--fsdp"] if fsdp else [])], tmp_path)
    a = json.loads((single / "summary.json").read_text())
    b = json.loads((multi / "summary.json").read_text())
    assert b["processes"] == 2 and b["steps"] == a["steps"] == 6
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
    # resume the 2-process run in one process: it continues from the same state
    assert main(["train", "--resume", "--quiet", "--out", str(multi), "--set", "train.max_steps=8"]) == 0
    assert main(["train", "--resume", "--quiet", "--out", str(single), "--set", "train.max_steps=8"]) == 0
    a = json.loads((single / "summary.json").read_text())
    b = json.loads((multi / "summary.json").read_text())
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
