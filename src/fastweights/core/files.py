"""Writing files so that a reader never sees half of one: atomic replace, fsync, figures.

Ground floor (imports nothing of fastweights): checkpoints, result JSON, per-token losses and every PNG
a command writes go through :func:`atomic_write`, so a kill leaves the old file or the new one.
"""

from __future__ import annotations

import os
from pathlib import Path


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


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)``, fsync, then rename the temporary file onto ``path``.

    The temporary name carries the process id (``.NAME.PID.tmp``) so that a leftover of a killed
    process is recognised and removed (``checkpoint.remove_stale_temporaries``).
    """
    path = Path(path)
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


def save_figure(fig, path: Path, dpi: int = 110, **savefig_kwargs) -> Path:
    """Write a matplotlib figure as PNG atomically, close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=dpi, format="png", **savefig_kwargs))
    plt.close(fig)
    return path
