"""Why the fast-weights RNN language model trails the LSTM: the eta/lambda sweep and the plain LN-RNN ablation
(issue 21, scope 1).

    python benchmarks/quality/fast_rnn_sweep.py [--minutes 3] [--variants a,b,...] [--runs runs/fast_rnn_sweep]

Every variant is the ``shakespeare-char-fast-rnn`` preset (4 layers, 158 hidden units, Ba et al. 2016's
fast weights in place of attention) with one change, trained on ``shakespeare-train`` for ``--minutes``
of its own CPU time on one thread (``train.budget_clock = "cpu"``), validated every 200 steps. For each:

    val bits/char    at every 200 steps (compare variants at equal steps: a variant without fast weights
                     runs more steps in the same CPU time) and at the end of its budget
    held-out         the first 16,384 characters of the four held-out plays of benchmarks/quality/leaderboard.py,
                     in 128-character windows and streamed with the state carried
    read / input     in the trained model, over one 128-character window of Hamlet: the mean norm of the
                     fast-weight read ``A_{t-1} h_t^(0)`` over the mean norm of the input term
                     ``b_t = W h_{t-1} + C x_t`` it is added to before the layer norm, per layer. Both go
                     through one LayerNorm, so a ratio of hundreds means the state is a function of the
                     memory alone and the input is lost.

Writes benchmarks/results/fast_rnn_sweep.json. Resumable: a variant whose run directory holds its
finished record is not trained again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fastweights.evidence.result_files import git_state, repo_relative, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.experiments.fast_rnn_read import read_over_input

PRESET = "shakespeare-char-fast-rnn"
OPTION = "model.options.fast_rnn."
VARIANTS = {  # name -> (what, overrides)
    "paper": ("Ba et al.'s eta 0.5, lambda 0.95 (the preset before this sweep)", [OPTION + "eta=0.5"]),
    "eta0.05": ("eta 0.05", [OPTION + "eta=0.05"]),
    "eta0.005": ("eta 0.005", [OPTION + "eta=0.005"]),
    "eta0.0005": ("eta 0.0005", [OPTION + "eta=0.0005"]),
    "eta0.0005-lam0.5": ("eta 0.0005, lambda 0.5", [OPTION + "eta=0.0005", OPTION + "lam=0.5"]),
    "ln-rnn": ("no fast weights: the LN-RNN ablation", [OPTION + "fast_weights=false"]),
}
HELDOUT_CHARS = 16384
EVERY = 200


def train(name: str, minutes: float, out: Path) -> Path:
    run = out / name
    if (run / "summary.json").exists() and "interrupted_by" not in json.loads((run / "summary.json").read_text()):
        return run
    sets = ['data.corpus="shakespeare-train"', f"train.max_minutes={minutes}", "train.max_steps=1000000",
            "train.threads=1", 'train.budget_clock="cpu"', f"train.eval_every={EVERY}", *VARIANTS[name][1]]
    cmd = [sys.executable, "-m", "fastweights", "train", "--preset", PRESET, "--out", str(run), "--overwrite",
           "--quiet", *(x for s in sets for x in ("--set", s))]
    print(f"train {name} ({minutes:g} CPU-min)", flush=True)
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"error: training {name} exited with {r.returncode}")
    return run


def measure(name: str, run: Path) -> dict:
    import torch

    from fastweights.models.loading import load_checkpoint
    from fastweights.data import load_corpus
    from fastweights.experiments.leaderboard import HELDOUT, SEQ_LEN, STRIDE, heldout_documents
    from fastweights.experiments.streaming import stream_eval

    use_threads("benchmark", 1)
    model, tok, _ = load_checkpoint(run)
    model.eval()
    vals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"val_bits"' in x]
    summary = json.loads((run / "summary.json").read_text())
    rec = {"what": VARIANTS[name][0], "overrides": VARIANTS[name][1], "steps": summary["steps"],
           "parameters": summary["parameters"], "val_bits_per_char": summary["val_bits_per_token"],
           "val_curve": {str(v["step"]): v["val_bits"] for v in vals}}
    for label, mode in (("windows", "windows"), ("streamed", "carry")):
        r = stream_eval(model, heldout_documents(tok, HELDOUT_CHARS), mode, seq_len=SEQ_LEN, stride=STRIDE,
                        bin_width=4096).to_dict()
        rec[f"heldout_{label}_bits_per_char"] = r["bits_per_token"]
    rec["streamed_minus_windows_bits"] = rec["heldout_streamed_bits_per_char"] - rec["heldout_windows_bits_per_char"]
    text = load_corpus(f"shakespeare-heldout:{HELDOUT[0]}")[0].text[20000:20000 + SEQ_LEN]
    ratios = read_over_input(model, torch.tensor([tok.encode(text)]))
    if ratios:
        rec["read_over_input_per_layer"] = ratios
    print(f"{name:18s} {rec['steps']:5d} steps  val {rec['val_bits_per_char']:.3f}  windows "
          f"{rec['heldout_windows_bits_per_char']:.3f}  streamed {rec['heldout_streamed_bits_per_char']:.3f}"
          + (f"  read/input {min(ratios):.3g}-{max(ratios):.3g}" if ratios else ""), flush=True)
    return rec


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for _, overrides in VARIANTS.values() for s in probes.preset_probes(PRESET, overrides, ("carry",))]



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="CPU minutes of training per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--runs", default="runs/fast_rnn_sweep", help="run directory (resumable)")
    a = ap.parse_args()
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names or a.minutes <= 0:
        print(f"error: unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}" if bad else
              "error: --variants must name at least one variant and --minutes must be > 0", file=sys.stderr)
        return 2
    out = Path(a.runs)
    rows = {n: measure(n, train(n, a.minutes, out)) for n in names}
    common_step = str(min(max(int(s) for s in r["val_curve"]) // EVERY * EVERY for r in rows.values()))
    headline = [{"what": f"{n}: validation bits/char at step {common_step} (equal steps)",
                 "value": r["val_curve"].get(common_step), "unit": "bits/char"} for n, r in rows.items()]
    headline += [{"what": f"{n}: held-out bits/char streamed (windows {r['heldout_windows_bits_per_char']:.3f})",
                  "value": r["heldout_streamed_bits_per_char"], "unit": "bits/char"} for n, r in rows.items()]
    write_result("fast_rnn_sweep", {
        "git": git_state(), "preset": PRESET, "cpu_minutes_per_variant": a.minutes, "threads": 1,
        "budget_clock": "cpu", "train_corpus": "shakespeare-train", "heldout_chars_per_play": HELDOUT_CHARS,
        "out": repo_relative(out), "equal_step": int(common_step), "variants": rows, "headline": headline,
    })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
