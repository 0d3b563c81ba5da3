"""Quality of the Fast Weight Layer head: the same backbone trained for the same wall-clock budget with
and without the FWL, compared on held-out bits per character.

    python benchmarks/quality/fwl_quality.py --minutes 2.5 --threads 1 [--variants base fwl tto] [--runs runs/fwl_quality] [--data NAME]
    python benchmarks/quality/fwl_quality.py --steps 200 --variants base fwl --name fwl_quality_equal_steps

Variants (each trained with ``fastweights.loops.train.train`` from its preset, ``train.max_minutes`` =
``--minutes`` of CPU time (``train.budget_clock = "cpu"``), ``train.threads`` = ``--threads``, everything else
as the preset; the corpus is ``--data``, a registered name, default ``tinyshakespeare``, the presets' own):

- ``base``: ``configs/shakespeare-char.toml`` (linear head tied to the embedding);
- ``fwl``: ``configs/shakespeare-char-fwl.toml`` (same backbone, ``head = "fwl"``, second-order training);
- ``tto``: the FWL preset with ``test_time_only = true``: the same head trained with the slow loss (the
  same extra slow capacity, no meta-learning), then one global step size tuned on the validation split
  (the paper's Table 2 "test-time only" ablation). Its step-0 row is the slow head alone;
- ``fwl-carry``: the FWL preset trained with ``train.carry_state = true`` (each batch row continues its
  lane of the text, the state carried and detached): the running update and its segment decays then
  train across windows, as they are used when a long text is streamed.

Metrics per variant: ``val_bits_window`` (the trainer's validation loss: independent windows of
``seq_len`` tokens, ``train.eval_tokens`` of them) and ``test_bits_stream`` (the test split scored as
``fastweights eval`` does: one stream, context ``seq_len``, stride ``seq_len // 2``, state carried;
``--eval-chars`` limits it to the split's first characters). The variants train at the same time, one
process each (``--threads`` threads apiece), so the load of a shared machine hits all of them alike;
``--sequential`` runs them one after another instead. Steps and tokens/s are recorded with the results.

Writes ``benchmarks/results/fwl_quality.json`` (or ``--name``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag

from fastweights.models.loading import load_checkpoint
from fastweights.core.config import make_config
from fastweights.data import load_corpus, split_corpus
from fastweights.loops.evaluate import evaluate_documents
from fastweights.layers.fwl import tune_test_time_step_size
from fastweights.loops.train import prepare_data, train

VARIANTS = {
    "base": ("shakespeare-char", []),
    "fwl": ("shakespeare-char-fwl", []),
    "tto": ("shakespeare-char-fwl", ["model.options.fwl.test_time_only=true"]),
    "fwl-carry": ("shakespeare-char-fwl", ["train.carry_state=true"]),
}
TTO_GRID = [0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
DATA = "tinyshakespeare"  # the corpus of both presets (fastweights data list)


def test_texts(cfg, max_chars: int) -> list[str]:
    docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field)
    texts = [d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)["test"]]
    if max_chars:
        out, left = [], max_chars
        for t in texts:
            if left <= 0:
                break
            out.append(t[:left])
            left -= len(out[-1])
        texts = out
    return texts


def run_variant(name: str, a) -> dict:
    """Train one variant, reload its checkpoint and measure it (runs in its own process with --parallel)."""
    use_threads("benchmark", a.threads)
    preset, sets = VARIANTS[name]
    # a time budget counts this process's CPU seconds (train.budget_clock=cpu), never wall clock (issue 22)
    budget = ([f"train.max_steps={a.steps}", "train.max_minutes=0"] if a.steps
              else [f"train.max_minutes={a.minutes}", 'train.budget_clock="cpu"'])
    overrides = [f"data.corpus={a.data!r}", *sets, *budget, f"train.threads={a.threads}", "train.device=\"cpu\"", *a.set]
    cfg = make_config(preset, overrides)
    out_dir = Path(a.runs) / name
    t0 = time.time()
    load_before = os.getloadavg()[0]
    summary = train(cfg, out_dir, progress=False)
    model, tokenizer, _ = load_checkpoint(out_dir)
    rec = {"preset": preset, "overrides": overrides, "checkpoint": str(out_dir),
           "steps": summary["steps"], "train_seconds": summary["elapsed_s"],
           "train_tokens_per_s": summary["steps"] * cfg.train.batch_size * cfg.train.seq_len / summary["elapsed_s"],
           "load_average_1m_at_start": load_before, "parameters": summary["parameters"],
           "train_loss_bits": summary["train_loss"] / math.log(2), "val_bits_window": summary["val_bits_per_token"]}
    if name == "tto":
        data = prepare_data(cfg, out_dir, tokenizer, progress=False)
        n = min(len(data.val), cfg.train.eval_tokens + 1)
        val = torch.from_numpy(np.asarray(data.val.tokens[:n], dtype=np.int64))
        tuned = tune_test_time_step_size(model, val, cfg.train.seq_len, TTO_GRID)
        rec["tto_grid_val_bits_window"] = {str(k): v / math.log(2) for k, v in tuned["grid"].items()}
        rec["tto_step_size"] = tuned["best"]
        rec["val_bits_window_slow_head"] = tuned["grid"][0.0] / math.log(2)
        rec["val_bits_window"] = tuned["grid"][tuned["best"]] / math.log(2)
    texts = test_texts(cfg, a.eval_chars)
    res = evaluate_documents(model, tokenizer, texts, cfg.train.seq_len, progress=False)
    rec["test_bits_stream"] = res.metrics(tokenizer.name)["bits_per_char"]
    rec["test_chars_scored"] = res.chars
    rec["wall_seconds"] = time.time() - t0
    if hasattr(model.head, "step_sizes"):
        rec["fwl_step_sizes"] = {k: float(v.detach()) for k, v in model.head.step_sizes.items()}
        rec["fwl_decays"] = {k: float(g.detach()) for k, g in model.head.decays().items()}
    print(name, {k: rec[k] for k in ("steps", "val_bits_window", "test_bits_stream")}, flush=True)
    return rec


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for preset, overrides in VARIANTS.values() for s in probes.preset_probes(preset, overrides)]



def main():
    ap = ScriptParser()
    ap.add_argument("--minutes", type=float, default=2.5, help="training CPU-time budget per variant (minutes)")
    ap.add_argument("--steps", type=int, default=0,
                    help="train every variant for exactly this many steps instead (no time budget; the cosine "
                         "schedule then ends at this step)")
    benchmark_threads_flag(ap)
    ap.add_argument("--variants", nargs="+", default=["base", "fwl", "tto"], choices=list(VARIANTS))
    ap.add_argument("--sequential", action="store_true",
                    help="train the variants one after another (default: at the same time, one process each, so "
                         "that a shared machine's load hits all of them alike)")
    ap.add_argument("--runs", default="runs/fwl_quality", help="checkpoints go to RUNS/<variant>")
    ap.add_argument("--data", default=DATA, help=f"registered corpus every variant trains and is scored on "
                                                 f"(default {DATA}, the presets' corpus; fastweights data list)")
    ap.add_argument("--eval-chars", type=int, default=20000, help="characters of the test split to stream (0 = all)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra override applied to every variant (e.g. train.seed=1)")
    ap.add_argument("--name", default="fwl_quality")
    a = ap.parse_args()
    if a.sequential:
        runs = {name: run_variant(name, a) for name in a.variants}
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(len(a.variants), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {name: pool.submit(run_variant, name, a) for name in a.variants}
            runs = {name: f.result() for name, f in futures.items()}

    comparisons = {}
    if "base" in runs:
        for name in runs:
            if name != "base":
                comparisons[f"{name} - base"] = {
                    "val_bits_window": runs[name]["val_bits_window"] - runs["base"]["val_bits_window"],
                    "test_bits_stream": runs[name]["test_bits_stream"] - runs["base"]["test_bits_stream"]}
    how = ("variants trained one after another, so a variant trained under heavier load gets fewer steps"
           if a.sequential else "variants trained at the same time in separate processes, sharing the load")
    write_result(a.name, {
        "what": ("held-out bits/char after the same " + (f"number of steps ({a.steps})" if a.steps else
                 f"CPU-time training budget ({a.minutes} CPU-min)") + ": backbone with vs without the FWL head"),
        "note": (f"CPU machine shared with other engineers; {how} (see steps, train_tokens_per_s). "
                 "Negative differences mean the variant beats the base."),
        "config": vars(a), "runs": runs, "differences_bits": comparisons})


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
