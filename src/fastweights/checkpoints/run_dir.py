"""Guarding a training run's output directory: checks on ``--out``, a lock held while a run trains
into it, refusing to mix two runs, removing a replaced run's files (and the files derived from its
weights), and putting a directory back as it was when a run fails before it starts.

The lock is the file ``OUT/.lock`` holding the owner's process id, locked with ``flock`` for the
run's lifetime: the kernel releases it when the process ends in any way (``kill -9`` included), so
a lock left by a dead process is recognised as stale and taken over; a live one is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from fastweights.checkpoints.format import MANIFEST, PENDING, TMP_PREFIX, TRAINER_STATE
from fastweights.core.errors import UserError
from fastweights.core.files import atomic_write, open_nofollow, refuse_links

LOCK = ".lock"
# files a training run writes, and files computed from its weights by other commands
RUN_FILES = (MANIFEST, "model.safetensors", "config.json", "tokenizer.json", TRAINER_STATE,
             "metrics.jsonl", "summary.json", "loss_curve.png")
DERIVED_GLOBS = ("grad_stats*.safetensors", "dynamic_tuned.json", "demo.json")
RUN_DIRS = ("tensorboard", PENDING)


def check_out_dir(out: Path) -> None:
    """``out`` must be a writable directory, or creatable as one."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"--out {out} is a file, not a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UserError(f"--out {out} is not writable")
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot create --out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot create --out {out}: {parent} is not writable")


# what a training run writes below --out besides RUN_FILES: the token cache, the staging of a save, the plot
RUN_WRITES = ("data", PENDING, LOCK)


def check_run_links(out: Path, tensorboard: bool = False) -> None:
    """Refuse, before anything is written, a symbolic link at any name a run writes below ``out`` (its files, the
    token cache folder ``data``, ``tensorboard``, the staging of a save): one line naming it. ``out`` itself may
    be a link (the user named it), and a file where a run writes a folder (``data``, ``tensorboard``), which
    ``--overwrite`` would otherwise find only after clearing the old run. The writers check again as they write
    (:mod:`fastweights.core.files`)."""
    out = Path(out)
    if not out.is_dir():
        return
    folders = {"data": "the token cache", **({"tensorboard": "the TensorBoard events"} if tensorboard else {})}
    for name in dict.fromkeys((*RUN_FILES, *RUN_WRITES, *folders)):
        refuse_links(out, out / name, folders.get(name, "the run's files"))
    for name, what in folders.items():
        if (out / name).exists() and not (out / name).is_dir():
            raise UserError(f"{out / name} is a file, not a folder; cannot write {what}")
    data = out / "data"
    if data.is_dir():
        for p in data.iterdir():  # cache files planted as links (read, or replaced by a new encoding)
            refuse_links(out, p, "the token cache")


FOREIGN = "files that are not a fastweights run's"  # describe_run's answer for a folder no --overwrite may clear


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is a run's config.json (a table with model, data and train), not a user's own file of that
    name (a Hugging Face config, notes)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(d, dict) and all(isinstance(d.get(k), dict) for k in ("model", "data", "train"))


def checkpoint_step(out: Path) -> int | None | bool:
    """The step ``out``'s checkpoint manifest records (the committed one, else a save not yet swapped in); None
    when a manifest names no step, False when there is no manifest."""
    for name in (MANIFEST, f"{PENDING}/{MANIFEST}"):
        if (Path(out) / name).is_file():
            try:
                step = json.loads((Path(out) / name).read_text()).get("step")
            except (OSError, ValueError, AttributeError):
                return None
            return step if isinstance(step, int) and not isinstance(step, bool) else None
    return False


def describe_run(out: Path) -> str | None:
    """What run ``out`` holds ("a checkpoint at step 690", ...), None if it holds none, or :data:`FOREIGN` (with
    the file named) when it holds a config.json that is not a run's: train refuses such a folder, --overwrite
    too (issue 52: it deleted a user's config.json and tensorboard/ tree)."""
    out = Path(out)
    if not out.is_dir():
        return None
    if (out / "config.json").is_file() and not is_run_config(out / "config.json"):
        return f"{FOREIGN} (config.json)"
    step = checkpoint_step(out)
    if step is not False:
        return f"a checkpoint at step {step}" if step is not None else "a checkpoint"
    found = [n for n in RUN_FILES if (out / n).is_file()]
    return f"files of a run ({', '.join(found)})" if found else None


def remove_run(out: Path) -> None:
    """``--overwrite``: remove the previous run's files and those derived from its weights (not the data cache)."""
    out = Path(out)
    names = set(RUN_FILES)
    if (out / MANIFEST).is_file():
        try:
            names |= set(json.loads((out / MANIFEST).read_text()).get("files", {}))
        except (OSError, ValueError, AttributeError):
            pass
    for name in names:
        p = out / name
        if "/" not in name and (p.is_file() or p.is_symlink()) and name != LOCK:
            p.unlink()  # a link is removed, never followed
    for pattern in DERIVED_GLOBS:
        for p in out.glob(pattern):
            p.unlink()
    for name in RUN_DIRS:
        if (out / name).is_symlink():
            (out / name).unlink()
        elif name == "tensorboard" and (out / name).is_dir():  # the run's event files only, never a user's files
            for p in (out / name).rglob("events.out.tfevents.*"):
                if p.is_file() and not p.is_symlink():
                    p.unlink()
            for d in sorted((p for p in (out / name).rglob("*") if p.is_dir()), reverse=True) + [out / name]:
                if not any(d.iterdir()):
                    d.rmdir()
        elif (out / name).is_dir():
            shutil.rmtree(out / name)
    for p in out.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def truncate_metrics(path: Path, step: int, validated: bool = True) -> None:
    """Keep the records of steps <= ``step`` (those of the checkpoint resumed from) and drop a torn last line.

    ``validated``: whether the checkpoint's history holds a validation at ``step``. When it does not, a
    validation record at ``step`` was written after that checkpoint (the final validation follows the last
    save), so the resumed run writes it again and the old one is dropped."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link; refusing to rewrite it through the link (remove the link)")
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            if rec["step"] == step and "val_loss" in rec and not validated:
                continue
            keep.append(line)
    atomic_write(path, lambda p: p.write_text("".join(f"{line}\n" for line in keep)))


class RunLock:
    """Exclusive lock on a run directory; ``release()`` (or leaving the ``with``) removes it."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK
        self.fd: int | None = None
        self.stale_owner: int | None = None  # pid of a dead process whose lock was taken over

    def acquire(self) -> "RunLock":
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            return self._acquire()
        except OSError as e:
            raise UserError(f"cannot write to --out {self.out}: {e.strerror or e}") from None

    def _acquire(self) -> "RunLock":
        for _ in range(10):
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, what="the lock file")
            if not _try_lock(fd):
                owner = _read_owner(fd)
                os.close(fd)
                raise UserError(f"{self.out} is in use by another training run (process {owner.get('pid', '?')} "
                                f"on {owner.get('host', '?')}, lock file {self.path}); wait for it to end or "
                                "choose another --out")
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner removed the file between our open and lock: try again
                os.close(fd)
                continue
            prev = _read_owner(fd).get("pid")
            if isinstance(prev, int) and prev != os.getpid():
                self.stale_owner = prev
            data = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            self.fd = fd
            return self
        raise UserError(f"could not lock {self.path}")  # pragma: no cover

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing releases the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock: fall back to the recorded pid being alive
        from fastweights.core.files import pid_alive

        pid = _read_owner(fd).get("pid")
        return not (isinstance(pid, int) and pid != os.getpid() and pid_alive(pid))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_owner(fd: int) -> dict:
    try:
        d = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


class Restore:
    """Remember what ``out`` held; :meth:`undo` removes whatever appeared since (a run that failed to start)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.armed = True  # cleared once the run has started: then the directory holds it
        self.existed = self.out.exists()
        self.before = self._listing() if self.existed else set()
        self.top = self.out  # the outermost directory a run would create
        while not self.top.parent.exists() and self.top.parent != self.top.parent.parent:
            self.top = self.top.parent

    def _listing(self) -> set[str]:
        names = set()
        for p in self.out.iterdir():
            names.add(p.name)
            if p.name == "data" and p.is_dir() and not p.is_symlink():  # never look (or delete) through a link
                names |= {f"data/{q.name}" for q in p.iterdir()}
        return names

    def undo(self) -> None:
        if not self.out.exists():
            if not self.existed and self.top.exists():
                shutil.rmtree(self.top, ignore_errors=True)
            return
        if not self.existed:
            shutil.rmtree(self.top, ignore_errors=True)
            return
        for name in sorted(self._listing() - self.before, key=lambda n: -n.count("/")):
            p = self.out / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
