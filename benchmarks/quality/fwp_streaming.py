"""Why delta-rule language models collapse when streamed, and which design keeps streamed scores at their
windowed level (issue 21, scope 1).

    python benchmarks/quality/fwp_streaming.py [--minutes 8] [--runs runs/fwp_streaming] [--variants a,b,...]
        [--data tinyshakespeare]

Each variant is the ``shakespeare-char-fwp-delta-dpfp`` preset with overrides (below), trained for
``--minutes`` of its own CPU time on one thread (``train.budget_clock = "cpu"``), one after the other.
A variant whose checkpoint already exists under ``--runs`` is not trained again (its training record is
read from the run directory), so a cut-short run resumes where it stopped.

Each checkpoint is then scored on the test split twice, at batch 1 in calls of 64 characters
(``fastweights eval --stream``):

    carry     one stream, the state carried the whole way (what a user streaming a play gets)
    windows   the mixer state reset every 128 characters, the training length (``eval --stream``'s "memory"
              mode: what the validation numbers measure)

and the largest layer's state norm is recorded along the stream. Writes
benchmarks/results/fwp_streaming.json and fwp_streaming.png (loss and state norm against position).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads

PRESET = "shakespeare-char-fwp-delta-dpfp"
DATA = "tinyshakespeare"
IDENTITY_L2 = ['model.options.fwp.feature_map="identity"', "model.options.fwp.sum_norm=false",
               "model.options.fwp.l2_norm=true"]
VARIANTS = {  # name -> (description, overrides of the preset)
    "delta-dpfp": ("delta rule, DPFP keys sum-normalised (the preset)", []),
    "delta-l2": ("delta rule, identity features, L2-normalised keys and queries (DeltaNet)", IDENTITY_L2),
    "gated-delta-dpfp": ("gated delta rule (learned decay), DPFP sum-normalised",
                         ['model.options.fwp.rule="gated_delta"']),
    "gated-delta-l2": ("gated delta rule, identity features, L2-normalised (Gated DeltaNet; the preset "
                       "shakespeare-char-fwp-gated-delta-l2)", ['model.options.fwp.rule="gated_delta"', *IDENTITY_L2]),
    "delta-l2-carry": ("delta rule, identity + L2, trained with the state carried (truncated BPTT)",
                       [*IDENTITY_L2, "train.carry_state=true"]),
}


def train(name: str, overrides: list[str], minutes: float, out: Path, data: str) -> dict:
    run = out / name
    if not (run / "model.safetensors").exists():
        cmd = [sys.executable, "-m", "fastweights", "train", "--preset", PRESET, "--out", str(run), "--overwrite",
               "--quiet", "--set", f"train.max_minutes={minutes}", "--set", "train.max_steps=100000",
               "--set", "train.threads=1", "--set", 'train.budget_clock="cpu"', "--set", f"data.corpus={data!r}",
               *(x for o in overrides for x in ("--set", o))]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"val_bits"' in line]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"steps": steps[-1]["step"], "train_cpu_s": vals[-1]["elapsed"], "val_bits_per_char": vals[-1]["val_bits"]}


def score(run: Path, quiet: bool) -> dict:
    from fastweights.models.loading import load_checkpoint
    from fastweights.data import load_corpus, split_corpus
    from fastweights.experiments.streaming import encode_documents, stream_eval

    model, tok, cfg = load_checkpoint(run)
    docs = split_corpus(load_corpus(cfg.data.corpus, text_field=cfg.data.text_field), cfg.data.split,
                        cfg.data.val_fraction, cfg.data.test_fraction)["test"]
    out = {}
    for mode, label in (("carry", "carry"), ("memory", "windows")):
        t = time.process_time()
        r = stream_eval(model, encode_documents(docs, tok), mode, seq_len=cfg.train.seq_len, stride=64,
                        bin_width=4096, progress=not quiet).to_dict()
        out[label] = {"bits_per_char": r["bits_per_token"], "tokens": r["tokens"], "cpu_s": time.process_time() - t,
                      "curve": r["curve"], "state_norm": r["state_norm"]}
    return out


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for _, overrides in VARIANTS.values()
            for s in probes.preset_probes(PRESET, overrides, ("carry", "memory", "windows"))]



TITLE = "delta-rule LMs on the Shakespeare test split: streamed vs 128-char windows"


def stream_plot_runs(rows: dict) -> list[dict]:
    """plot_stream's input from the variants' rows (as stored in fwp_streaming.json under "variants")."""
    return [{"label": f"{name} {label}", "checkpoint": name, "mode": mode, "curve": row[label]["curve"],
             "state_norm": row[label]["state_norm"]}
            for name, row in rows.items() for label, mode in (("carry", "carry"), ("windows", "memory"))]


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="CPU minutes of training per variant")
    ap.add_argument("--runs", default="runs/fwp_streaming", help="run directory of the variants")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--data", default=DATA, help=f"registered corpus (default {DATA})")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw fwp_streaming.png from the stored fwp_streaming.json (no training, JSON unchanged)")
    a = ap.parse_args()
    png = Path(__file__).resolve().parents[1] / "results" / "fwp_streaming.png"
    if a.plot_only:
        import json

        from fastweights.experiments.streaming import plot_stream

        rec = json.loads(png.with_suffix(".json").read_text())
        plot_stream(stream_plot_runs(rec["variants"]), png, title=TITLE, unit="bits")
        return 0
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        print(f"error: unknown variant {unknown[0] if unknown else ''!r}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2

    use_threads("benchmark", 1)
    from fastweights.experiments.streaming import plot_stream

    out = Path(a.runs)
    rows = {}
    for name in names:
        desc, overrides = VARIANTS[name]
        row = {"description": desc, "overrides": overrides, **train(name, overrides, a.minutes, out, a.data)}
        row.update(score(out / name, a.quiet))
        row["streamed_minus_windowed_bits"] = row["carry"]["bits_per_char"] - row["windows"]["bits_per_char"]
        sn = row["carry"]["state_norm"]["max"]
        row["carry_state_norm_last_over_first_bin"] = sn[-1] / sn[0]
        rows[name] = row
        print(f"{name:18s} val {row['val_bits_per_char']:.3f}  test windows {row['windows']['bits_per_char']:.3f}  "
              f"carry {row['carry']['bits_per_char']:.3f} bits/char  "
              f"state norm x{row['carry_state_norm_last_over_first_bin']:.1f}", flush=True)
    plot_stream(stream_plot_runs(rows), png, title=TITLE, unit="bits")
    headline = []
    for name, r in rows.items():
        headline += [
            {"what": f"Shakespeare char, fwp {r['description']}, {a.minutes:g} CPU-min ({r['steps']} steps): "
                     "test bits/char, 128-char windows", "value": r["windows"]["bits_per_char"], "unit": "bits/char"},
            {"what": "  same model: test bits/char, one stream with the state carried",
             "value": r["carry"]["bits_per_char"], "unit": "bits/char", "target": "<= windows + 0.05 (issue 21)"},
            {"what": "  same: carried state norm, last 4,096-char bin / first",
             "value": r["carry_state_norm_last_over_first_bin"], "unit": "x", "target": ""}]
    write_result("fwp_streaming", {"preset": PRESET, "data": a.data, "minutes_per_variant": a.minutes, "threads": 1,
                                   "stride": 64, "variants": rows, "plot": "benchmarks/results/fwp_streaming.png",
                                   "headline": headline})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
