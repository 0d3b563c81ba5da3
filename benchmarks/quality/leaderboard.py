"""One equal-compute leaderboard of every mechanism (issue 21, scope 3): which one to pick, and what it costs.

    python benchmarks/quality/leaderboard.py [--minutes 20] [--entries a,b,...] [--seeds 0] [--runs runs/leaderboard]
        [--chars-per-play 32768] [--top-seeds 3] [--aggregate-only]
    python benchmarks/quality/leaderboard.py --plot-only    # redraw leaderboard.png from the stored leaderboard.json

Every entry is a character-level language model of about 0.82M parameters (every ``shakespeare-char*``
preset, d_model 128, 4 layers, with the overrides below), trained on ``shakespeare-train`` (the complete
Shakespeare without the held-out plays; validation: its last 5%) for ``--minutes`` of its own CPU time on
one thread (``train.threads = 1``, ``train.budget_clock = "cpu"``, so equal compute whatever else loads
the machine), then scored on held-out plays it never saw: the first ``--chars-per-play`` characters of
Hamlet, Julius Caesar, Macbeth and Othello (one spelling of each, ``shakespeare-heldout``; 4 x 32,768 =
131,072 characters by default), read in order at batch 1 in calls of 64 characters, twice:

    windows   every state (context, memories, FWL's fast weights) reset every 128 characters, the training
              length (``eval --stream``'s "windows" mode): independent windows, what validation measures
    streamed  one stream, the whole state carried across calls and plays (what a user streaming text
              gets; attention keeps a KV cache of 64 characters between calls)

Dynamic evaluation (Krause et al. 2018) is an entry on top of the attention baseline's checkpoint:
rms-global-prior with MS_g collected on the training split and (lr, decay) tuned on the validation split
(``fastweights dynamic stats`` / ``dynamic tune``), scored streamed (the adapted weights carried);
its "windows" score is the static model's.

Per entry and seed: parameters, training steps, training tokens/s (process CPU time, periodic
validation included), validation bits/char, held-out bits/char in both modes, scoring tokens/s (CPU)
and peak memory (max RSS of the training process and of the scoring). After every entry has one seed,
the ``--top-seeds`` best by streamed bits/char get seeds 1 and 2 as well (when ``--top-seeds`` > 0).

Each finished piece is kept under ``--runs`` (checkpoint, ``row.json``), so a cut-short run resumes where
it stopped, and two processes may train different ``--entries`` at once (one core each); every process
rewrites benchmarks/results/leaderboard.json (``complete`` false until every entry has its seeds) and
leaderboard.png (per-position streamed loss of every entry, drawn from that JSON alone: plot_leaderboard) from all
finished rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastweights.evidence.result_files import RESULTS, git_state, repo_relative, write_result
from fastweights.evidence.row_provenance import measured_commits, measured_probes
from fastweights.evidence.script_log import log
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.experiments.leaderboard import (DYNAMIC_BASE, ENTRIES, HELDOUT, SEQ_LEN, STRIDE, heldout_documents,
                                                 leaderboard_table, plot_leaderboard, top_entries)

TRAIN_CORPUS = "shakespeare-train"


def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / name / f"seed{seed}"


def child(cmd: list[str]) -> dict:
    """Run ``cmd`` on one thread; the max RSS of that process alone (SystemExit if it fails)."""
    p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:6])} ... exited with {p.returncode}")
    return {"max_rss_mb": ru.ru_maxrss / 1024}


def train(name: str, seed: int, minutes: float, out: Path) -> dict:
    """Train (or resume, or reuse) one entry's model; its training record."""
    _, preset, overrides = ENTRIES[name]
    run = run_dir(out, name, seed)
    record = run / "train_record.json"
    if record.exists():
        return json.loads(record.read_text())
    resume = (run / "checkpoint.json").exists()
    cmd = [sys.executable, "-m", "fastweights", "train", "--preset", preset, "--out", str(run), "--quiet",
           *(["--resume"] if resume else ["--overwrite"]),
           *(x for o in [f"data.corpus={TRAIN_CORPUS!r}", f"train.max_minutes={minutes}", "train.max_steps=1000000",
                         "train.threads=1", 'train.budget_clock="cpu"', f"train.seed={seed}", *overrides]
             for x in ("--set", o))]
    log(f"train {name} seed {seed} ({minutes:g} CPU-min)")
    usage = child(cmd)
    summary = json.loads((run / "summary.json").read_text())
    if "interrupted_by" in summary:
        raise SystemExit(f"error: training {name} was interrupted ({summary['interrupted_by']}); run again to resume")
    cfg = json.loads((run / "config.json").read_text())
    tokens = summary["steps"] * cfg["train"]["batch_size"] * cfg["train"]["seq_len"]
    rec = {"steps": summary["steps"], "parameters": summary["parameters"], "train_cpu_s": summary["elapsed_s"],
           "train_tokens_per_cpu_s": tokens / summary["elapsed_s"], "val_bits_per_char": summary["val_bits_per_token"],
           "train_max_rss_mb": usage["max_rss_mb"], "resumed": resume, "git": git_state()}
    record.write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def dynamic_evaluator(model, run: Path, base: Path):
    """rms-global-prior on top of the baseline: MS_g from its training split, (lr, decay) tuned on its
    validation split; both files are kept in the entry's run directory."""
    from fastweights.adapt.dynamic import DynamicEvaluator

    run.mkdir(parents=True, exist_ok=True)
    stats, tuned = run / "grad_stats.safetensors", run / "dynamic_tuned.json"
    fw = [sys.executable, "-m", "fastweights"]
    if not stats.exists():
        child([*fw, "dynamic", "stats", "--checkpoint", str(base), "--quiet", "--max-batches", "64",
               "--save", str(stats)])
    if not tuned.exists():
        child([*fw, "dynamic", "tune", "--checkpoint", str(base), "--quiet", "--rule", "rms-global-prior",
               "--stats", str(stats), "--tune-chars", "20000", "--save", str(tuned)])
    t = json.loads(tuned.read_text())
    lr, decay = t["best"]["lr"], t["best"]["decay"]
    ev = DynamicEvaluator(model, rule="rms-global-prior", lr=lr, decay=decay, context=SEQ_LEN,
                          segment_len=int(t["settings"]["segment_len"]), grad_stats=stats)
    return ev, {"rule": "rms-global-prior", "lr": lr, "decay": decay, "segment_len": ev.segment_len,
                "tuned_on": "validation split of shakespeare-train (dynamic tune --tune-chars 20000)"}


def score(name: str, seed: int, out: Path, chars: int) -> dict:
    """Held-out bits/char of one trained entry, windows and streamed, in this process on one thread."""

    from fastweights.models.loading import load_checkpoint
    from fastweights.experiments.streaming import peak_rss_mb, stream_eval

    use_threads("benchmark", 1)
    dynamic = ENTRIES[name][1] is None
    base = run_dir(out, DYNAMIC_BASE if dynamic else name, seed)
    model, tok, cfg = load_checkpoint(base)
    runs, extra = {}, {}
    modes = (("windows", "windows", None), ("streamed", "carry", None))
    if dynamic:
        ev, extra["dynamic"] = dynamic_evaluator(model, run_dir(out, name, seed), base)
        modes = (("streamed", "carry", ev),)
    for label, mode, ev in modes:
        log(f"score {name} seed {seed}: {label}")
        t = time.process_time()
        r = stream_eval(model, heldout_documents(tok, chars), mode, seq_len=SEQ_LEN, stride=STRIDE, bin_width=1024,
                        evaluator=ev).to_dict()
        cpu = time.process_time() - t
        runs[label] = {"bits_per_char": r["bits_per_token"], "tokens": r["tokens"], "cpu_s": cpu,
                       "tokens_per_cpu_s": r["tokens"] / cpu, "curve": r["curve"], "state_norm": r["state_norm"],
                       "documents": r["documents"]}
    if dynamic:  # windows: the static baseline model
        runs["windows"] = json.loads((run_dir(out, DYNAMIC_BASE, seed) / "row.json").read_text())["windows"]
    return {**runs, **extra, "score_max_rss_mb": peak_rss_mb()}


def entry_row(name: str, seed: int, minutes: float, out: Path, chars: int) -> dict:
    path = run_dir(out, name, seed) / "row.json"
    if path.exists():
        return json.loads(path.read_text())
    if ENTRIES[name][1] is None:
        entry_row(DYNAMIC_BASE, seed, minutes, out, chars)  # the baseline first (its windows score is reused)
        rec = dict(json.loads((run_dir(out, DYNAMIC_BASE, seed) / "train_record.json").read_text()))
    else:
        rec = train(name, seed, minutes, out)
    # the probes of the code this row measured, summarised now, when it is scored (the aggregate keeps them)
    row = {"entry": name, "seed": seed, **rec, **score(name, seed, out, chars), "probes": row_probes(name)}
    row["streamed_minus_windows_bits"] = row["streamed"]["bits_per_char"] - row["windows"]["bits_per_char"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2) + "\n")
    print(f"{name:16s} seed {seed}: windows {row['windows']['bits_per_char']:.3f}  streamed "
          f"{row['streamed']['bits_per_char']:.3f} bits/char ({rec['steps']} steps)", flush=True)
    return row


def finished_rows(out: Path) -> dict[str, list[dict]]:
    """Every finished (entry, seed): its ``row.json`` under ``out``, else the row kept in the committed
    leaderboard.json (run directories are not shipped, so a fresh clone that re-runs one entry keeps the
    others' measured rows), provided that entry's preset and overrides are still the ones measured."""
    rows: dict[str, list[dict]] = {}
    for name in ENTRIES:
        for p in sorted((out / name).glob("seed*/row.json")):
            rows.setdefault(name, []).append(json.loads(p.read_text()))
    kept = RESULTS / "leaderboard.json"
    if kept.exists():
        rec = json.loads(kept.read_text())
        measured_as = {t["entry"]: (t["preset"], t["overrides"]) for t in rec.get("table", [])}
        for name, rs in rec.get("rows", {}).items():
            if name not in ENTRIES or measured_as.get(name) != (ENTRIES[name][1] or ENTRIES[DYNAMIC_BASE][1],
                                                               ENTRIES[name][2]):
                continue
            have = {r["seed"] for r in rows.get(name, [])}
            rows.setdefault(name, []).extend(r for r in rs if r["seed"] not in have)
    for rs in rows.values():
        rs.sort(key=lambda r: r["seed"])
    return rows


def aggregate(out: Path, a) -> None:
    """Write leaderboard.json and leaderboard.png from every finished row under ``out``."""
    rows = finished_rows(out)
    if not rows:
        print("no finished entry yet", flush=True)
        return
    table, checks = leaderboard_table(rows)
    want_top = top_entries(rows, a.top_seeds) if a.top_seeds else []
    complete = all(n in rows for n in ENTRIES) and all(len(rows[n]) >= 3 for n in want_top)
    record = {
        "git": measured_commits(rows),
        "complete": complete, "missing": [n for n in ENTRIES if n not in rows],
        "reproduce": "python benchmarks/quality/leaderboard.py  (resumable; two processes may split --entries)",
        "top_entries_for_seeds": want_top,
        "protocol": {"train_corpus": TRAIN_CORPUS, "cpu_minutes_per_model": a.minutes, "threads": 1,
                     "budget_clock": "cpu", "heldout": [f"shakespeare-heldout:{h}" for h in HELDOUT],
                     "chars_per_play": a.chars_per_play, "stride": STRIDE, "windows": SEQ_LEN,
                     "out": repo_relative(out)},
        "table": table, "checks": checks, "plot": "benchmarks/results/leaderboard.png",
        # the table's means by entry name (a key that does not move when the ranking does: docs cite it)
        "by_entry": {t["entry"]: {k: t[k] for k in ("rank", "seeds", "streamed_bits_per_char", "streamed_std",
                                                    "windows_bits_per_char", "windows_std", "train_steps",
                                                    "train_tokens_per_cpu_s", "score_tokens_per_cpu_s")}
                     for t in table},
        "rows": rows,
        "headline": [{"what": f"#{t['rank']} {t['entry']}: held-out bits/char streamed (windows "
                              f"{t['windows_bits_per_char']:.3f})",
                      "value": t["streamed_bits_per_char"], "unit": "bits/char",
                      "target": "streamed <= windows + 0.05"} for t in table],
    }
    write_result("leaderboard", {"probes": measured_probes(rows), **record})
    plot_leaderboard(record, RESULTS / "leaderboard.png")


def entry_probe_specs(probes, name: str) -> list[dict]:
    """The behaviour probes of one entry: its model, streamed with the state carried and in windows
    (dynamic-eval: its base model and the rule)."""
    if ENTRIES[name][1] is None:
        base = probes.preset_model_config(ENTRIES[DYNAMIC_BASE][1], ENTRIES[DYNAMIC_BASE][2])
        return probes.model_probes(base, ("carry", "windows")) + [
            probes.probe("dynamic", config=base, rule="rms-global-prior")]
    _, preset, overrides = ENTRIES[name]
    return probes.preset_probes(preset, [o for o in overrides if not o.startswith("train.")], ("carry", "windows"))


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py): every entry's."""
    return [s for name in ENTRIES for s in entry_probe_specs(probes, name)]


def row_probes(name: str) -> list[dict]:
    """:func:`entry_probe_specs` of ``name``, summarised by the repository's tools (tools/evidence.py,
    in a process of its own: the probes are no part of the package, and no script imports them)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "evidence.py"),
                           "summarise", __file__, "entry_probe_specs", name], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: summarising the probes of {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="CPU minutes of training per model")
    ap.add_argument("--entries", default=",".join(ENTRIES), help=f"comma-separated, of {', '.join(ENTRIES)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds to run for --entries")
    ap.add_argument("--top-seeds", type=int, default=3, help="entries that get seeds 0, 1, 2 (the best streamed)")
    ap.add_argument("--chars-per-play", type=int, default=32768, help="characters scored of each held-out play")
    ap.add_argument("--runs", default="runs/leaderboard", help="run directory (resumable)")
    ap.add_argument("--aggregate-only", action="store_true", help="only rewrite the JSON and PNG from finished rows")
    ap.add_argument("--plot-only", action="store_true",
                    help="only redraw leaderboard.png from the stored benchmarks/results/leaderboard.json")
    a = ap.parse_args(argv)
    if a.plot_only:
        print(plot_leaderboard(json.loads((RESULTS / "leaderboard.json").read_text()), RESULTS / "leaderboard.png"))
        return 0
    names = [n.strip() for n in a.entries.split(",") if n.strip()]
    bad = [n for n in names if n not in ENTRIES]
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if bad or not names or not seeds or a.minutes <= 0 or a.chars_per_play < SEQ_LEN or a.top_seeds < 0:
        what = f"unknown entry {bad[0]!r}; choose from {', '.join(ENTRIES)}" if bad else \
            "--entries, --seeds (integers), --minutes > 0, --chars-per-play >= 128 and --top-seeds >= 0 are required"
        print(f"error: {what}", file=sys.stderr)
        return 2
    out = Path(a.runs)
    if not a.aggregate_only:
        for seed in seeds:
            for name in names:
                entry_row(name, seed, a.minutes, out, a.chars_per_play)
                aggregate(out, a)
        if a.top_seeds and all(n in finished_rows(out) for n in ENTRIES):
            for name in top_entries(finished_rows(out), a.top_seeds):
                for seed in (1, 2):
                    entry_row(name, seed, a.minutes, out, a.chars_per_play)
                    aggregate(out, a)
    aggregate(out, a)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
