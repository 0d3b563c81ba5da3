"""Run directories and model directories as untrusted input (issue 32): nothing in ``--out`` is written through a
symbolic link, Hugging Face directories run no code and hold no pickles or non-finite weights, an unknown hub name
without network fails fast, and user numbers are checked before anything is allocated. Each case: one line, exit 2,
no traceback, nothing written outside the directories named."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fastweights.cli import main

TINY = ["--preset", "tiny", "--quiet"]
SHORT = [*TINY, "--set", "train.max_steps=4", "--set", "train.eval_every=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("untrusted") / "run"
    assert main(["train", *SHORT, "--out", str(out)]) == 0
    return out


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1] if err else ""


def _copy(run, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl"])
def test_resume_never_writes_through_a_symlink(run, tmp_path, capsys, name):
    out = _copy(run, tmp_path, "linked")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(victim)
    rc = main(["train", *SHORT, "--set", "train.max_steps=6", "--out", str(out), "--resume"])
    line = _err_line(capsys)
    assert rc == 2 and "symbolic link" in line and name in line
    assert victim.read_text() == "precious\n"
    # a dangling link is not followed either (it would create the file it points to)
    victim.unlink()
    assert main(["train", *SHORT, "--set", "train.max_steps=6", "--out", str(out), "--resume"]) == 2
    assert "symbolic link" in _err_line(capsys) and not victim.exists()


def test_atomic_write_replaces_a_planted_temporary_link(tmp_path):
    from fastweights.core.files import atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f".summary.json.{os.getpid()}.tmp").symlink_to(victim)
    atomic_write(tmp_path / "summary.json", lambda p: p.write_text(json.dumps({"a": 1})))
    assert victim.read_text() == "precious\n" and json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
