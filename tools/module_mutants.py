"""Every mutant of one module, run against that module's own unit tests in this process: the weak functions of a
module found at once, between the sampled draws of ``tools/mutants.py`` (which stay the measure).

    python tools/module_mutants.py src/fastweights/ops/linear.py --tests tests/ops/test_linear.py
    python tools/module_mutants.py src/fastweights/loops/schedule.py --tests tests/loops --only minutes --out s.json

What it does: mutmut 3 writes every mutant of the module at HEAD (``tools/mutants.py``'s generation, in a temporary
worktree; the checkout is never touched). Then, for each mutant in turn, the module's source with that mutant's
lines replaced is executed in the module's own namespace (the names other loaded ``fastweights`` modules imported
from it are pointed at the new objects, and put back after), the test modules are dropped from ``sys.modules``, and
``pytest.main(["-x", ...tests])`` runs under an alarm: a failure kills the mutant. No process is started and
nothing is imported again per mutant, where ``tools/mutants.py`` starts a process for each.

What it cannot see, so a survivor here is a lead, not a verdict: tests that run the module in a subprocess (the
command line's own process), tests outside ``--tests``, and code run once at import that guards itself
(``setdefault`` on a registry the first import filled). A survivor matching ``tests/mutants/accepted.toml`` is
reported as accepted with its reason. Exit status 1 when an unaccepted survivor is left, 2 on bad input.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from mutants import (REPO, accepted_entries, accepted_reason, generate_in, git, mutant_lines,  # the script's folder
                     patched, tally)

from fastweights.cli.script_parser import ScriptParser, exit_status_of


def generate(file: str) -> tuple[dict, dict]:
    """Every mutant mutmut writes for ``file`` (``src/...py``) at HEAD: ``tools/mutants.py``'s ``where`` (name ->
    file, line, original line, mutated line) and ``edits`` (name -> the lines it changes)."""
    with tempfile.TemporaryDirectory(prefix="fastweights-module-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        git("worktree", "add", "--detach", str(tree), "HEAD")
        try:
            generate_in(tree, {"source_paths": ["src/"], "only_mutate": [file]})
            edits: dict = {}
            return mutant_lines(tree, [file], edits), edits
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


TIMEOUT_S = 60  # seconds the tests may take on one mutant (--timeout)


class _Alarm(Exception):
    pass


_alarms = []  # the timeouts that fired: raised inside a test, pytest reports the alarm as that test's failure


def _on_alarm(*_):
    _alarms.append(True)
    raise _Alarm()


def _rebind(module, old: dict, new: dict) -> list:
    """Point every loaded fastweights or test-helper module's name that holds one of ``old``'s functions or classes
    at ``new``'s object of the same name; returns what to put back."""
    ids = {id(v): k for k, v in old.items() if isinstance(v, (types.FunctionType, type))}
    undo = []
    for m in list(sys.modules.values()):
        if m is module or not getattr(m, "__name__", "").startswith(("fastweights", "helpers")):
            continue
        for k, v in list(getattr(m, "__dict__", {}).items()):
            name = ids.get(id(v))
            if name is not None and new.get(name, v) is not v:
                undo.append((m.__dict__, k, v))
                m.__dict__[k] = new[name]
    return undo


def _run_tests(tests: list[str], timeout_s: int):
    """pytest's exit code for ``tests`` (stopping at the first failure, output discarded), or "timeout"."""
    import pytest

    roots = {str(REPO / "tests") + os.sep}
    for t in tests:  # test files outside tests/ too
        path = (REPO / t.split("::")[0]).resolve()
        roots.add(str(path if path.is_dir() else path.parent) + os.sep)
    for name in [k for k, m in sys.modules.items() if k != "helpers"
                 and (getattr(m, "__file__", None) or "").startswith(tuple(roots))]:
        del sys.modules[name]  # collected again: each run imports the module as it is now
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    _alarms.clear()
    signal.alarm(timeout_s)
    out, err = sys.stdout, sys.stderr
    try:
        with open(os.devnull, "w") as null:
            sys.stdout = sys.stderr = null
            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", *tests])
        return "timeout" if _alarms else code  # a mutant that never ends is a timeout, not a kill
    except _Alarm:
        return "timeout"
    finally:
        sys.stdout, sys.stderr = out, err
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _untracked() -> set[str]:
    return set(git("ls-files", "--others", "--exclude-standard").splitlines())


def statuses(file: str, names: list[str], where: dict, edits: dict, tests: list[str], timeout_s: int = TIMEOUT_S,
             report=print) -> dict[str, str]:
    """Each mutant's status (killed, survived, timeout, not applied, error) against ``tests``, in this process.
    Raises SystemExit when the tests fail on the module as it is."""
    module = importlib.import_module(file.removeprefix("src/").removesuffix(".py").replace("/", ".")
                                     .removesuffix(".__init__"))
    source = (REPO / file).read_text()
    snapshot = dict(module.__dict__)
    clean = _run_tests(tests, timeout_s)
    if clean == "timeout":
        raise SystemExit(f"error: {', '.join(tests)} take longer than --timeout {timeout_s} s on {file} as it is")
    if clean != 0:
        raise SystemExit(f"error: {', '.join(tests)} fail on {file} as it is: nothing to measure")
    before = _untracked()
    entries = accepted_entries()
    result = {}
    for name in names:
        text = patched(source, edits[name]) if edits.get(name) else None
        status, undo = "not applied", []
        if text is not None:
            module.__dict__.clear()
            module.__dict__.update(snapshot)
            try:
                exec(compile(text, str(REPO / file), "exec"), module.__dict__)
                undo = _rebind(module, snapshot, module.__dict__)
                code = _run_tests(tests, timeout_s)
                status = {0: "survived", 1: "killed", 5: "no tests"}.get(code, code if code == "timeout" else "error")
            except Exception:  # the mutant breaks the module's own execution: a test importing it would fail
                status = "killed"
            for namespace, k, v in undo:
                namespace[k] = v
            module.__dict__.clear()
            module.__dict__.update(snapshot)
        for stray in sorted(_untracked() - before):  # a mutant's write into the checkout (a path made None): removed
            (REPO / stray).unlink(missing_ok=True)
            report(f"removed {stray}, which the mutant below wrote into the checkout")
        result[name] = status
        shown = "accepted" if status == "survived" and accepted_reason(entries, name, where[name][3]) else status
        report(f"{shown:>10}  {file}:{where[name][1]}  {where[name][3]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="the module, src/fastweights/....py")
    ap.add_argument("--tests", required=True, help="test files or folders, comma-separated (its unit tests)")
    ap.add_argument("--only", nargs="*", default=[], help="only mutants whose name holds one of these (a function)")
    ap.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds the tests may take on one mutant")
    ap.add_argument("--out", help="write the JSON here (default: the summary is printed only)")
    args = ap.parse_args(argv)
    if not (args.file.startswith("src/fastweights/") and args.file.endswith(".py") and (REPO / args.file).is_file()):
        ap.error(f"{args.file}: not a module of the package (src/fastweights/....py)")
    tests = args.tests.split(",")
    if missing := [t for t in tests if not (REPO / t.split("::")[0]).exists()]:
        ap.error(f"--tests {missing[0]}: no such test file or folder")
    out = Path(args.out).resolve() if args.out else None  # the user's folder, before the chdir below
    os.chdir(REPO)
    started = time.time()
    where, edits = generate(args.file)
    names = sorted((n for n in where if not args.only or any(o in n for o in args.only)), key=lambda n: where[n][1])
    print(f"{len(names)} mutants of {args.file}; tests: {', '.join(tests)}", flush=True)
    not_killed, counts = tally(names, where, statuses(args.file, names, where, edits, tests, args.timeout))
    print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" of {len(names)} mutants")
    if out:
        from fastweights.evidence.provenance import provenance
        from fastweights.evidence.result_files import write_json

        write_json(out, {**provenance(REPO, sys.argv), "file": args.file, "tests": tests, "mutants": len(names),
                         "counts": counts, "elapsed_s": time.time() - started, "not_killed": not_killed})
    return 1 if counts.get("survived") else 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
