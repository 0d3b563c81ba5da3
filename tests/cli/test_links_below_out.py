"""Nothing below a folder the user named is written through a symbolic link (issue 39, scope 1): the helpers of
``core/files.py`` through which every write under ``--out`` and into an export directory goes. The commands'
cases (token cache, tensorboard, export-hf, checkpoints) are replayed in ``test_adversarial_replay.py``."""

from __future__ import annotations

import os

import pytest

from fastweights.core.errors import UserError
from fastweights.core.files import atomic_write, make_dirs, open_nofollow, refuse_links, write_into


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.txt").write_text("precious\n")
    return v


def _unchanged(victim):
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "precious\n"


def test_a_link_at_any_level_below_the_root_is_refused(tmp_path, victim):
    root = tmp_path / "out"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b").symlink_to(victim)
    with pytest.raises(UserError, match=r"a/b is a symbolic link; refusing to write the cache"):
        refuse_links(root, root / "a" / "b" / "c" / "x.bin", "the cache")
    with pytest.raises(UserError, match="symbolic link"):
        make_dirs(root, root / "a" / "b" / "c")
    with pytest.raises(UserError, match="symbolic link"):
        atomic_write(root / "a" / "b" / "x.json", lambda p: p.write_text("{}"), root=root)
    (root / "f.json").symlink_to(victim / "precious.txt")
    with pytest.raises(UserError, match="f.json is a symbolic link"):
        atomic_write(root / "f.json", lambda p: p.write_text("{}"), root=root)
    with pytest.raises(UserError, match="f.json is a symbolic link"):
        open_nofollow(root / "f.json", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    (root / "dangling").symlink_to(tmp_path / "nowhere")  # a dangling link is not followed either
    with pytest.raises(UserError, match="dangling is a symbolic link"):
        make_dirs(root, root / "dangling" / "x")
    assert not (tmp_path / "nowhere").exists()
    _unchanged(victim)


def test_the_root_itself_may_be_a_link_and_missing_folders_are_made(tmp_path, victim):
    real = tmp_path / "real"
    real.mkdir()
    root = tmp_path / "linked-out"
    root.symlink_to(real)  # the user named it: theirs to make
    make_dirs(root, root / "data" / "x")
    atomic_write(root / "data" / "x" / "f.json", lambda p: p.write_text("{}"), root=root)
    assert (real / "data" / "x" / "f.json").read_text() == "{}"
    with pytest.raises(ValueError):
        refuse_links(root, tmp_path / "elsewhere" / "f")
    with pytest.raises(ValueError):
        refuse_links(root, root / ".." / "victim" / "f")


def test_a_run_refuses_a_linked_token_cache_file_before_anything_is_written(tmp_path, victim):
    """``check_run_links``, the check a run makes before it writes anything, looks at each file of the token
    cache folder ``out/data`` (a planted link there would be read, or replaced by a new encoding), not only at
    the folder: a regular folder holding one linked cache file is refused in one line naming that file. Mutation
    caught: the loop over ``data``'s files checking the folder again instead of each file (issue 49)."""
    from fastweights.checkpoints.run_dir import check_run_links

    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "val-abc.bin").write_bytes(b"")
    check_run_links(out)  # regular files only: nothing to refuse
    (out / "data" / "train-abc.bin").symlink_to(victim / "precious.txt")
    with pytest.raises(UserError, match=r"data/train-abc\.bin is a symbolic link; refusing to write the token cache"):
        check_run_links(out)
    _unchanged(victim)


def test_a_run_folder_without_its_data_or_tensorboard_folders_passes_the_check(tmp_path):
    """A run folder that has not written ``data`` or ``tensorboard`` yet (an old run resumed with TensorBoard on)
    passes; a file at either name is refused with what the run would write there. Mutation caught: the file check
    taking a missing folder for a file (``exists() or not is_dir()``)."""
    from fastweights.checkpoints.run_dir import check_run_links

    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    check_run_links(out, tensorboard=True)
    (out / "tensorboard").write_text("")
    with pytest.raises(UserError) as e:
        check_run_links(out, tensorboard=True)
    assert str(e.value) == f"{out / 'tensorboard'} is a file, not a folder; cannot write the TensorBoard events"
    check_run_links(out)  # without TensorBoard the name is not the run's


def test_write_into_refuses_a_linked_destination_before_moving_anything(tmp_path, victim):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").symlink_to(victim / "precious.txt")

    def write(d):
        (d / "a.json").write_text("a")
        (d / "config.json").write_text("c")

    with pytest.raises(UserError, match="config.json is a symbolic link"):
        write_into(exp, write)
    _unchanged(victim)
    assert sorted(p.name for p in exp.iterdir()) == ["config.json"]  # nothing moved, no staging left
    (exp / "config.json").unlink()
    assert write_into(exp, write) == ["a.json", "config.json"]
    assert (exp / "config.json").read_text() == "c" and sorted(p.name for p in exp.iterdir()) == ["a.json", "config.json"]


def test_a_linked_cache_file_met_again_is_refused_as_the_token_cache(tmp_path, victim):
    """``cached_stream`` finding its cache file (or its sidecar) replaced by a link below the folder the user named:
    refused in one line that says what would have been written through it."""
    from fastweights.data.streams import _sidecar, cached_stream
    from fastweights.data.tokenizers import ByteTokenizer

    out, tok = tmp_path / "out", ByteTokenizer()
    stream = cached_stream(["some text"], tok, out / "data", "train", root=out)
    for planted in (stream.path, _sidecar(stream.path)):
        kept = planted.with_name(planted.name + ".kept")
        planted.rename(kept)
        planted.symlink_to(victim / "precious.txt")
        with pytest.raises(UserError, match=rf"{planted.name} is a symbolic link; refusing to write the token cache"):
            cached_stream(["some text"], tok, out / "data", "train", root=out)
        planted.unlink()
        kept.rename(planted)
    _unchanged(victim)


def test_encoding_names_the_token_cache_in_each_refusal(tmp_path, victim):
    """``encode_to_file`` below the folder the user named: a link at the cache file, or a file where its folder
    goes, is refused in one line that says it is the token cache that would have been written (seed-3 mutation
    draw: neither label was checked, only cached_stream's own)."""
    from fastweights.data.streams import encode_to_file
    from fastweights.data.tokenizers import ByteTokenizer

    out, tok = tmp_path / "out", ByteTokenizer()
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.bin").symlink_to(victim / "precious.txt")
    with pytest.raises(UserError, match=r"train\.bin is a symbolic link; refusing to write the token cache through it"):
        encode_to_file(["some text"], tok, out / "data" / "train.bin", root=out)
    _unchanged(victim)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data").write_text("a file where the cache folder goes\n")
    with pytest.raises(UserError, match=r"data is a file, not a folder; cannot write the token cache$"):
        encode_to_file(["some text"], tok, other / "data" / "train.bin", root=other)


def test_the_tensorboard_writer_refuses_a_link_itself_when_the_first_check_is_passed(tmp_path, victim, monkeypatch,
                                                                                      capsys):
    """The writer of the TensorBoard events checks the folder again as it makes it (a link planted after the run's
    first check, ``check_run_links``, which is skipped here to stage that race): one line naming what it refuses."""
    pytest.importorskip("tensorboard")
    from fastweights.checkpoints import run_dir
    from fastweights.cli import main

    monkeypatch.setattr(run_dir, "check_run_links", lambda *a, **k: None)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tensorboard").symlink_to(victim)
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(out), "--log", "tensorboard",
                 "--set", "train.max_steps=6"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out / 'tensorboard'} is a symbolic link; refusing to write "
                                               "the TensorBoard events through it (remove the link)")
    _unchanged(victim)


def test_a_summary_planted_as_a_link_during_the_run_is_refused(tmp_path, victim, monkeypatch, capsys):
    """summary.json is written below --out refusing links itself: a link planted during the run (here by the
    checkpoint writer, after the run's first check) gives one line, and the file the link names is untouched."""
    from fastweights.cli import main
    from fastweights.loops import train

    out = tmp_path / "out"
    save_model = train.save_model

    def save_and_plant(*args, **kwargs):
        save_model(*args, **kwargs)
        if not (out / "summary.json").is_symlink():
            (out / "summary.json").symlink_to(victim / "precious.txt")

    monkeypatch.setattr(train, "save_model", save_and_plant)
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(out), "--set", "train.max_steps=2",
                 "--set", "train.warmup_steps=0"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out / 'summary.json'} is a symbolic link; refusing to "
                                               "write the run summary through it (remove the link)")
    _unchanged(victim)


def test_a_commands_result_file_planted_as_a_link_is_refused_before_any_work(tmp_path, victim):
    """``output_prefix`` (every command writing DIR/STEM.json and .png): a link at either name is refused in one
    line naming it, before the command's work, also with --overwrite (the rename would replace the link, and an
    earlier check would have followed it)."""
    from types import SimpleNamespace

    from fastweights.cli.common import output_prefix

    out = tmp_path / "out"
    out.mkdir()
    assert output_prefix(SimpleNamespace(out=str(out)), "adapt") == out / "adapt"
    (out / "adapt.png").symlink_to(victim / "precious.txt")
    with pytest.raises(UserError) as e:
        output_prefix(SimpleNamespace(out=str(out), overwrite=True), "adapt")
    assert str(e.value) == f"{out / 'adapt.png'} is a symbolic link; refusing to write the results through it (remove the link)"
    _unchanged(victim)


def test_a_pending_checkpoint_folder_planted_as_a_link_is_refused_by_name(tmp_path, victim):
    """``.ckpt-next`` (a committed save waiting to be swapped in: its files are moved out of it) as a link to another
    folder: refused in one line saying it is a checkpoint being written through the link, nothing moved."""
    from fastweights.checkpoints.format import PENDING, finish_pending

    run = tmp_path / "run"
    run.mkdir()
    (run / PENDING).symlink_to(victim)
    with pytest.raises(UserError) as e:
        finish_pending(run)
    assert str(e.value) == (f"{run / PENDING} is a symbolic link; refusing to write a checkpoint through it (remove "
                            "the link)")
    _unchanged(victim)


def test_the_token_cache_writer_checks_the_links_again_itself(tmp_path, victim, monkeypatch):
    """``cached_stream`` hands the folder the user named to the writer, which checks again just before it writes
    (a link planted after the first check: here the first check stood in for by a no-op). Seed-15 mutation draw:
    the root not handed on."""
    from fastweights.data import streams
    from fastweights.data.tokenizers import ByteTokenizer

    out = tmp_path / "out"
    out.mkdir()
    (out / "data").symlink_to(victim)
    monkeypatch.setattr(streams, "refuse_links", lambda *a: None)  # cached_stream's own check, passed
    with pytest.raises(UserError, match="is a symbolic link; refusing to write the token cache"):
        streams.cached_stream(["some text"], ByteTokenizer(), out / "data", "train", root=out)
    _unchanged(victim)
