"""Result files of the benchmark scripts: the provenance record of :mod:`fastweights.evidence.provenance` bound
to the source checkout this ``fastweights`` runs from, and the JSON output under its benchmarks/results/.

The scripts (``benchmarks/speed``, ``quality``, ``gpu``, ``tools``) import it from the installed package, so
a script runs as ``python benchmarks/KIND/X.py`` from any folder without changing ``sys.path``; the library
code they measure is the same installed ``fastweights`` (an editable install of the checkout).

Every script defines ``probe_specs() -> list[dict]``: the behaviour probes
(:mod:`fastweights.evidence.probes`) of the code it measures. :func:`provenance` runs them and
records their summaries, so that ``report.py`` can tell later whether that code still behaves as
it did when the result was measured.
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


def script_probe_specs() -> list[dict]:
    """The probes the running script declares (its module-level ``probe_specs()``)."""
    main = sys.modules.get("__main__")
    specs = getattr(main, "probe_specs", None)
    if specs is None:
        raise RuntimeError(f"{getattr(main, '__file__', 'the running script')} declares no probe_specs(): every "
                           "benchmark names the behaviour probes of the code it measures (see common.py)")
    return specs()


def provenance(argv: list[str] | None = None, probes: list[dict] | None = None) -> dict:
    """What every result JSON records: command, date, commit, machine, and the summarised probes
    (``probes``, default the running script's ``probe_specs()``). Scripts that write their JSON
    themselves merge this in and write it with :func:`write_json`."""
    from fastweights.evidence.probes import summarised

    specs = script_probe_specs() if probes is None else probes
    return {**_provenance.provenance(REPO, argv), "probes": summarised(specs)}


def write_json(path: Path, record: dict) -> Path:
    """Write a result ``record`` at ``path`` whole or not at all, recording the file it is
    (``result_file``, relative to the repository)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "result_file": repo_relative(path.resolve())}
    atomic_write(path, lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
    print(f"wrote {path}")
    return path


def write_result(name: str, payload: dict, probes: list[dict] | None = None) -> Path:
    """Write ``benchmarks/results/<name>.json``: :func:`provenance` (with ``probes``) and ``payload``."""
    return write_json(RESULTS / f"{name}.json", {**provenance(probes=probes), **payload})
