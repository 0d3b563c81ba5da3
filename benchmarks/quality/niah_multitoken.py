"""Multi-token needle in a haystack on a CPU (issue 50): FwPKM against the same model with memory writes frozen
and an attention-only model of equal trainable parameters.

Every model is the preset configs/niah-multitoken.toml (word-level Shakespeare with two-token keys and
three-token values, ``fastweights.tasks.niah_multitoken``; 2 layers, d_model 128, 32-token sliding-window
attention, a 4-token causal convolution and the FwPKM memory before layer 0, 512-token training sequences) with the overrides below, trained for
the same CPU budget (``--minutes`` of process CPU time on one thread), then read on held-out text (the last tenth of
tinyshakespeare) with held-out keys and values at 1x, 2x, 4x and 16x the training length, 1, 2 and 3 reads, target
depths uniform, 5 needles per sample, answers generated greedily (the n-iter protocol of ``fastweights.tasks.niah``:
memories write once per read, never during the question or the answer):

    fwpkm           SWA + FwPKM before layer 0 (the preset)
    fwpkm-frozen    the fwpkm checkpoint read with its memory never writing (no training of its own)
    attention       full causal attention, no memory (trainable parameters: ``parameters`` in the result)

Diagnosis (memory models): per answer token, the share right when generated and when the earlier answer tokens are
given (teacher forcing), and what the memory reads at the position that predicts it against each needle's stored
value (``niah_multitoken.forced_answer_probe``): the first answer token is bound to the key, the later ones to the
key and the value tokens before them.

    python benchmarks/quality/niah_multitoken.py --variants fwpkm --train-only      # one process per core
    python benchmarks/quality/niah_multitoken.py --variants attention --train-only
    python benchmarks/quality/niah_multitoken.py                                    # train what is missing, evaluate

A checkpoint under ``--runs`` trained with the same overrides is reused. Writes benchmarks/results/niah_multitoken.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fastweights.core.threads import use_threads
from fastweights.evidence.result_files import write_result
from fastweights.evidence.timing import children_cpu_seconds
from fastweights.cli.script_parser import ScriptParser, exit_status_of

ROOT = Path(__file__).resolve().parents[2]
PRESET = "niah-multitoken"
TRAIN_LEN = 512
VARIANTS = {"fwpkm": [], "attention": ['model.memory=""', "model.memory_layers=[]", "model.options.attention.window=0"]}
EVAL_ONLY = {"fwpkm-frozen": "fwpkm"}
TARGETS = {"two_reads_2x": 0.8, "two_reads_16x": 0.6, "one_read_over_two_reads_at_most": 0.5}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return ([s for overrides in VARIANTS.values() for s in probes.preset_probes(PRESET, overrides)]
            + [probes.probe("task", name="niah"), probes.probe("task", name="niah_multitoken")])


def overrides(name: str, a) -> list[str]:
    return [*VARIANTS[name], f"train.max_minutes={a.minutes}", 'train.budget_clock="cpu"', "train.threads=1",
            'train.device="cpu"', f"train.seed={a.seed}"]


def train(name: str, a) -> None:
    out, sets = Path(a.runs) / name, overrides(name, a)
    meta = out / "niah_multitoken_overrides.json"
    if (out / "model.safetensors").exists() and meta.exists() and json.loads(meta.read_text()) == sets:
        print(f"{name}: reusing {out}", flush=True)
        return
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "fastweights", "train", "--preset", PRESET, "--out", str(out), "--quiet",
           *[x for s in sets for x in ("--set", s)]]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    meta.write_text(json.dumps(sets))


def training_record(ckpt: Path) -> dict:
    metrics = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    return {"train_steps": max((m.get("step", 0) for m in metrics), default=0),
            "train_cpu_seconds": round(max((m.get("elapsed", 0.0) for m in metrics), default=0.0), 1),
            "val_loss_nats": vals[-1] if vals else None}


def position_accuracy(records: list[dict]) -> dict:
    """iters -> length -> share right of each answer token (generated: a wrong token feeds the next)."""
    out: dict = {}
    for r in records:
        cell = out.setdefault(str(r["iters"]), {}).setdefault(str(r["length"]), [])
        cell.append(r["token_hits"])
    return {n: {L: [round(sum(h[j] for h in hs) / len(hs), 4) for j in range(len(hs[0]))] for L, hs in by.items()}
            for n, by in out.items()}


def evaluate(name: str, a, lengths: list[int], iters: tuple[int, ...]) -> dict:

    from fastweights.models.loading import load_checkpoint
    from fastweights.tasks import niah_multitoken as mt
    from fastweights.tasks.niah import NiahOptions, evaluate_niah, summarize
    from fastweights.tasks.niah_token import eval_haystack

    use_threads("benchmark", 1)
    base = EVAL_ONLY.get(name, name)
    model, tok = load_checkpoint(str(Path(a.runs) / base))[:2]
    samples = mt.make_samples(eval_haystack(), lengths, "uniform", a.samples, a.seed)
    c0 = time.process_time()
    records = evaluate_niah(model, tok, samples, NiahOptions(iters=iters, frozen_memory=name in EVAL_ONLY))
    summary = summarize(records)
    table = {m: {str(n): {str(L): v["by_length"][L][m] for L in v["by_length"]} for n, v in summary["by_iters"].items()}
             for m in summary["metrics"]}
    out = {"checkpoint": base, "frozen_memory": name in EVAL_ONLY, **training_record(Path(a.runs) / base),
           "parameters": sum(p.numel() for p in model.parameters()), **table,
           "generated_token_accuracy": position_accuracy(records),
           "eval_cpu_seconds": round(time.process_time() - c0, 1)}
    print(f"{name}: exact " + json.dumps(table["exact"]), flush=True)
    if name == "attention" or a.probe_samples == 0:
        return out
    c0 = time.process_time()
    probe: dict = {}
    for L in lengths:
        rows = [r for i in range(a.probe_samples)
                for r in mt.forced_answer_probe(model, tok, mt.make_sample(eval_haystack(), L, None, a.seed, i),
                                                (1, 2))]
        probe[str(L)] = {str(n): {str(j): {k: round(sum(float(r[k]) for r in sel) / len(sel), 4)
                                           for k in ("right", "cos_target", "cos_distractor_max", "target_wins")}
                                  for j in range(mt.VALUE_LEN)
                                  for sel in [[r for r in rows if r["iters"] == n and r["token"] == j]]}
                         for n in (1, 2)}
    out["forced_answer_probe"] = probe
    out["probe_cpu_seconds"] = round(time.process_time() - c0, 1)
    return out


def acceptance(fw: dict, lengths: list[int]) -> dict:
    two = fw["exact"]["2"]
    one = fw["exact"]["1"]
    x2, x16 = str(2 * TRAIN_LEN), str(16 * TRAIN_LEN)
    ratio = max((one[L] / two[L] if two[L] else float("inf")) for L in two)
    return {"two_reads_2x": two.get(x2), "two_reads_16x": two.get(x16), "one_read_over_two_reads_max": ratio,
            "targets": TARGETS,
            "met": bool(two.get(x2, 0) >= TARGETS["two_reads_2x"] and two.get(x16, 0) >= TARGETS["two_reads_16x"]
                        and ratio <= TARGETS["one_read_over_two_reads_at_most"])}


def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="runs/niah-multitoken", help="checkpoints, one folder per variant")
    ap.add_argument("--variants", default="fwpkm,attention", help="models to train, comma-separated")
    ap.add_argument("--train-only", action="store_true", help="train --variants and stop")
    ap.add_argument("--minutes", type=float, default=15.0, help="training budget per model in CPU-minutes")
    ap.add_argument("--lengths", default=",".join(str(k * TRAIN_LEN) for k in (1, 2, 4, 16)),
                    help="context lengths in tokens")
    ap.add_argument("--samples", type=int, default=100, help="samples per length")
    ap.add_argument("--probe-samples", type=int, default=20, help="samples per length for the forced-answer probe")
    ap.add_argument("--seed", type=int, default=0, help="training seed and sample seed")
    a = ap.parse_args()
    names = [v for v in a.variants.split(",") if v]
    if bad := [v for v in names if v not in VARIANTS]:
        print(f"error: unknown variant(s) {', '.join(bad)} (known: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    lengths = [int(x) for x in a.lengths.split(",")]
    t0, c0 = time.time(), children_cpu_seconds()
    try:
        for name in names:
            train(name, a)
    except subprocess.CalledProcessError as e:
        print(f"error: training failed ({e})", file=sys.stderr)
        return 2
    if a.train_only:
        return 0
    train_cpu = children_cpu_seconds() - c0
    models = {name: evaluate(name, a, lengths, (1, 2, 3))
              for name in [*names, *(e for e, b in EVAL_ONLY.items() if b in names)]}
    result = {"what": "multi-token NIAH: exact match of the generated three-token answer by reads and context length; "
                      "held-out text (tinyshakespeare's last tenth), held-out keys and values; training length "
                      f"{TRAIN_LEN} tokens",
              "minutes_per_model": a.minutes, "samples_per_length": a.samples, "lengths": lengths,
              "chance_exact": 1 / 100 ** 3, "chance_per_token": 1 / 100, "models": models,
              "cpu_seconds": {"training_this_run": round(train_cpu, 1),
                              "evaluation": round(sum(m["eval_cpu_seconds"] + m.get("probe_cpu_seconds", 0)
                                                      for m in models.values()), 1)},
              "elapsed_s": round(time.time() - t0, 1)}
    if "fwpkm" in models:
        result["acceptance"] = acceptance(models["fwpkm"], lengths)
        fw = models["fwpkm"]["exact"]
        result["headline"] = [{"what": f"fwpkm, {n} read(s), exact at {L} tokens", "value": fw[n][L], "unit": "",
                               "target": ""} for n in fw for L in fw[n]]
    write_result("niah_multitoken", result)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
