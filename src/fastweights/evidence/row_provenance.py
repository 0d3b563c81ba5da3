"""The provenance of a result assembled from rows measured at several commits (a resumable benchmark whose rows
were trained and scored over days: ``benchmarks/quality/leaderboard.py``): the oldest commit of its rows, which
every row's code descends from, the code paths any row ran with uncommitted changes, and the commit that
assembled it (:func:`measured_commits`); and every behaviour probe its rows recorded when they were measured
(:func:`measured_probes`)."""

from __future__ import annotations

import json
import subprocess

from fastweights.evidence.result_files import REPO, git_state


def _oldest(commits: set[str]) -> str | None:
    """The commit every one of ``commits`` descends from (they lie on one line of history here)."""
    commits = {c for c in commits if c}
    if len(commits) <= 1:
        return next(iter(commits), None)
    r = subprocess.run(["git", "-C", str(REPO), "merge-base", "--octopus", *sorted(commits)],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def measured_commits(rows: dict[str, list[dict]]) -> dict:
    """The git record of a table of rows trained at several commits: the oldest row commit."""
    every = {(r.get("git") or {}).get("commit") for rs in rows.values() for r in rs}
    # a row trained while another process rewrote the results of this benchmark records them as dirty: not code
    dirty = sorted({p for rs in rows.values() for r in rs for p in (r.get("git") or {}).get("dirty_paths") or []
                    if not p.startswith("benchmarks/results/")})
    return {"commit": _oldest(every), "dirty": bool(dirty), "dirty_paths": dirty[:20],
            "aggregated_at": git_state().get("commit")}


def measured_probes(rows: dict[str, list[dict]]) -> list[dict]:
    """Every probe the rows recorded when they were scored (a spec measured with two summaries keeps
    both: one of them is then stale). A row without probes predates them and must be scored again."""
    out, seen = [], set()
    for name, rs in rows.items():
        for r in rs:
            if not r.get("probes"):
                raise SystemExit(f"error: the {name} seed {r.get('seed')} row records no probes (scored before rows "
                                 "recorded them): delete its row.json and run again to score it")
            for p in r["probes"]:
                key = json.dumps(p, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append(p)
    return out
