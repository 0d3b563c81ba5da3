"""Needle in a haystack on CPU (issue 8): the ``niah-cpu`` recipe against its full-attention baseline.

Trains nothing: it evaluates two checkpoints trained with the commands in ``configs/niah-cpu.toml``
(sliding-window attention + one FwPKM memory, and full softmax attention without memory, same data and
the same CPU-time budget) on the same NIAH samples, with 1 and 2 reads of the context (the paper's
n-iter protocol), at lengths from the training length (1K) to 4x it.

    fastweights train --preset niah-cpu --out runs/niah-cpu --set train.threads=1 --set 'train.budget_clock="cpu"'
    fastweights train --preset niah-cpu --out runs/niah-cpu-attn --set 'model.memory=""' \\
        --set 'model.memory_layers=[]' --set model.options.attention.window=0 \\
        --set train.threads=1 --set 'train.budget_clock="cpu"'
    python benchmarks/quality/niah_cpu.py --fwpkm runs/niah-cpu --attention runs/niah-cpu-attn [--samples 30] [--data tinyshakespeare]

Each checkpoint is scored by ``fastweights task niah --json`` in its own process (one thread), with the
haystack ``--data`` (a registered corpus name, default ``tinyshakespeare``: the text the preset's corpus
``niah-tinyshakespeare`` is generated from); the heatmaps go next to the JSON. The training-skill check
reads the held-out split of each checkpoint's own training corpus (recorded in the checkpoint).
Writes benchmarks/results/niah_cpu.json (+ niah_cpu_<model>.png); recorded paths are relative to the
repository root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fastweights.evidence.result_files import RESULTS, repo_relative, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.tasks.niah_diagnostics import DATA, answer_digit_accuracy


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return probes.preset_probes("niah-cpu") + [probes.probe("task", name="niah")]


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fwpkm", type=Path, default=Path("runs/niah-cpu"), help="checkpoint of the niah-cpu preset")
    ap.add_argument("--attention", type=Path, default=Path("runs/niah-cpu-attn"), help="full-attention baseline")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--iters", default="1,2")
    ap.add_argument("--samples", type=int, default=30, help="samples per length (uniform depths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=DATA, help=f"haystack: a registered corpus name (default {DATA})")
    ap.add_argument("--name", default="niah_cpu")
    a = ap.parse_args()

    models = {"fwpkm (sliding window 128 + FwPKM)": a.fwpkm, "attention (full softmax, no memory)": a.attention}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for label, ckpt in models.items():
        if not (ckpt / "model.safetensors").exists():
            print(f"error: no checkpoint at {ckpt} (train it with the commands in this script's docstring)",
                  file=sys.stderr)
            return 2
        short = label.split()[0]
        prefix = RESULTS / f"{a.name}_{short}"
        cmd = ["fastweights", "task", "niah", "--checkpoint", str(ckpt), "--haystack", a.data, "--lengths", a.lengths,
               "--iters", a.iters,
               "--samples", str(a.samples), "--seed", str(a.seed), "--threads", "1", "--quiet", "--json",
               "--out", str(prefix)]
        shown = " ".join(repo_relative(w) if w.startswith("/") else w for w in cmd)  # recorded: no machine path
        print("$", shown, flush=True)
        out = subprocess.run([sys.executable, "-m", "fastweights", *cmd[1:]], env=env, check=True,
                             capture_output=True, text=True).stdout
        doc = json.loads(out)
        train = json.loads((ckpt / "summary.json").read_text())
        use_threads("benchmark", 1)
        in_distribution = answer_digit_accuracy(ckpt, chars=40_000)  # the first 40k characters of the held-out span
        print(label, "in-distribution answer digits:", in_distribution, flush=True)
        by_iters = doc["summary"]["by_iters"]
        results[label] = {
            "checkpoint": repo_relative(ckpt),
            "command": shown,
            "training": {k: train.get(k) for k in ("steps", "val_bits_per_token", "elapsed_s", "budget_clock",
                                                     "parameters", "stopped_by_time_budget")},
            "training_text_answer_digit_accuracy": in_distribution,
            "exact_by_reads_and_length": {n: {L: v["exact"] for L, v in by_iters[n]["by_length"].items()}
                                          for n in by_iters},
            "digits_by_reads_and_length": {n: {L: v["digits"] for L, v in by_iters[n]["by_length"].items()}
                                           for n in by_iters},
            "summary": doc["summary"],
            "heatmap": str(prefix.with_suffix(".png").relative_to(RESULTS.parent.parent)),
        }
        Path(str(prefix) + ".json").unlink(missing_ok=True)  # the combined JSON below holds it
    fw, att = (results[k]["exact_by_reads_and_length"] for k in models)
    lengths = [s.strip() for s in a.lengths.split(",")]
    first, last = lengths[0], lengths[-1]
    mid = "2048" if "2048" in lengths else lengths[len(lengths) // 2]
    checks = {
        f"fwpkm exact at {mid}, 2 reads minus 1 read": fw["2"][mid] - fw["1"][mid] if "2" in fw else None,
        f"attention exact, 1 read, {last} minus {first}": att["1"][last] - att["1"][first],
        f"fwpkm exact, 1 read, {last} minus {first}": fw["1"][last] - fw["1"][first],
    }
    headline = []
    for label, r in results.items():
        acc = r["training_text_answer_digit_accuracy"]
        headline.append({"what": f"NIAH training skill, {label}, {r['training']['steps']} steps: answer-digit accuracy on "
                                 "held-out training-format text (chance: needle digits)",
                         "value": f"{acc['question_answer_digits']:.3f} (chance {acc['needle_digits_chance']:.3f})",
                         "target": "well above chance"})
        for n, by_len in r["exact_by_reads_and_length"].items():
            cells = ", ".join(f"{int(L) // 1024}K {v:.2f}" if int(L) % 1024 == 0 else f"{L} {v:.2f}"
                              for L, v in by_len.items())
            headline.append({"what": f"NIAH exact match, {label}, {n} read{'s' if n != '1' else ''}: by length",
                             "value": cells, "target": "2 reads > 1 at 2K; attention degrades at 4K, memory less"})
    write_result(a.name, {
        "headline": headline,
        "what": "NIAH exact-match accuracy (6-digit value, greedy decoding), the niah-cpu recipe vs a full-attention "
                "baseline trained on the same text with the same CPU-time budget; 1 and 2 reads of the context",
        "config": vars(a) | {"fwpkm": repo_relative(a.fwpkm), "attention": repo_relative(a.attention)},
        "acceptance": "2 reads clearly better than 1 at 2K for the memory model; attention trained at 1K degrades at "
                      "4K while the memory model degrades less",
        "checks": checks,
        "models": results,
    })
    for k, v in checks.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
