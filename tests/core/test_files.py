"""core.files on its own: the cache folder, process liveness, modes, links refused below a root, output files
checked, strict JSON, atomic writes and the staging of writers we do not control. The commands' tests reach these
through the command line; here each function's contract, edge by edge (each test names the mutations it caught)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastweights.core import files
from fastweights.core.errors import UserError


def test_the_user_cache_folder_is_in_xdg_cache_home_else_the_homes_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert files.user_cache_dir() == tmp_path / "xdg" / "fastweights"
    for unset in (None, ""):  # unset or empty: the home's .cache
        if unset is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", unset)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert files.user_cache_dir() == tmp_path / "home" / ".cache" / "fastweights"


def test_pid_alive_for_this_process_a_live_child_and_a_finished_one(monkeypatch):
    assert files.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert files.pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not files.pid_alive(child.pid)  # reaped: no such process
    signals = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signals.append((pid, sig)))
    assert files.pid_alive(12345) and signals == [(12345, 0)]  # signal 0: asks, sends nothing

    def denied(pid, sig):
        raise PermissionError

    monkeypatch.setattr(os, "kill", denied)
    assert files.pid_alive(12345)  # another user's process: alive
    monkeypatch.setattr(os, "getpid", lambda: 12345)
    monkeypatch.setattr(os, "kill", lambda pid, sig: pytest.fail("our own pid is not signalled"))
    assert files.pid_alive(12345)


def test_without_procfs_the_umask_is_read_by_setting_it_to_077_and_back(monkeypatch):
    """Where /proc/self/status cannot be read, the umask is set (to 077, so that a file created meanwhile is
    owner-only) and restored at once."""
    def no_procfs(*a, **k):
        raise OSError("no procfs")

    monkeypatch.setattr(files, "open", no_procfs, raising=False)
    old = os.umask(0o027)
    calls, real = [], os.umask
    monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real(m))
    try:
        assert files.current_umask() == 0o027 and calls == [0o077, 0o027]
    finally:
        real(old)


def test_the_umask_is_read_and_left_unchanged(tmp_path):
    old = os.umask(0o027)
    try:
        assert files.current_umask() == 0o027 and files.current_umask() == 0o027
        assert files.umask_mode() == 0o640 and files.umask_mode(folder=True) == 0o750
        f, d = tmp_path / "f", tmp_path / "d"
        f.write_text("")
        d.mkdir()
        os.chmod(f, 0o600)
        os.chmod(d, 0o700)
        assert files.give_umask_mode(f) == f and stat.S_IMODE(f.stat().st_mode) == 0o640
        files.give_umask_mode(d)
        assert stat.S_IMODE(d.stat().st_mode) == 0o750
    finally:
        os.umask(old)


def test_safetensors_are_written_with_their_metadata_and_the_umasks_mode(tmp_path):
    from safetensors import safe_open

    old = os.umask(0o022)
    try:
        path = files.save_safetensors({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"step": "3"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"step": "3"}


def test_links_below_the_root_are_refused_at_every_level(tmp_path, monkeypatch):
    root = tmp_path / "out"
    (root / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "a" / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError) as e:
        files.refuse_links(root, root / "a" / "link" / "deeper" / "f.json", "the summary")
    assert str(e.value) == (f"{root / 'a' / 'link'} is a symbolic link; refusing to write the summary through it "
                            "(remove the link)")
    with pytest.raises(UserError, match="refusing to write it through it"):  # no name given
        files.refuse_links(root, root / "a" / "link")
    assert files.refuse_links(root, root / "b" / "c") == root / "b" / "c"  # missing parts are fine
    for outside in (tmp_path / "x", root / ".." / "x"):
        with pytest.raises(ValueError, match=r"is not below"):
            files.refuse_links(root, outside)
    # a link below a missing folder cannot exist: the walk stops there, and a link further down is not looked at
    real_islink, seen = os.path.islink, []
    monkeypatch.setattr(os.path, "islink", lambda p: seen.append(Path(p)) or real_islink(p))
    files.refuse_links(root, root / "missing" / "x" / "y")
    assert seen == [root / "missing"]


def test_make_dirs_creates_the_root_and_refuses_a_link_or_a_file_on_the_way(tmp_path, monkeypatch):
    root = tmp_path / "deep" / "out"  # the root's own parents are created too
    assert files.make_dirs(root, root / "a" / "b") == root / "a" / "b" and (root / "a" / "b").is_dir()
    files.make_dirs(root, root / "a" / "b")  # again: nothing to do
    (root / "file").write_text("")
    with pytest.raises(UserError) as e:
        files.make_dirs(root, root / "file" / "c", "the figure")
    assert str(e.value) == f"{root / 'file'} is a file, not a folder; cannot write the figure"
    with pytest.raises(UserError, match="is a file, not a folder; cannot write into it$"):
        files.make_dirs(root, root / "file" / "c")
    # a link planted between the check and the mkdir: refused with its name and what was being written
    monkeypatch.setattr(files, "refuse_links", lambda *a: None)
    (root / "late").symlink_to(tmp_path)
    with pytest.raises(UserError) as e:
        files.make_dirs(root, root / "late" / "c", "the log")
    assert str(e.value) == f"{root / 'late'} is a symbolic link; refusing to write the log through it (remove the link)"


def test_open_nofollow_refuses_a_link_at_the_file_or_above_it(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    (root / "log").symlink_to(tmp_path / "victim")
    with pytest.raises(UserError) as e:
        files.open_nofollow(root / "log", os.O_WRONLY | os.O_CREAT, "the log")
    assert str(e.value).startswith(f"{root / 'log'} is a symbolic link; refusing to write the log through")
    (root / "dir").symlink_to(tmp_path)
    with pytest.raises(UserError, match="refusing to write the log through"):
        files.open_nofollow(root / "dir" / "f", os.O_WRONLY | os.O_CREAT, "the log", root=root)
    assert not (tmp_path / "victim").exists() and not (tmp_path / "f").exists()
    with pytest.raises(FileNotFoundError):  # any other error is the OS's
        files.open_nofollow(root / "missing" / "f", os.O_WRONLY | os.O_CREAT)
    old = os.umask(0o022)
    try:
        os.close(files.open_nofollow(root / "new", os.O_WRONLY | os.O_CREAT))
    finally:
        os.umask(old)
    assert stat.S_IMODE((root / "new").stat().st_mode) == 0o644  # 0o666 less the umask, as open() gives


def test_open_nofollow_where_the_system_has_no_O_NOFOLLOW(tmp_path, monkeypatch):
    """Without the flag (Windows) the file is opened with the flags given and nothing more (mutations caught: a
    default of None, 1 (O_WRONLY) or none at all)."""
    (tmp_path / "f").write_text("text")
    monkeypatch.delattr(os, "O_NOFOLLOW", raising=False)
    fd = files.open_nofollow(tmp_path / "f", os.O_RDONLY)
    try:
        assert os.read(fd, 4) == b"text"
    finally:
        os.close(fd)


def test_an_output_file_is_refused_when_an_input_a_folder_or_not_ours(tmp_path):
    ours = lambda p: p.read_text() == "ours"  # noqa: E731
    data, out = tmp_path / "data.txt", tmp_path / "out.txt"
    data.write_text("text")
    with pytest.raises(UserError) as e:
        files.check_output_file(str(data), ours, "--per-token", inputs=[None, str(data)])
    assert str(e.value) == f"--per-token {data} is also an input of this command: it is never overwritten"
    (tmp_path / "alias").symlink_to(data)
    with pytest.raises(UserError, match="is also an input"):  # the same file under another name
        files.check_output_file(tmp_path / "alias", lambda p: True, "--per-token", inputs=[data])
    with pytest.raises(UserError) as e:
        files.check_output_file(tmp_path, ours, "--save")
    assert str(e.value) == f"--save {tmp_path} is a folder; name a file"
    out.write_text("someone else's")
    with pytest.raises(UserError) as e:
        files.check_output_file(out, ours, "--save", inputs=[data])
    assert str(e.value) == (f"--save {out} exists and was not written by this command: choose another path (or "
                            "delete it first)")
    out.write_text("ours")
    assert files.check_output_file(str(out), ours, "--save", inputs=[data, tmp_path / "missing"]) == out
    new = tmp_path / "new.txt"
    assert files.check_output_file(new, lambda p: pytest.fail("asked about a missing file"), "--save",
                                   inputs=[data]) == new
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # a link to nothing is not ours either
    with pytest.raises(UserError, match="was not written by this command"):
        files.check_output_file(tmp_path / "dangling", lambda p: False, "--save")


def test_json_text_writes_non_finite_floats_as_null_at_any_depth():
    obj = {"a": float("nan"), "b": [1.5, float("inf"), (float("-inf"), 2)], "c": {"d": float("nan"), "e": "x"}}
    assert json.loads(files.json_text(obj)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": None, "e": "x"}}
    assert files.json_text({"a": 1}) == '{\n  "a": 1\n}' and files.json_text({"a": 1}, indent=None) == '{"a": 1}'
    for indent in (2, None):  # a non-finite dict key (not a value: not converted) is refused, never written NaN
        with pytest.raises(ValueError):
            files.json_text({float("nan"): 1}, indent=indent)


def test_atomic_write_creates_missing_folders_and_replaces_a_link_at_the_path(tmp_path):
    target = tmp_path / "a" / "b" / "f.txt"
    files.atomic_write(target, lambda p: p.write_text("1"))
    assert target.read_text() == "1" and sorted(os.listdir(target.parent)) == ["f.txt"]
    (tmp_path / "victim").write_text("keep")
    (tmp_path / "a" / "link.txt").symlink_to(tmp_path / "victim")
    files.atomic_write(tmp_path / "a" / "link.txt", lambda p: p.write_text("2"))  # no root: the link is replaced
    assert (tmp_path / "victim").read_text() == "keep" and not (tmp_path / "a" / "link.txt").is_symlink()
    root = tmp_path / "out"
    (root / "x").mkdir(parents=True)
    (root / "x" / "sub").symlink_to(tmp_path)
    with pytest.raises(UserError) as e:
        files.atomic_write(root / "x" / "sub" / "f", lambda p: p.write_text("3"), root=root, what="the summary")
    assert "refusing to write the summary through it" in str(e.value)
    with pytest.raises(UserError) as e:  # a link met while creating the folders names what was written too
        files.atomic_write(root / "x" / "sub" / "n" / "f", lambda p: p.write_text("3"), root=root, what="the plot")
    assert "refusing to write the plot through it" in str(e.value)
    (root / "x" / "file").write_text("")
    with pytest.raises(UserError) as e:  # a file where a folder is needed: named, with what was being written
        files.atomic_write(root / "x" / "file" / "f", lambda p: p.write_text("3"), root=root, what="the plot")
    assert str(e.value) == f"{root / 'x' / 'file'} is a file, not a folder; cannot write the plot"

    def fails(p):
        p.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(target, fails)
    assert target.read_text() == "1" and sorted(os.listdir(target.parent)) == ["f.txt"]  # no temporary left


def test_merge_into_json_cache_keeps_other_entries_and_starts_over_a_broken_file(tmp_path):
    path = tmp_path / "c" / "cache.json"
    files.merge_into_json_cache(path, ("m1", "k1"), [1])
    files.merge_into_json_cache(path, ("m1", "k2"), [2])
    files.merge_into_json_cache(path, ("m2", "k1"), [3])
    assert json.loads(path.read_text()) == {"m1": {"k1": [1], "k2": [2]}, "m2": {"k1": [3]}}
    files.merge_into_json_cache(path, ("m1",), "flat")  # an inner object replaced by a value, and back
    files.merge_into_json_cache(path, ("m1", "k"), 0)
    assert json.loads(path.read_text())["m1"] == {"k": 0}
    for broken in ("{not json", "[1, 2]"):
        path.write_text(broken)
        files.merge_into_json_cache(path, ("m", "k"), 1)
        assert json.loads(path.read_text()) == {"m": {"k": 1}}
    files.merge_into_json_cache(path, ("b", "a"), 1, indent=None)
    assert path.read_text() == '{"b": {"a": 1}, "m": {"k": 1}}'  # keys sorted


def test_save_figure_writes_the_png_asked_for_and_closes_only_that_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 1))
    other = plt.figure(figsize=(1, 1))  # the current figure: left open
    path = files.save_figure(fig, tmp_path / "a" / "f.png", dpi=50, metadata={"Software": "fastweights-test"})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 100 and int.from_bytes(data[20:24], "big") == 50  # 2 x 1 in at 50 dpi
    assert b"fastweights-test" in data  # the savefig keywords are passed on
    assert not plt.fignum_exists(fig.number) and plt.fignum_exists(other.number)
    plt.close(other)
    root = tmp_path / "out"
    root.mkdir()
    (root / "figs").symlink_to(tmp_path)
    with pytest.raises(UserError, match="is a symbolic link"):
        files.save_figure(plt.figure(), root / "figs" / "f.png", root=root)
    assert not (tmp_path / "f.png").exists()


def test_write_into_stages_in_a_hidden_folder_and_refuses_a_link_the_writer_made(tmp_path):
    seen = []

    def write(staging):
        seen.append(staging)
        (staging / "config.json").write_text("{}")

    assert files.write_into(tmp_path / "exp", write) == ["config.json"]
    assert seen[0].parent == tmp_path / "exp" and seen[0].name.startswith(".staging-") and not seen[0].exists()

    def links(staging):
        (staging / "weights").write_text("")
        (staging / "alias").symlink_to(staging / "weights")

    with pytest.raises(RuntimeError, match="writer produced a non-regular file alias"):
        files.write_into(tmp_path / "exp2", links)
    assert os.listdir(tmp_path / "exp2") == []  # nothing moved in, the staging folder removed
    (tmp_path / "exp" / "model.bin").symlink_to(tmp_path / "victim")
    with pytest.raises(UserError) as e:  # a link at a destination: named with the file being written
        files.write_into(tmp_path / "exp", lambda s: (s / "model.bin").write_text("w"))
    assert str(e.value) == (f"{tmp_path / 'exp' / 'model.bin'} is a symbolic link; refusing to write model.bin "
                            "through it (remove the link)")


def test_write_into_names_a_folder_or_file_in_the_way(tmp_path):
    exp = tmp_path / "exp"
    (exp / "model.bin").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        files.write_into(exp, lambda s: (s / "model.bin").write_text("w"))
    assert str(e.value) == f"{exp / 'model.bin'} is a folder; cannot write model.bin there (remove it)"
    with pytest.raises(UserError) as e:
        files.write_into(exp, lambda s: (s / "model.bin").write_text("w"), what="the export")
    assert str(e.value) == f"{exp / 'model.bin'} is a folder; cannot write the export there (remove it)"
    (exp / "sub").write_text("")  # a file where the writer's subfolder goes

    def nested(s):
        (s / "sub").mkdir()
        (s / "sub" / "f").write_text("")

    with pytest.raises(UserError) as e:
        files.write_into(exp, nested, what="the export")
    assert str(e.value) == f"{exp / 'sub'} is a file, not a folder; cannot write the export"
