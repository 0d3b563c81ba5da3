"""Score NIAH training pilots (issue 8): did a checkpoint learn to answer the needle questions of its own
training text, and, for an FwPKM memory at layer 0 behind a short convolution, what does the memory return?

Each pilot is a ``fastweights train --preset niah-cpu ... --set ...`` checkpoint (one thread, CPU-time
budget); its config (the overrides) and how far it trained are read from the checkpoint.

    python benchmarks/quality/niah_pilots.py --name niah_short_conv_pilots \\
        "full attention, short_conv=8=runs/niah-cpu-attn" "SWA 128 + FwPKM@2, short_conv=8=runs/p-fwpkm-conv" ...

Per pilot: held-out answer-digit accuracy against the needles' own digits (chance), from
``fastweights.tasks.niah_diagnostics.answer_digit_accuracy``. With FwPKM at layer 0 and a short convolution, the
memory's input is a function of the last W characters only, so a question's query equals its needle's query; the probe
reads a held-out needle text through that memory (writes every chunk, as in training) and records, at each question's
answer position, the cosine of the value read against the needle's value target and against the other needles' targets
(the first answer digit). The probe's needle text is built from ``--data`` (a registered corpus name, default
``tinyshakespeare``: the text of the preset's corpus ``niah-tinyshakespeare``); the accuracy reads each checkpoint's
own training corpus.

Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.tasks.niah_diagnostics import DATA, answer_digit_accuracy, memory_value_probe


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return probes.preset_probes("niah-cpu") + [probes.probe("task", name="niah")]


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("pilots", nargs="+", help="LABEL=CHECKPOINT_DIR (the last '=' splits)")
    ap.add_argument("--chars", type=int, default=20_000, help="held-out characters scored per checkpoint")
    ap.add_argument("--data", default=DATA, help=f"haystack of the memory probe's text: a registered corpus (default {DATA})")
    ap.add_argument("--name", default="niah_pilots")
    a = ap.parse_args()
    from fastweights.checkpoints.format import TRAINER_STATE, parse_trainer_state
    from fastweights.models.loading import load_checkpoint

    use_threads("benchmark", 1)
    rows, headline = [], []
    for spec in a.pilots:
        label, sep, path = spec.rpartition("=")
        ckpt = Path(path)
        if not sep or not (ckpt / "model.safetensors").exists():
            print(f"error: {spec!r} is not LABEL=CHECKPOINT_DIR with a checkpoint", file=sys.stderr)
            return 2
        trainer = parse_trainer_state((ckpt / TRAINER_STATE).read_bytes(), str(ckpt))  # no pickle: safetensors
        model, tok, cfg = load_checkpoint(ckpt)
        model.eval()
        acc = answer_digit_accuracy(ckpt, chars=a.chars)
        probe = memory_value_probe(model, tok, haystack=a.data)
        m = cfg.model
        rows.append({"label": label, "checkpoint": str(ckpt), "steps": trainer["step"],
                     "cpu_seconds": round(trainer["elapsed"], 1), "budget_clock": cfg.train.budget_clock,
                     "model": {"short_conv": m.short_conv, "memory": m.memory, "memory_layers": m.memory_layers,
                               "layer_mixers": m.layer_mixers or [m.mixer] * m.n_layers, "options": m.options},
                     "data": cfg.data.corpus, "val_bits": (trainer["history"][-1]["val_bits"]
                                                           if trainer["history"] else None),
                     "answer_digit_accuracy": acc, "memory_value_probe": probe})
        headline.append({"what": f"NIAH pilot, {label}, {trainer['step']} steps, {trainer['elapsed'] / 60:.0f} CPU-min: "
                                 "held-out answer-digit accuracy (chance: needle digits)",
                         "value": f"{acc['question_answer_digits']:.3f} (chance {acc['needle_digits_chance']:.3f})",
                         "target": "well above chance"})
        print(headline[-1]["what"], headline[-1]["value"], flush=True)
    write_result(a.name, {"what": "NIAH training pilots: answer-digit accuracy of checkpoints on held-out text of "
                                  "their own training corpus, and the layer-0 FwPKM value probe",
                          "headline": headline, "pilots": rows})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
