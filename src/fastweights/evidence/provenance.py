"""What a result file records about how it was made: the command (with paths inside the repository
made relative to its root, so a reader can run it from any clone), the date, the git commit with the
paths that differed from it and a hash of the code it ran, and the machine with its load.

The benchmark scripts record this through ``src/fastweights/evidence/result_files.py`` (``root`` = the repository the
script lives in), the ``fastweights`` commands through :func:`write_cli_result`. Neither runs behaviour probes:
the repository's tools (``tools/evidence.py``) summarise a stored result's probes after it was
written, while ``code`` still matches, and ``tools/report.py --check`` re-runs them to tell whether
the code it measured still behaves the same.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch


def repo_relative(path: str | Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies inside it (else unchanged), so recorded paths mean the
    same in every clone."""
    p = Path(path)
    if p.is_absolute() and p.resolve().is_relative_to(root):
        return p.resolve().relative_to(root).as_posix()
    return str(path)


def command_line(root: Path, argv: list[str] | None = None, program: str | None = None) -> str:
    """The command that ran this process: ``program`` (default: the Python executable's name) then
    ``argv`` (default ``sys.argv``), with every absolute path inside ``root``, and ``--flag=PATH``, made
    relative to it (the script itself too, wherever it was started from)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).is_file():
        argv[0] = repo_relative(Path(argv[0]).resolve(), root)
    words = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
        words.append(f"{flag}{eq}{repo_relative(value, root)}" if value.startswith("/") else a)
    return " ".join(shlex.quote(w) for w in [program or Path(sys.executable).name, *words])


def blas() -> str:
    """The BLAS torch's CPU matrix products run on, as its build reports it (``mkl``, ``open``, ...), with
    the library's version line where the build prints one."""
    config = torch.__config__.show()
    found = re.search(r"BLAS_INFO=([^,\s]+)", config)
    name = found.group(1) if found else "unknown"
    version = next((line.strip(" -") for line in config.splitlines() if "Math Kernel Library" in line or "OpenBLAS" in line), "")
    return f"{name} ({version})" if version else name


def machine() -> dict:
    """Python and torch versions, the CPU, the kernels torch chose for it (``cpu_capability``: DEFAULT, AVX2,
    AVX512; ``ATEN_CPU_CAPABILITY`` overrides it), the BLAS, its cores, torch's threads, the 1-minute load and
    the GPU: what a number measured on another machine may differ by."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# The code a result's numbers can depend on: what ``code`` in :func:`git_state` hashes (results, pages and tests
# are not code a measurement runs)
CODE_PATHS = ("src", "benchmarks", "tools", "configs", "pyproject.toml", ":(exclude)benchmarks/results")


def _code_hash(commit: str, diff: bytes = b""):
    return hashlib.sha256(commit.encode() + diff)


def clean_code(commit: str) -> str:
    """The ``code`` :func:`git_state` records for a tree at ``commit`` with no differences from it."""
    return _code_hash(commit).hexdigest()[:16]


def git_state(root: Path) -> dict:
    """The commit of the checkout at ``root``, whether the tree differed from it (``dirty``, with the changed
    tracked paths, at most 20), and ``code``: a hash of the commit and every difference from it in
    :data:`CODE_PATHS`, untracked files included, so that two records with the same ``code`` ran the same
    code. ``{"commit": None}`` outside a git checkout."""

    def git(*args, text=True):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=text, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
        code = _code_hash(commit, git("diff", "HEAD", "--binary", "--", *CODE_PATHS, text=False))
        for name in sorted(git("ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS).splitlines()):
            code.update(name.encode() + b"\0" + (root / name).read_bytes())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed), "dirty_paths": changed[:20], "code": code.hexdigest()[:16]}


def provenance(root: Path, argv: list[str] | None = None, program: str | None = None, git: dict | None = None) -> dict:
    """The command, the date, the commit (and dirty flag) of the checkout at ``root`` (or ``git`` as
    given), and the machine."""
    return {"command": command_line(root, argv, program), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git": git_state(root) if git is None else git, "machine": machine()}


def package_checkout() -> Path | None:
    """The source checkout this ``fastweights`` was imported from (``ROOT/src/fastweights``: an editable
    install or ``PYTHONPATH=ROOT/src``), or None for an installed copy (whose site-packages may lie inside
    some other repository, so git is not asked there)."""
    import fastweights

    pkg = Path(fastweights.__file__).resolve().parent
    root = pkg.parent.parent
    return root if pkg.parent.name == "src" and (root / ".git").exists() else None


def cli_provenance(argv: list[str] | None = None) -> dict:
    """What a result file written by the ``fastweights`` command records: the command as typed
    (``fastweights`` then ``argv``, default ``sys.argv[1:]``, paths inside the checkout relative to it),
    the date, the commit of the checkout the package runs from (``{"commit": None}`` for an installed
    copy, with ``version``), and the machine."""
    from importlib.metadata import PackageNotFoundError, version

    argv = list(sys.argv[1:] if argv is None else argv)
    root = package_checkout()
    if root is not None:
        return provenance(root, argv, program="fastweights")
    try:
        installed = version("fastweights")
    except PackageNotFoundError:
        installed = None
    return provenance(Path.cwd(), argv, program="fastweights", git={"commit": None, "dirty": None, "version": installed})


def write_cli_result(path: Path, payload: dict, argv: list[str] | None) -> None:
    """Write ``payload`` as JSON at ``path`` after :func:`cli_provenance` (``argv``: the command's words,
    as ``fastweights.cli.main`` keeps them in ``args.argv``) and the file's own path (``result_file``),
    whole or not at all."""
    import json

    from fastweights.core.files import atomic_write

    record = {**cli_provenance(argv), "result_file": Path(path).as_posix(), **payload}
    atomic_write(Path(path), lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
