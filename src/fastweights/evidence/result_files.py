"""Result files of the benchmark scripts: the provenance record of :mod:`fastweights.evidence.provenance` bound
to the source checkout this ``fastweights`` runs from, and the JSON output under its benchmarks/results/.

The scripts (``benchmarks/speed``, ``quality``, ``gpu``, ``tools``) import it from the installed package, so
a script runs as ``python benchmarks/KIND/X.py`` from any folder without changing ``sys.path``; the library
code they measure is the same installed ``fastweights`` (an editable install of the checkout).

A result is written with its provenance only. Every script also defines ``probe_specs(probes)``: the
behaviour probes of the code it measures, which the repository's tools (``tools/evidence.py``,
run by ``report.py``) summarise into the result after it was written, so that ``report.py --check`` can tell
later whether that code still behaves as it did; the package never runs a probe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fastweights.evidence.provenance as _provenance
from fastweights.core.files import atomic_write

# The source checkout (ROOT/src/fastweights imported as an editable install or through PYTHONPATH=ROOT/src):
# results are files of the repository. An installed copy has none, and its scripts are not shipped.
REPO = _provenance.package_checkout() or Path.cwd()
RESULTS = REPO / "benchmarks" / "results"


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository root when it lies inside it (else unchanged)."""
    return _provenance.repo_relative(path, REPO)


def command_line(argv: list[str] | None = None, program: str | None = None) -> str:
    """The command that ran this script, paths inside the repository relative to its root."""
    return _provenance.command_line(REPO, argv, program)


def command_line_without(argv: list[str], flag: str) -> str:
    """:func:`command_line` of this script with ``argv`` less the option ``flag`` and its value (a device run's
    output folder: the recorded command is the one that writes the stored file)."""
    words, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w == flag:
            skip = True
        elif not w.startswith(flag + "="):
            words.append(w)
    return command_line([sys.argv[0], *words])


def git_state() -> dict:
    """The commit this repository is at and the tracked paths that differ from it."""
    return _provenance.git_state(REPO)


def provenance(argv: list[str] | None = None) -> dict:
    """What every result JSON records: command, date, commit (with the hash of the code it ran) and machine.
    Scripts that write their JSON themselves merge this in and write it with :func:`write_json`."""
    return _provenance.provenance(REPO, argv)


def write_json(path: Path, record: dict) -> Path:
    """Write a result ``record`` at ``path`` whole or not at all, recording the file it is
    (``result_file``, relative to the repository)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "result_file": repo_relative(path.resolve())}
    atomic_write(path, lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
    print(f"wrote {path}")
    return path


def write_result(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json``: :func:`provenance` and ``payload``."""
    return write_json(RESULTS / f"{name}.json", {**provenance(), **payload})
