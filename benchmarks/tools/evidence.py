"""Is a stored result still evidence about the code as it is? Checked by behaviour, not by file lists.

Every result JSON in benchmarks/results/ (and one folder down) records
  * its provenance: ``command``, ``date``, ``git`` (commit, dirty paths), ``machine``;
  * ``result_file``: the file it was written as (a copy under another name is caught);
  * ``probes``: the behaviour probes of the code it measured, each a spec and the summary of its
    outputs when the result was written (:mod:`fastweights.evidence.probes`; a benchmark declares them in
    its ``probe_specs()``, a ``fastweights`` command derives them from the checkpoint it ran).

:func:`staleness` re-runs a result's probes: a summary that moved by more than the tolerance
(:data:`fastweights.evidence.summaries.RELATIVE_TOLERANCE` of an output's norm) means the code the
result measured no longer behaves as it did, so the result is stale, whatever file the change was made in
(an operator reached only through an import included), and a change that leaves behaviour alone (a
rename, a moved function, a comment) leaves it current. Stale results are marked in the generated
tables and listed with the command that re-runs them in benchmarks/results/TO_RERUN.md; they are not
an error: re-running is a decision about CPU-hours, the marks make sure nobody reads them as current.

:func:`problems` lists what cannot be waived: a result without its provenance, its file record, or
its probes.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    from fastweights.evidence.probes import run_probe

    try:
        return run_probe(json.loads(spec_json))
    except Exception as e:  # a probe that no longer runs (a removed option, a renamed preset) is a change
        return f"error: {type(e).__name__}: {e}"


def changed_probes(rec: dict) -> list[str]:
    """The probes of ``rec`` whose summary moved beyond the tolerance, as ``kind label: what moved``."""
    from fastweights.evidence.summaries import differences

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
            out.append(f"{name}: no behaviour probes recorded (the benchmark's probe_specs())")
        elif any(not {"kind", "args", "summary"} <= set(p) for p in specs):
            out.append(f"{name}: a probe without kind, args or summary")
    return out


def rerun_page(results: Path = RESULTS) -> str:
    """The generated list of stale results, each with why and the command that re-runs it."""
    lines = ["# Results to re-run", "",
             "Generated by `python benchmarks/tools/report.py` (do not edit): results whose behaviour probes changed,",
             "so the code they measured no longer behaves as it did (benchmarks/tools/evidence.py says how this is",
             "decided). Each is marked stale in the tables until its command is run again.", ""]
    stale = []
    for path in result_paths(results):
        rec = json.loads(path.read_text())
        why = staleness(rec)
        if why:
            stale.append(f"- `{result_key(path, results)}`: {why}\n  re-run: `{rec.get('command')}`")
    lines += stale or ["None: every result measured the code as it is."]
    return "\n".join(lines) + "\n"
