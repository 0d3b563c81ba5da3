"""Is a stored result still evidence about the code as it is? Checked by behaviour, not by file lists.

Every result JSON in benchmarks/results/ (and one folder down) records
  * its provenance: ``command``, ``date``, ``git`` (commit, dirty paths, ``code``: a hash of the code it ran),
    ``machine`` (written by the package: ``fastweights.evidence``);
  * ``result_file``: the file it was written as (a copy under another name is caught);
  * ``probes``: the behaviour probes of the code it measured, each a spec and the summary of its
    outputs (``probes.py`` beside this file). The package writes a result without them; :func:`stamp`
    adds them afterwards (``report.py`` does, for every result that has none), while the checkout's code is
    still the code that wrote it (the same ``git.code``): from the script's ``probe_specs(probes)`` for a
    benchmark, from the checkpoints and settings a ``fastweights`` command recorded for its result.

:func:`staleness` re-runs a result's probes: a summary that moved by more than the tolerance
(:data:`summaries.RELATIVE_TOLERANCE` of an output's norm) means the code the
result measured no longer behaves as it did, so the result is stale, whatever file the change was made in
(an operator reached only through an import included), and a change that leaves behaviour alone (a
rename, a moved function, a comment) leaves it current. Stale results are marked in the generated
tables and listed with the command that re-runs them in benchmarks/results/TO_RERUN.md; they are not
an error: re-running is a decision about CPU-hours, the marks make sure nobody reads them as current.

:func:`problems` lists what cannot be waived: a result without its provenance, its file record, or
its probes.

    python tools/evidence.py summarise SCRIPT FUNCTION [ARG ...]

prints the summarised probes SCRIPT's ``FUNCTION(probes, *ARGS)`` declares, as JSON: a benchmark that records
probes per part of a result as it measures it (the leaderboard's rows) asks for them so, without importing them.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RERUN_PAGE = RESULTS / "TO_RERUN.md"


def result_paths(results: Path = RESULTS) -> list[Path]:
    """Every result JSON: in ``results`` or one folder down (``fastweights inspect compare`` writes DIR/analysis.json)."""
    return sorted(results.glob("*.json")) + sorted(results.glob("*/*.json"))


def result_key(path: Path, results: Path = RESULTS) -> str:
    """A result's name: its path under ``results`` without ``.json`` (``fwl_quality``, ``fwl_analysis/analysis``)."""
    try:
        return path.resolve().relative_to(results.resolve()).with_suffix("").as_posix()
    except ValueError:
        return path.stem


@lru_cache(maxsize=None)
def _summary(spec_json: str) -> dict[str, str] | str:
    from probes import run_probe

    try:
        return run_probe(json.loads(spec_json))
    except Exception as e:  # a probe that no longer runs (a removed option, a renamed preset) is a change
        return f"error: {type(e).__name__}: {e}"


def changed_probes(rec: dict) -> list[str]:
    """The probes of ``rec`` whose summary moved beyond the tolerance, as ``kind label: what moved``."""
    from summaries import differences

    changed = []
    for p in rec.get("probes") or []:
        spec = {"kind": p.get("kind"), "args": p.get("args", {})}
        now = _summary(json.dumps(spec, sort_keys=True))
        moved = [now] if isinstance(now, str) else differences(p.get("summary") or {}, now)
        if moved:
            args = p.get("args", {})
            label = args.get("name") or args.get("op") or args.get("rule") or args.get("path") or ""
            more = f" (and {len(moved) - 1} more outputs)" if len(moved) > 1 else ""
            changed.append(f"{p.get('kind')}{f' {label}' if label else ''}: {moved[0]}{more}")
    return changed


def staleness(rec: dict) -> str | None:
    """Why ``rec`` no longer measures the current code (its probes changed), or None."""
    changed = changed_probes(rec)
    if not changed:
        return None
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return f"behaviour changed: {changed[0]}{more}"


def status(path: Path) -> str:
    """The mark a table shows for a result: '' (current) or 'stale: code changed after it'."""
    return "stale: code changed after it" if staleness(json.loads(path.read_text())) else ""


def problems(results: Path = RESULTS) -> list[str]:
    """What a result lacks that cannot be waived (empty when every result has it all)."""
    out = []
    for path in result_paths(results):
        rec = json.loads(path.read_text())
        name = f"{result_key(path, results)}.json"
        if not rec.get("command"):
            out.append(f"{name}: no command recorded")
        if not (rec.get("git") or {}).get("commit"):
            out.append(f"{name}: no git commit recorded")
        recorded = rec.get("result_file")
        if not recorded:
            out.append(f"{name}: no result_file recorded (write it with fastweights.evidence.result_files.write_json / write_result)")
        elif not ("/" + Path(recorded).as_posix()).endswith("/" + name):
            out.append(f"{name}: written as {recorded}, stored as {name}: a copy, not the file its command wrote")
        specs = rec.get("probes")
        if not specs:
            out.append(f"{name}: no behaviour probes recorded (python tools/report.py summarises them)")
        elif any(not {"kind", "args", "summary"} <= set(p) for p in specs):
            out.append(f"{name}: a probe without kind, args or summary")
    return out


def rerun_page(results: Path = RESULTS) -> str:
    """The generated list of stale results, each with why and the command that re-runs it."""
    lines = ["# Results to re-run", "",
             "Generated by `python tools/report.py` (do not edit): results whose behaviour probes changed,",
             "so the code they measured no longer behaves as it did (tools/evidence.py says how this is",
             "decided). Each is marked stale in the tables until its command is run again.", ""]
    stale = []
    for path in result_paths(results):
        rec = json.loads(path.read_text())
        why = staleness(rec)
        if why:
            stale.append(f"- `{result_key(path, results)}`: {why}\n  re-run: `{rec.get('command')}`")
    lines += stale or ["None: every result measured the code as it is."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- stamping a new result's probes

STREAM_PROBED = ("carry", "reset", "memory", "windows")  # ``eval --stream`` modes a probe re-runs (frozen: as carry)


def script_of(command: str | None) -> Path | None:
    """The script a recorded command ran (``python benchmarks/KIND/X.py ...`` or ``python tools/X.py ...``), or
    None."""
    words = shlex.split(command or "")
    if len(words) > 1 and words[1].startswith(("benchmarks/", "tools/")) and words[1].endswith(".py"):
        return ROOT / words[1]
    return None


# Run with a benchmark script's folder as the working directory, which a ``python -c`` process imports from first
# (as ``python benchmarks/KIND/X.py`` does its folder: the script's sibling imports), and this folder on PYTHONPATH
_DECLARE = ("import importlib, json, sys, probes\n"
            "print(json.dumps(getattr(importlib.import_module(sys.argv[1]), sys.argv[2])(probes, *sys.argv[3:])))")


def script_probe_specs(script: Path, function: str = "probe_specs", *args: str) -> list[dict]:
    """The probe specs a benchmark script declares (its ``FUNCTION(probes, *ARGS)``, this folder's probes.py passed
    in), read in a process of its own that imports the script as running it would."""
    import os
    import subprocess

    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # from here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), *inherited])}
    done = subprocess.run([sys.executable, "-c", _DECLARE, script.stem, function, *args], cwd=script.parent, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"{script.name}: {function}() failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def command_probe_specs(rec: dict) -> list[dict]:
    """The probes of a result a ``fastweights`` command wrote (``continual``, ``eval --stream``, ``inspect compare``,
    ``inspect gates``, ``task assoc``, ``task niah``), from what it recorded: the checkpoints it measured (their
    ``config.json``), the dynamic-evaluation rule, the stream modes, the task models."""
    import probes
    from fastweights.models.loading import read_run_config

    def model(checkpoint: str) -> dict:
        return dataclasses.asdict(read_run_config(ROOT / checkpoint).model)

    words = shlex.split(rec["command"])[1:]
    command = " ".join(words[:2]) if words[:1] in (["task"], ["inspect"]) else words[0] if words else ""
    rule = (rec.get("dynamic") or {}).get("rule")
    if command == "continual":
        return probes.checkpoint_probes(model(rec["checkpoint"]), dynamic_rule=rule)
    if command in ("inspect gates", "task niah"):
        return probes.checkpoint_probes(model(rec["checkpoint"])) + (
            [probes.probe("task", name="niah")] if command == "task niah" else [])
    if command == "inspect compare":
        return [s for d in (rec["base"], rec["model"]) for s in probes.checkpoint_probes(model(d))]
    if command == "eval" and "--stream" in words:
        modes = tuple(m for m in rec["modes"] if m in STREAM_PROBED)
        rules = {}  # checkpoint -> its dynamic rule, in the order they ran
        for r in rec["runs"]:  # a frozen run records no rule
            rules[r["checkpoint"]] = rules.get(r["checkpoint"]) or (r.get("dynamic") or {}).get("rule")
        return [s for c, rl in rules.items() for s in probes.checkpoint_probes(model(c), modes, rl)]
    if command == "task assoc":
        keys = ("rule", "feature_map", "nu", "n_features")
        models = list(dict.fromkeys(json.dumps({"setting": r["setting"], **{k: r[k] for k in keys}}, sort_keys=True)
                                    for r in rec["results"]))
        return [probes.probe("assoc_model", **json.loads(m)) for m in models] + [probes.probe("task", name="assoc")]
    raise ValueError(f"no probes are known for a result of `fastweights {command}`")


def declared_probes(rec: dict) -> list[dict]:
    """The probe specs of a result: its script's ``probe_specs(probes)``, or :func:`command_probe_specs`."""
    script = script_of(rec.get("command"))
    if script is not None:
        return script_probe_specs(script)
    if (rec.get("command") or "").startswith("fastweights "):
        return command_probe_specs(rec)
    raise ValueError(f"no benchmark script or fastweights command in {rec.get('command')!r}")


def stamp(path: Path) -> str | None:
    """Summarise the probes of the result at ``path`` if it has none and the checkout's code is the code that wrote
    it (``git.code``); None when stamped or already stamped, else why it was not (re-run it to stamp it)."""
    from probes import summarised

    from fastweights.core.files import atomic_write
    from fastweights.evidence.provenance import clean_code, git_state

    rec = json.loads(path.read_text())
    if rec.get("probes"):
        return None
    git = rec.get("git") or {}
    written = git.get("code")
    if written is None and git.get("commit") and git.get("dirty") is not True:
        written = clean_code(git["commit"])  # a copy of a commit, named (a device run's FASTWEIGHTS_GIT_COMMIT)
    now = git_state(ROOT).get("code")
    if not written or written != now:
        return (f"written by other code than the checkout's ({written or 'no code hash'} vs {now}): its probes "
                "would measure code it did not run; re-run it")
    try:
        specs = declared_probes(rec)
    except (OSError, KeyError, ValueError) as e:
        return f"its probes cannot be derived ({type(e).__name__}: {e})"
    summaries, stamped = summarised(specs), {}
    for key, value in rec.items():  # the probes right after the provenance (command, date, git, machine)
        stamped[key] = value
        if key == "machine":
            stamped["probes"] = summaries
    stamped.setdefault("probes", summaries)
    atomic_write(path, lambda p: p.write_text(json.dumps(stamped, indent=2) + "\n"))
    return None


def stamp_new(results: Path = RESULTS) -> list[str]:
    """:func:`stamp` every result without probes; the ones refused, each with why."""
    refused = []
    for path in result_paths(results):
        if not json.loads(path.read_text()).get("probes"):
            why = stamp(path)
            if why:
                refused.append(f"{result_key(path, results)}: {why}")
            else:
                print(f"summarised the behaviour probes of {result_key(path, results)}")
    return refused


def main(argv: list[str] | None = None) -> int:
    from probes import summarised

    from fastweights.cli.script_parser import ScriptParser

    ap = ScriptParser(description="summarise the probes a benchmark script declares")
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("summarise", help="print SCRIPT's FUNCTION(probes, *ARGS), summarised, as JSON")
    s.add_argument("script", type=Path)
    s.add_argument("function")
    s.add_argument("args", nargs="*")
    a = ap.parse_args(argv)
    print(json.dumps(summarised(script_probe_specs(a.script.resolve(), a.function, *a.args))))
    return 0


if __name__ == "__main__":
    from fastweights.cli.script_parser import exit_status_of

    sys.exit(exit_status_of(main))
