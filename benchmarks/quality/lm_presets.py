"""Char-level Shakespeare with each mechanism as the mixer, at (about) equal parameter count and equal
wall-clock budget: validation and test bits per character side by side.

    python benchmarks/quality/lm_presets.py --minutes 5 --parallel 2 [--data tinyshakespeare] [--runs runs/lm_presets] \
        shakespeare-char shakespeare-char-fwp-delta-dpfp shakespeare-char-fwp-sum-dpfp ...

Each preset trains in its own process with one torch thread (``--parallel`` of them at a time) for
``--minutes`` of its own CPU time (``train.budget_clock = "cpu"``), so runs get equal compute even when
other jobs load the machine. A run may add overrides of its own after a colon,
``shakespeare-char:model.short_conv=4`` (comma-separated), to compare a preset with a variant of
itself in the same run. Every run trains on ``--data`` (a registered corpus name, passed as
``--set data.corpus=NAME``; default ``tinyshakespeare``, the corpus of the shakespeare-char presets).
Then its checkpoint is scored on the test split with the state carried.
Writes benchmarks/results/NAME.json (``--name``, default lm_presets), with a sample per model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of

DATA = "tinyshakespeare"  # the corpus of the shakespeare-char presets this script compares (fastweights data list)


def run_preset(run: str, minutes: float, out_root: Path, extra: list[str]) -> dict:
    preset, _, own = run.partition(":")
    extra = extra + [x for s in own.split(",") if s for x in ("--set", s)]
    out = out_root / run.replace(":", "+").replace("=", "-")
    py = sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # evaluation and sampling on one thread too, like training
    subprocess.run([py, "-m", "fastweights", "train", "--preset", preset, "--out", str(out), "--quiet",
                    "--set", f"train.max_minutes={minutes}", "--set", "train.max_steps=100000",
                    "--set", "train.threads=1", "--set", "train.budget_clock=cpu", *extra], check=True, stdout=subprocess.DEVNULL, env=env)
    summary = json.loads((out / "summary.json").read_text())
    ev = subprocess.run([py, "-m", "fastweights", "eval", "--checkpoint", str(out), "--json", "--quiet"],
                        check=True, capture_output=True, text=True, env=env)
    test = json.loads(ev.stdout)
    sample = subprocess.run([py, "-m", "fastweights", "generate", "--checkpoint", str(out), "--prompt", "ROMEO:",
                             "--max-tokens", "200", "--seed", "0"], check=True, capture_output=True, text=True,
                            env=env).stdout
    return {"preset": run, "parameters": summary["parameters"], "steps": summary["steps"],
            "train_seconds": summary["elapsed_s"], "val_bits_per_char": summary["val_bits_per_token"],
            "test_bits_per_char": test["bits_per_char"], "sample": sample}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for p in ("shakespeare-char",) for s in probes.preset_probes(p)] + probes.preset_probes(
        "shakespeare-char", ["model.short_conv=4"])



def main():
    ap = ScriptParser()
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--runs", default="runs/lm_presets", help="run directory of the presets")
    ap.add_argument("--name", default="lm_presets")
    ap.add_argument("--set", action="append", default=[], help="extra override for every run")
    ap.add_argument("--data", default=DATA, help=f"registered corpus every run trains on (default {DATA})")
    a = ap.parse_args()
    extra = ["--set", f"data.corpus={a.data!r}", *(x for s in a.set for x in ("--set", s))]
    with ThreadPoolExecutor(a.parallel) as pool:
        rows = list(pool.map(lambda p: run_preset(p, a.minutes, Path(a.runs), extra), a.presets))
    for r in rows:
        print(f"{r['preset']:40s} {r['parameters']:>9,} params {r['steps']:>6} steps  "
              f"val {r['val_bits_per_char']:.3f}  test {r['test_bits_per_char']:.3f} bits/char")
    res = {"data": a.data, "minutes_per_run": a.minutes, "threads_per_run": 1, "runs_in_parallel": a.parallel, "results": rows,
           "headline": [row for r in rows for row in (
               {"what": f"Shakespeare char, {r['preset']} ({r['parameters']:,} params, {a.minutes:g} CPU-min, "
                        f"{r['steps']} steps): validation bits/char", "value": round(r["val_bits_per_char"], 3),
                "unit": "bits/char"},
               {"what": "  same model: test bits/char (whole test split streamed, state carried)",
                "value": round(r["test_bits_per_char"], 3), "unit": "bits/char"})]}
    write_result(a.name, res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
