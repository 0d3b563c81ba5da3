"""The FWL head trained in-domain (issue 50, scope 2): for each scored text of ``fwl_smollm2.py``, a head trained
with ``fwl-head train --data`` on other text of the same author, scored on that text with the rows of
``fwl_smollm2.json`` (static, slow part, full FWL, test-time-only), beside the general-mix head and dynamic
evaluation of the same model on the same text.

    python benchmarks/quality/fwl_in_domain.py --prepare --runs runs/fwl-in-domain   # the training folders
    python benchmarks/quality/fwl_in_domain.py --train --runs runs/fwl-in-domain     # 4 x (fwl + test-time-only)
    python benchmarks/quality/fwl_in_domain.py --runs runs/fwl-in-domain             # score, write the result

In-domain training text (``fastweights.experiments.in_domain_text.SOURCES``), bundled public-domain text, never the
scored text:

- Anna Karenina <- War and Peace (Tolstoy); War and Peace <- Anna Karenina (Tolstoy);
- Hamlet <- Shakespeare's plays but the compared ones (``shakespeare-train``);
- Don Quijote <- the rest of Don Quijote: the novel with the scored opening and the next
  ``EXCLUDE_CHARS`` characters cut out.

Each source is cut at paragraph ends into ``PIECES`` documents of about ``PIECE_CHARS`` characters,
spread evenly over it, written as ``RUNS/data/TEXT/NN.txt``: the folder a user would pass to ``--data``. Every
head is the documented recipe (``fastweights fwl-head train`` with its defaults, ``--data`` the folder; the
test-time-only head with ``--minutes 5``, as ``fwl_smollm2.py``'s recipe).

Rows scored here, one thread, through the loop of ``fastweights.experiments.fwl_comparison``: ``static`` (checked
against the stored ``fwl_smollm2.json`` to 1e-4 relative), and per text the in-domain ``fwl``, its slow part,
``fwl_test_time_only`` (step size chosen on the tuning texts) and its slow part. Taken from ``fwl_smollm2.json`` (same
model, texts, segments and code; its static perplexities reproduced here): the general-mix head's rows and dynamic
evaluation (all weights, low-rank), against which each FWL row's share of the reduction is given.

Writes benchmarks/results/fwl_in_domain.json. Missing optional packages or checkpoints: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fastweights.core.threads import use_threads
from fastweights.evidence.result_files import RESULTS, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.script_log import log

from fastweights.core.errors import UserError
from fastweights.experiments.fwl_comparison import (cpu, fwl_rows, gain_split, load_texts, score_texts, split_roles,
                                                    static_evaluator)
from fastweights.experiments.in_domain_text import PIECE_CHARS, PIECES, SOURCES, check_disjoint, pieces, source_text

ROOT = Path(__file__).resolve().parents[2]
TEST_TIME_MINUTES = 5.0  # the test-time-only head's budget, as fwl_smollm2.py's recipe
STATIC_TOLERANCE = 1e-4  # relative: this run's static perplexity against the stored one


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py): the FWL head's two
    variants scored here."""
    return [probes.probe("hf_fwl", variant=v) for v in ("fwl", "test-time-only")]


def prepare(runs: Path) -> dict:
    """Write ``RUNS/data/TEXT/NN.txt`` for every scored text; returns text -> {folder, source, characters}."""
    out = {}
    for key, (spec, what) in SOURCES.items():
        folder = runs / "data" / key
        folder.mkdir(parents=True, exist_ok=True)
        docs = pieces(source_text(key))
        for i, doc in enumerate(docs):
            (folder / f"{i:02d}.txt").write_text(doc + "\n", encoding="utf-8")
        out[key] = {"folder": str(folder), "source": spec, "what": what, "characters": sum(map(len, docs))}
        log(f"{key}: {len(docs)} documents, {out[key]['characters']:,} characters of {what} -> {folder}")
    return out


def head_dir(runs: Path, key: str, variant: str) -> Path:
    return runs / key / variant


def train(runs: Path, threads: int) -> None:
    """The documented recipe on each training folder: the fwl head, then the test-time-only head (one cache)."""
    for key in SOURCES:
        for variant, extra in (("fwl", []), ("test-time-only", ["--minutes", f"{TEST_TIME_MINUTES:g}"])):
            cmd = [sys.executable, "-m", "fastweights", "fwl-head", "train", "--hf", "smollm2-135m",
                   "--data", str(runs / "data" / key), "--out", str(head_dir(runs, key, variant)),
                   "--variant", variant, "--threads", str(threads), *extra]
            log("$ " + " ".join(cmd[1:]))
            subprocess.run(cmd, check=True, cwd=ROOT)


def share(reduction: float, of: float) -> float:
    return reduction / of if of else float("nan")


def score_text(key: str, runs: Path, lm, tok, scored: dict, tuning: list, L: int, stored: dict) -> tuple[dict, dict]:
    """Text ``key``'s rows: static (checked against ``stored``), the in-domain heads' (``fwl_comparison.fwl_rows``)
    and, cited from ``stored``, the general-mix head's and dynamic evaluation's. Returns (its entry of the result's
    ``per_text``, its heads' training records)."""
    from fastweights.hf.fwl_head import load_fwl_head

    static = score_texts(static_evaluator(lm, L), {key: scored[key]})[key]
    was = stored["results"]["static"]["per_text"][key]["perplexity"]
    if abs(static["perplexity"] / was - 1) > STATIC_TOLERANCE:
        raise UserError(f"static perplexity of {key} is {static['perplexity']:.4f}, the stored result's {was:.4f}: "
                        "the stored comparison is not this code's")
    heads = {row: load_fwl_head(head_dir(runs, key, v), backbone_loader=lambda _n: (lm, tok))[0]
             for v, row in (("fwl", "fwl"), ("test-time-only", "fwl_test_time_only"))}
    rows, tuned = fwl_rows(heads, {key: scored[key]}, tuning, L, log=log)
    s = static["perplexity"]
    red = {row: 1 - r[key]["perplexity"] / s for row, r in rows.items()}
    stored_rows = stored["results"]
    dyn = {row: stored_rows[row]["per_text"][key]["relative_perplexity_reduction"] for row in ("dynamic", "dynamic_lowrank")}
    general = {row: stored_rows[row]["per_text"][key]["relative_perplexity_reduction"]
               for row in ("fwl", "fwl_slow_part", "fwl_test_time_only", "fwl_test_time_only_slow_part")}
    entry = {
        "static_perplexity": s, "static_tokens_per_cpu_s": static["tokens_per_cpu_s"],
        "in_domain": {row: {"perplexity": r[key]["perplexity"], "relative_perplexity_reduction": red[row],
                            "tokens_per_cpu_s": r[key]["tokens_per_cpu_s"],
                            "throughput_ratio_to_static": r[key]["tokens_per_cpu_s"] / static["tokens_per_cpu_s"],
                            "share_of_dynamic": share(red[row], dyn["dynamic"])} for row, r in rows.items()},
        "general_mix": {row: {"relative_perplexity_reduction": v, "share_of_dynamic": share(v, dyn["dynamic"])}
                        for row, v in general.items()},
        "dynamic": {row: {"relative_perplexity_reduction": v,
                          "throughput_ratio_to_static": stored_rows[row]["per_text"][key]["throughput_ratio_to_static"]}
                    for row, v in dyn.items()},
        "gain_split": {"in_domain": gain_split({key: static}, rows["fwl"], rows["fwl_slow_part"])["per_text"][key],
                       "general_mix": stored["gain_split"]["fwl"]["per_text"][key]},
        "tuned": tuned,
    }
    training = {}
    for v in ("fwl", "test-time-only"):
        f = head_dir(runs, key, v) / "training.json"
        t = json.loads(f.read_text()) if f.is_file() else {}
        training[f"{key}/{v}"] = {k: t.get(k) for k in ("steps", "cpu_s", "data", "cache_windows", "train_windows",
                                                        "train_documents", "tokens_seen", "lr", "step_lr")}
        training[f"{key}/{v}"]["data"] = str(runs / "data" / key)  # as given to --train (an absolute --data: where)
    log(f"{key}: in-domain FWL {100 * red['fwl']:.2f}% (slow part {100 * red['fwl_slow_part']:.2f}%), "
        f"general-mix {100 * general['fwl']:.2f}%, dynamic {100 * dyn['dynamic']:.2f}%")
    return entry, training


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="runs/fwl-in-domain", help="training folders and heads")
    ap.add_argument("--prepare", action="store_true", help="write the training folders and stop")
    ap.add_argument("--train", action="store_true", help="train the heads (the recipe, one process each) and stop")
    ap.add_argument("--part", metavar="TEXTS",
                    help="score only these texts (comma-separated), each into RUNS/parts/TEXT.json, and stop (one "
                         "process per core); the run without --part takes the parts of this code and scores the rest")
    ap.add_argument("--stored", default=str(RESULTS / "fwl_smollm2.json"),
                    help="the general-mix comparison whose static, dynamic and general-mix FWL rows are cited")
    benchmark_threads_flag(ap)
    args = ap.parse_args()
    runs = Path(args.runs)
    t_start, c_start = time.time(), cpu()
    from fastweights.evidence.provenance import git_state

    code = git_state(ROOT).get("code")
    try:
        use_threads("benchmark", args.threads)
        if args.prepare:
            prepare(runs)
            check_disjoint(runs)
            return 0
        check_disjoint(runs)
        if args.train:
            train(runs, args.threads)
            return 0
        from fastweights.hf.transformers_as_ours import load_hf_model

        keys = [k for k in (args.part or "").split(",") if k] or list(SOURCES)
        if bad := [k for k in keys if k not in SOURCES]:
            raise UserError(f"--part: unknown text(s) {', '.join(bad)} (known: {', '.join(SOURCES)})")
        stored = json.loads(Path(args.stored).read_text())
        parts = {}
        for key in keys:
            part = runs / "parts" / f"{key}.json"
            if not args.part and part.is_file() and json.loads(part.read_text()).get("code") == code:
                parts[key] = json.loads(part.read_text())
                continue
            for v in ("fwl", "test-time-only"):
                if not (head_dir(runs, key, v) / "checkpoint.json").is_file():
                    raise UserError(f"{head_dir(runs, key, v)}: no trained head (run --prepare, then --train)")
        lm, tok = load_hf_model("smollm2-135m")
        texts = load_texts(tok, stored["protocol"]["scored_tokens"], stored["protocol"]["scored_tokens"])
        scored, tuning, _, _ = split_roles(texts)
        L = int(stored["protocol"]["segment_len"])
        per_text, training = {}, {}
        for key in keys:
            if key in parts:
                log(f"{key}: scored by an earlier --part run ({runs / 'parts' / key}.json)")
                per_text[key], more = parts[key]["per_text"], parts[key]["training"]
            else:
                per_text[key], more = score_text(key, runs, lm, tok, scored, tuning, L, stored)
            training.update(more)
            if args.part:
                (runs / "parts").mkdir(parents=True, exist_ok=True)
                (runs / "parts" / f"{key}.json").write_text(json.dumps(
                    {"code": code, "per_text": per_text[key], "training": more, "cpu_s": cpu() - c_start}))
    except (OSError, KeyError, ValueError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.part:
        return 0

    def mean(fn) -> float:
        return float(np.mean([fn(p) for p in per_text.values()]))

    rows_in = ("fwl", "fwl_slow_part", "fwl_test_time_only", "fwl_test_time_only_slow_part")
    means = {"in_domain": {row: mean(lambda p, r=row: p["in_domain"][r]["relative_perplexity_reduction"])
                           for row in rows_in},
             "general_mix": {row: mean(lambda p, r=row: p["general_mix"][r]["relative_perplexity_reduction"])
                             for row in rows_in},
             "dynamic": {row: mean(lambda p, r=row: p["dynamic"][r]["relative_perplexity_reduction"])
                         for row in ("dynamic", "dynamic_lowrank")},
             "in_domain_throughput_ratio_to_static": mean(
                 lambda p: p["in_domain"]["fwl"]["throughput_ratio_to_static"])}
    means["in_domain_fast_part"] = means["in_domain"]["fwl"] - means["in_domain"]["fwl_slow_part"]
    means["general_mix_fast_part"] = means["general_mix"]["fwl"] - means["general_mix"]["fwl_slow_part"]
    means["share_of_dynamic"] = {f"{src}/{row}": means[src][row] / means["dynamic"]["dynamic"]
                                 for src in ("in_domain", "general_mix") for row in ("fwl", "fwl_test_time_only")}
    headline = [
        {"what": f"SmolLM2-135M, {len(per_text)} texts x {stored['protocol']['scored_tokens']:,} tokens: "
                 f"{name} FWL head, perplexity lower than static, mean", "value": 100 * means[src]["fwl"],
         "unit": "%", "target": "> 0"} for src, name in (("in_domain", "in-domain"), ("general_mix", "general-mix"))]
    headline += [
        {"what": f"  {name} head: fast part (full - slow part)", "value": 100 * means[f"{src}_fast_part"], "unit": "%",
         "target": "> 0"} for src, name in (("in_domain", "in-domain"), ("general_mix", "general-mix"))]
    headline += [
        {"what": f"  {k.replace('/', ' ')}: share of dynamic evaluation's reduction", "value": v, "unit": "x",
         "target": ""} for k, v in means["share_of_dynamic"].items()]
    headline.append({"what": "  in-domain FWL: scoring tokens per CPU-second / static's",
                     "value": means["in_domain_throughput_ratio_to_static"], "unit": "x", "target": ""})
    write_result("fwl_in_domain", {
        "model": stored["model"],
        "protocol": {"scored_tokens": stored["protocol"]["scored_tokens"], "segment_len": L,
                     "tuning": stored["protocol"]["tuning"], "threads": args.threads,
                     "cited_from": Path(args.stored).name,
                     "cited_rows": "general-mix FWL rows and dynamic evaluation (all weights, low-rank) per text"},
        "sources": {k: {"source": spec, "what": what, "pieces": PIECES, "piece_chars": PIECE_CHARS}
                    for k, (spec, what) in SOURCES.items()},
        "training": training,
        "per_text": per_text,
        "means": means,
        "headline": headline,
        "elapsed_s": time.time() - t_start, "cpu_s": cpu() - c_start,
    })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
