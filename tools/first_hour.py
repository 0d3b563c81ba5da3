"""How long the README's two commands take from a fresh clone, on an idle machine and on a busy one (issue 49): the
numbers the README's times cite.

    python tools/first_hour.py                      # make test and make demo, idle and busy
    python tools/first_hour.py --targets test --busy 1

Each run clones this checkout's HEAD into a new folder under ``--work`` (``git clone``, as ``.ci/run`` is run), then
times ``make TARGET`` there (wall seconds, the whole command: creating ``.venv``, installing with pip's download
cache as this machine has it, then the tests or the demo). "Busy" runs ``--busy`` processes that spin on a core
each for the whole command, the way another job shares a user's machine; the load average is recorded before and
after. Runs go one at a time (two clones installing at once race on pip's cache). A failed command is recorded
with its exit status and the last lines of its output, and the script exits 1.

Writes benchmarks/results/first_hour.json.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.errors import UserError
from fastweights.evidence.result_files import write_result

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("test", "demo")
TAIL_LINES = 20


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of what the times measure (see tools/probes.py): the Makefile's set-up and
    its two commands (a worker per core for the tests; the demo's command), whose change makes the times stale."""
    return [probes.probe("source", path="Makefile", texts=["pip install -q torch==2.13.0", "pytest -n auto",
                                                          "fastweights demo --out runs/demo"])]


def spin() -> None:
    """A busy process: one core at 100% until terminated."""
    x = 0
    while True:
        x += 1


def run_make(target: str, work: Path, busy: int) -> dict:
    """``make TARGET`` in a fresh clone of HEAD under ``work`` with ``busy`` spinning processes beside it."""
    clone = Path(tempfile.mkdtemp(prefix=f"first-hour-{target}-", dir=work))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()  # what was timed (the result file's provenance: the package's)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    load_before = os.getloadavg()[0]
    start = time.time()
    try:
        proc = subprocess.run(["make", target], cwd=clone, capture_output=True, text=True)
    finally:
        wall = time.time() - start
        load_after = os.getloadavg()[0]
        alive = sum(p.is_alive() for p in spinners)  # busy for the whole command
        for p in spinners:
            p.terminate()
            p.join()
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-TAIL_LINES:]
    shutil.rmtree(clone, ignore_errors=True)
    return {"target": target, "commit": commit, "busy_processes": busy, "busy_at_the_end": alive, "wall_s": round(wall, 1), "minutes": round(wall / 60, 1),
            "exit_status": proc.returncode, "load_1m_before": round(load_before, 2),
            "load_1m_after": round(load_after, 2), "output_tail": tail if proc.returncode else tail[-3:]}


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="make targets to time, comma-separated")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                    help="spinning processes beside the busy runs, by default one per core (0: idle only)")
    ap.add_argument("--work", default=tempfile.gettempdir(), help="folder the fresh clones go in (removed after)")
    a = ap.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    if not targets or any(t not in TARGETS for t in targets):
        raise UserError(f"--targets: choose from {', '.join(TARGETS)}, got {a.targets!r}")
    if a.busy < 0:
        raise UserError(f"--busy must be >= 0, got {a.busy}")
    work = Path(a.work)
    if not work.is_dir():
        raise UserError(f"--work {work}: not a folder")
    runs = []
    for target in targets:
        for busy in sorted({0, a.busy}):
            runs.append(run_make(target, work, busy))
            r = runs[-1]
            print(f"make {target}, {busy} busy: {r['minutes']} min (exit {r['exit_status']}, load "
                  f"{r['load_1m_before']} -> {r['load_1m_after']})", flush=True)
    headline = [{"what": f"make {r['target']} from a fresh clone, {'idle' if not r['busy_processes'] else 'busy'} "
                         f"({os.cpu_count()} cores, {r['busy_processes']} spinning processes)",
                 "value": r["minutes"], "unit": "min", "target": ""} for r in runs]
    write_result("first_hour", {"cores": os.cpu_count(), "runs": runs, "headline": headline})
    return 0 if all(r["exit_status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
