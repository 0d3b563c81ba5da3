"""Writing files so that a reader never sees half of one (atomic replace, fsync, figures), and never
through a symbolic link below the folder the user named.

Ground floor (imports only :mod:`fastweights.core.errors`): checkpoints, result JSON, per-token losses and
every PNG a command writes go through :func:`atomic_write`, so a kill leaves the old file or the new one.

Links. A run directory (``--out``), an export directory or a cache may come from elsewhere and hold
symbolic links planted below it (``out/data -> /somewhere``, ``exp/config.json -> victim.json``). Every
write below such a root goes through one of

- :func:`refuse_links` (``root``, ``path``): a link at any level of ``path`` below ``root`` is refused in one
  line (:class:`~fastweights.core.errors.UserError`); ``root`` itself may be a link, the user named it;
- :func:`make_dirs` (``root``, ``path``): ``mkdir -p`` that refuses a link at every level below ``root``;
- :func:`atomic_write` (``path``, ``write``, ``root=``): the same check, then write and rename;
- :func:`open_nofollow` (``path``, ``flags``, ``root=``): ``os.open`` with ``O_NOFOLLOW`` (an append log);
- :func:`write_into` (``directory``, ``write``): files written by a library we do not control
  (``save_pretrained``) go into a fresh staging folder, then are renamed into ``directory``, refused before any
  is moved if one of their names there is a link.

The checks are made just before each write; they guard against links planted before a command starts, not
against a process racing the command inside a directory it shares.

Modes. Every file and folder a command leaves behind has the mode the user's umask gives (0644 and 0755 under
umask 022, 0600 and 0700 under 077), as files ``open()`` and ``mkdir`` create; only the run's lock and the
temporary names of a save in progress are excepted. Writers that create narrower modes are widened (never
beyond the umask) by :func:`give_umask_mode`: safetensors' ``save_file`` writes 0600, so every safetensors
file is written through :func:`save_safetensors`, and :func:`write_into` gives every file it moves in (what
``save_pretrained`` wrote, weights included) and its ``mkdtemp`` staging folder the umask's mode.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from fastweights.core.errors import UserError


def user_cache_dir() -> Path:
    """The library's folder in the user's cache (``fastweights`` in ``$XDG_CACHE_HOME``, else in the home's ``.cache``):
    what is measured or built once per machine (compiled kernels, kernel choices); created by whoever writes."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastweights"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (ours always does; another user's counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def current_umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux: ``/proc/self/status``);
    elsewhere set and restored at once (to 077 meanwhile, so a file another thread creates in that instant is
    owner-only, never wider)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):  # no procfs (not Linux): set and restore below
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def umask_mode(folder: bool = False) -> int:
    """The mode ``open()`` gives a new file (``0o666 & ~umask``), or ``mkdir`` a new folder (``0o777 & ~umask``)."""
    return (0o777 if folder else 0o666) & ~current_umask()


def give_umask_mode(path: Path) -> Path:
    """Set ``path`` (a file or folder we just created, not a link) to the mode the user's umask gives it
    (:func:`umask_mode`), for writers that create narrower ones (safetensors' 0600, ``mkdtemp``'s 0700)."""
    path = Path(path)
    if not os.path.islink(path):
        os.chmod(path, umask_mode(path.is_dir()))
    return path


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> Path:
    """``safetensors.torch.save_file`` with the file's mode the umask's (``save_file`` alone writes 0600);
    every safetensors file the library writes goes through here."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    return give_umask_mode(path)


def _link_refused(path: Path, what: str = "") -> UserError:
    return UserError(f"{path} is a symbolic link; refusing to write {what or 'it'} through it (remove the link)")


def refuse_links(root: Path, path: Path, what: str = "") -> Path:
    """Refuse (one-line :class:`UserError`) a symbolic link at ``path`` or at any folder between ``root`` and it;
    returns ``path``. ``root`` itself is not checked (the user named it: a linked ``--out`` is theirs to make).
    ``path`` must lie lexically below ``root`` (no ``..``); parts that do not exist yet are fine."""
    root, path = Path(root), Path(path)
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise ValueError(f"{path} is not below {root}") from None
    if ".." in rel.parts:
        raise ValueError(f"{path} is not below {root}")
    cur = root
    for part in rel.parts:
        cur = cur / part
        if os.path.islink(cur):
            raise _link_refused(cur, what)
        if not os.path.lexists(cur):
            break  # nothing below a missing folder exists either
    return path


def make_dirs(root: Path, path: Path, what: str = "") -> Path:
    """``mkdir -p path`` below ``root``, refusing a symbolic link at every level below ``root`` (``root`` itself
    is created if missing); returns ``path``."""
    root, path = Path(root), Path(path)
    refuse_links(root, path, what)
    root.mkdir(parents=True, exist_ok=True)
    cur = root
    for part in path.relative_to(root).parts:
        cur = cur / part
        try:
            os.mkdir(cur)
        except FileExistsError:
            if os.path.islink(cur):  # planted between the check and the mkdir
                raise _link_refused(cur, what) from None
            if not cur.is_dir():
                raise UserError(f"{cur} is a file, not a folder; cannot write {what or 'into it'}") from None
    return path


def open_nofollow(path: Path, flags: int, what: str = "", root: Path | None = None) -> int:
    """``os.open`` that refuses a symlink at ``path`` (``O_NOFOLLOW``) and, given ``root``, at every folder
    between ``root`` and it."""
    if root is not None:
        refuse_links(root, path, what)
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)  # less the umask, as open() does
    except OSError:
        if os.path.islink(path):
            raise _link_refused(Path(path), what) from None
        raise


def check_output_file(path: str | Path, ours, what: str, inputs=()) -> Path:
    """An output file a user named (``--save``, ``--per-token``): refused in one line when it is one of the command's
    ``inputs`` (the same file under any name), a folder, or an existing file that ``ours(path)`` does not recognise
    as one this command writes (issue 52: ``dynamic stats --save CK/model.safetensors`` destroyed the checkpoint's
    weights, ``--per-token T.txt`` the text it scored). A file of its own kind is replaced, as a re-run should."""
    path = Path(path)
    for given in inputs:
        if given is not None and path.exists() and Path(given).exists() and os.path.samefile(path, given):
            raise UserError(f"{what} {path} is also an input of this command: it is never overwritten")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; name a file")
    if (path.exists() or path.is_symlink()) and not ours(path):
        raise UserError(f"{what} {path} exists and was not written by this command: choose another path (or delete "
                        "it first)")
    return path


def json_text(obj, indent: int | None = 2) -> str:
    """``obj`` as strict JSON (RFC 8259 has no NaN or Infinity, which json.dumps writes and other readers refuse):
    a non-finite float becomes null."""
    import json
    import math

    def finite(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return o

    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def atomic_write(path: Path, write, root: Path | None = None, what: str = "") -> None:
    """Call ``write(tmp_path)``, fsync, then rename the temporary file onto ``path``.

    The temporary name carries the process id (``.NAME.PID.tmp``) so that a leftover of a killed
    process is recognised and removed (``checkpoint.remove_stale_temporaries``). Given ``root`` (the folder
    the user named), a symbolic link at ``path`` or at any folder between ``root`` and it is refused before
    anything is written, and missing folders are created refusing links (:func:`make_dirs`); without it a
    link at ``path`` itself is replaced, never written through.
    """
    path = Path(path)
    if root is not None:
        refuse_links(root, path, what)
        make_dirs(root, path.parent, what)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if os.path.islink(tmp):  # never write through a link planted at the temporary name
            os.unlink(tmp)
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def merge_into_json_cache(path: Path, keys: tuple[str, ...], value, indent: int = 1) -> None:
    """Set ``data[keys[0]]...[keys[-1]] = value`` in the JSON object at ``path`` (read, set, atomic replace): a
    missing, unreadable or non-object file starts empty, and a concurrent writer loses at most its newest entry.
    The per-machine caches of measured choices (``ops.linear``'s kernels, ``ops.fla_selfcheck``'s verdicts) keep
    their entries so. OSError when the folder cannot be written (the caller then keeps its choice in memory)."""
    import json

    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    node = data
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=indent, sort_keys=True)))


def save_figure(fig, path: Path, dpi: int = 110, root: Path | None = None, **savefig_kwargs) -> Path:
    """Write a matplotlib figure as PNG atomically (refusing links below ``root``, see :func:`atomic_write`),
    close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        atomic_write(path, lambda p: fig.savefig(p, dpi=dpi, format="png", **savefig_kwargs), root=root)
    finally:
        plt.close(fig)
    return path


def write_into(directory: Path, write, what: str = "") -> list[str]:
    """Let ``write(staging)`` fill a fresh folder, then rename each file it wrote into ``directory``.

    For writers we do not control (``save_pretrained`` opens its files by name and follows links): the staging
    folder is new (``mkdtemp`` inside ``directory``), so nothing planted is written through; before any file is
    moved, each destination name in ``directory`` is checked and a symbolic link (or a folder) there is refused
    in one line, leaving ``directory`` as it was. Folders below ``directory`` are refused the same way. Returns
    the names moved, each with the mode the user's umask gives (:func:`give_umask_mode`). ``directory`` (the user
    named it) may itself be a link and is created if missing.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = give_umask_mode(Path(tempfile.mkdtemp(prefix=".staging-", dir=directory)))  # mkdtemp makes 0700
    try:
        write(staging)
        files = sorted(p.relative_to(staging) for p in staging.rglob("*") if not p.is_dir())
        for rel in files:
            src = staging / rel
            if src.is_symlink() or not src.is_file():
                raise RuntimeError(f"writer produced a non-regular file {rel}")
            give_umask_mode(src)  # save_pretrained's weights are 0600 (safetensors): moved in with the umask's mode
            dst = directory / rel
            refuse_links(directory, dst, what or str(rel))
            if dst.is_dir():
                raise UserError(f"{dst} is a folder; cannot write {what or rel} there (remove it)")
        for rel in files:
            make_dirs(directory, (directory / rel).parent, what)
            os.replace(staging / rel, directory / rel)
        fsync_dir(directory)
        return [str(r) for r in files]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
