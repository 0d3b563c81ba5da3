"""The silent surprises and tracebacks of issue 32 (items 7-8): each one line, exit 2, or a one-line warning."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fastweights.cli import main
from helpers import stderr_text, tiny_training_run

TINY = ["--preset", "tiny", "--quiet"]

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_training_run(tmp_path_factory.mktemp("surprises") / "run", steps=6)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("surprises-doc") / "doc.txt"
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3)
    return str(path)


_err = stderr_text


def test_warmup_longer_than_the_run_is_warned(tmp_path, capsys):
    assert main(["train", *TINY, "--set", "train.max_steps=3", "--set", "train.eval_every=0",
                 "--out", str(tmp_path / "w")]) == 0
    lines = [x for x in _err(capsys).splitlines() if "warmup_steps" in x]
    assert len(lines) == 1 and "warmup_steps=5 > train.max_steps=3" in lines[0] and "never reaches" in lines[0]


def test_resume_refuses_another_tokenizer(run, tmp_path, capsys):
    out = tmp_path / "r"
    shutil.copytree(run, out)
    assert main(["train", "--resume", "--quiet", "--out", str(out), "--set", "data.tokenizer=byte"]) == 2
    err = _err(capsys)
    assert err.count("\n") == 0 and "data.tokenizer='char'" in err
    assert json.loads((out / "config.json").read_text())["data"]["tokenizer"] == "char"


def test_a_checkpoint_without_manifest_is_refused_unless_unverified(run, doc, tmp_path, capsys):
    out = tmp_path / "m"
    shutil.copytree(run, out)
    (out / "checkpoint.json").unlink()
    for command in (["eval"], ["generate", "--max-tokens", "3"], ["dynamic", "eval", "--rule", "sgd"]):
        args = [*command, "--checkpoint", str(out)] + (["--data", doc, "--quiet"] if command[0] != "generate" else [])
        assert main(args) == 2, command
        err = _err(capsys)
        assert err.count("\n") == 0 and "has no checkpoint.json" in err and "--unverified" in err, err
    assert main(["eval", "--checkpoint", str(out), "--data", doc, "--quiet", "--unverified"]) == 0
    assert "has no checkpoint.json: its files are loaded unverified" in _err(capsys)


def test_after_divergence_before_a_save_the_advice_works(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["train", *TINY, "--out", str(out), "--set", "train.lr=1e5", "--set", "train.grad_clip=0",
                 "--set", "train.warmup_steps=0", "--set", "train.max_steps=50"]) == 2
    first = _err(capsys)
    assert "diverged" in first
    if (out / "checkpoint.json").exists():  # pragma: no cover - diverged after a save: --resume is right
        pytest.skip("this run saved before diverging")
    assert main(["train", *TINY, "--out", str(out), "--set", "train.max_steps=2"]) == 2
    line = _err(capsys).splitlines()[-1]
    assert "no checkpoint to resume" in line and "--resume" not in line and "--overwrite" in line
    assert main(["train", *TINY, "--out", str(out), "--set", "train.max_steps=2", "--set", "train.eval_every=0",
                 "--overwrite"]) == 0  # the advice leads somewhere that works


def test_token_cache_ids_outside_the_vocabulary(run, tmp_path, capsys):
    """A crafted cache on --resume is re-encoded (never an IndexError); opened directly it is one line."""
    from fastweights.core.errors import UserError
    from fastweights.data.streams import TokenStream

    out = tmp_path / "c"
    shutil.copytree(run, out)
    path = next((out / "data").glob("train-*.bin"))
    ids = np.fromfile(path, dtype="<u2")
    ids[5] = 65000
    ids.tofile(path)
    with pytest.raises(UserError, match="outside the vocabulary"):
        TokenStream.open(path)
    assert main(["train", "--resume", "--quiet", "--out", str(out), "--set", "train.max_steps=7"]) == 0
    assert np.fromfile(path, dtype="<u2").max() < 65000
    _err(capsys)


def test_export_hf_under_a_file(run, tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "file").write_text("x")
    assert main(["export-hf", str(run), str(tmp_path / "file" / "sub")]) == 2
    assert "is a file, not a directory" in _err(capsys)
