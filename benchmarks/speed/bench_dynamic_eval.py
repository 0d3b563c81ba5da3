"""Speed of dynamic evaluation against static evaluation, measured in the same run.

    python benchmarks/speed/bench_dynamic_eval.py [--checkpoint DIR] [--data tinyshakespeare] [--tokens 4000] [--repeat 3]

On the demo model's shape (``shakespeare-char``: d 128, 4 layers; random weights unless a
checkpoint is given) and the text of ``--data`` (a registered corpus, default ``tinyshakespeare``,
split as the preset or the checkpoint splits its corpus), at batch 1 with 20-character segments and a
128-character context (the protocol of ``DynamicEvaluator``):

- static tokens/s (the same segments, no gradient) and full dynamic evaluation (rms-global-prior,
  every parameter adapted): target ratio >= 0.30 (one forward plus one backward per segment);
- sparse dynamic evaluation (a 64 x 64 matrix on the middle block's output);
- 8 documents evaluated together, each with its own weights (``evaluate_batch``: vmap over
  per-document deltas for full adaptation, an ordinary batch for sparse), against 8 sequential runs.

Each measurement is the median of ``--repeat`` runs, interleaved so that load changes on the
shared machine hit all of them alike. Writes benchmarks/results/bench_dynamic_eval.json.
"""

from __future__ import annotations

import inspect
import statistics
import sys
from pathlib import Path

import torch

from fastweights.evidence.result_files import repo_relative, write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.core.threads import use_threads
from fastweights.evidence.script_args import benchmark_threads_flag
from fastweights.evidence.timing import call_seconds

from fastweights.adapt.dynamic import DynamicEvaluator
from fastweights.adapt.sparse import SparseDynamicEvaluator, collect_sparse_grad_stats
from fastweights.adapt.grad_stats import collect_grad_stats
from fastweights.core.config import make_config
from fastweights.data import build_tokenizer, load_corpus, split_corpus, text_pieces
from fastweights.models.lm import LanguageModel


DATA = "tinyshakespeare"  # the corpus of the shakespeare-char preset and of the demo model (fastweights data list)


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    config = probes.preset_model_config("shakespeare-char")
    return [probes.probe("dynamic", config=config, rule="rms-global-prior")]



def main() -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="use this checkpoint's weights (default: random weights, demo shape)")
    ap.add_argument("--data", default=DATA, help=f"registered corpus the text comes from (default {DATA})")
    ap.add_argument("--tokens", type=int, default=4000, help="tokens of the single stream")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    benchmark_threads_flag(ap, note="; 0: torch's default")
    ap.add_argument("--segment-len", type=int, default=20)
    ap.add_argument("--sparse-units", type=int, default=64)
    ap.add_argument("--name", default="bench_dynamic_eval", help="result file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    if args.threads:
        use_threads("benchmark", args.threads)

    if args.checkpoint:
        from fastweights.models.loading import load_checkpoint

        model, tok, cfg = load_checkpoint(Path(args.checkpoint))
    else:
        cfg = make_config("shakespeare-char", [f"data.corpus={args.data!r}"])
        splits = split_corpus(load_corpus(cfg.data.corpus), cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
        tok = build_tokenizer("char", train_text=text_pieces(splits["train"]))
        cfg.model.vocab_size = tok.vocab_size
        torch.manual_seed(0)
        model = LanguageModel(cfg.model)
    model.eval()
    splits = split_corpus(load_corpus(args.data), cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)
    train_ids = torch.as_tensor(tok.encode(splits["train"][0].text[:200000]))
    test_ids = torch.as_tensor(tok.encode("".join(d.text for d in splits["test"])))
    stream = test_ids[: args.tokens]
    docs = [test_ids[args.tokens + i * args.doc_tokens : args.tokens + (i + 1) * args.doc_tokens] for i in range(args.docs)]
    seg, context = args.segment_len, cfg.train.seq_len
    layer = cfg.model.n_layers // 2
    stats = collect_grad_stats(model, train_ids, batch_size=100, seq_len=seg, max_batches=5, context=context)
    sstats = collect_sparse_grad_stats(model, train_ids, layer, args.sparse_units, batch_size=100, seq_len=seg,
                                       max_batches=5, context=context)
    # the learning rate does not change the cost; a small one keeps the numbers well-behaved
    full = DynamicEvaluator(model, "rms-global-prior", lr=1e-5, decay=0.008, segment_len=seg, context=context,
                            grad_stats=stats)
    sparse = SparseDynamicEvaluator(model, "rms-global-prior", lr=1e-3, decay=0.008, segment_len=seg, context=context,
                                    layer=layer, units=args.sparse_units, grad_stats=sstats)

    runs: dict[str, list[float]] = {}

    def add(name, fn):
        (seconds,) = call_seconds(fn)
        runs.setdefault(name, []).append(seconds)

    batched_error = None
    for _ in range(args.repeat):
        add("static", lambda: full.static(stream, keep_token_losses=False))
        add("dynamic_full", lambda: full.evaluate(stream, keep_token_losses=False))
        add("dynamic_sparse", lambda: sparse.evaluate(stream, keep_token_losses=False))
        add("sparse_sequential_8", lambda: [sparse.evaluate(d, keep_token_losses=False) for d in docs])
        add("sparse_batched_8", lambda: sparse.evaluate_batch(docs))
        add("full_sequential_8", lambda: [full.evaluate(d, keep_token_losses=False) for d in docs])
        if batched_error is None:
            try:
                add("full_batched_8", lambda: full.evaluate_batch(docs))
            except RuntimeError as e:  # a model whose autograd.Functions do not support functorch yet
                batched_error = str(e).splitlines()[0]
    t = {k: statistics.median(v) for k, v in runs.items()}
    n = stream.numel() - 1
    nd = sum(d.numel() - 1 for d in docs)
    tps = {"static": n / t["static"], "dynamic_full": n / t["dynamic_full"], "dynamic_sparse": n / t["dynamic_sparse"]}
    import fastweights.layers.common as common

    payload = {
        "note": "2-core CPU shared with other engineers; ratios are from the same run (interleaved repeats, medians)",
        "config": {"weights": args.checkpoint or "random (demo shape)", "data": args.data, "d_model": cfg.model.d_model,
                   "layers": cfg.model.n_layers, "parameters": model.num_parameters(), "segment_len": seg,
                   "context": context, "stream_tokens": n, "docs": args.docs, "doc_tokens": args.doc_tokens,
                   "repeat": args.repeat, "sparse_units": args.sparse_units, "sparse_layer": layer,
                   "rule": "rms-global-prior",
                   "functorch_ready_model": bool(getattr(common._RMSNorm, "generate_vmap_rule", False)),
                   "layers_common_source": repo_relative(inspect.getsourcefile(common._RMSNorm))},
        "seconds_median": t, "seconds_all": runs,
        "tokens_per_s": tps,
        "ratio_dynamic_over_static": tps["dynamic_full"] / tps["static"],
        "target_ratio_dynamic_over_static": 0.30,
        "ratio_sparse_over_static": tps["dynamic_sparse"] / tps["static"],
        "batched_8_docs": {
            "sparse_speedup_batched_over_sequential": t["sparse_sequential_8"] / t["sparse_batched_8"],
            "sparse_tokens_per_s": {"sequential": nd / t["sparse_sequential_8"], "batched": nd / t["sparse_batched_8"]},
            "full_tokens_per_s_sequential": nd / t["full_sequential_8"],
        },
    }
    if "full_batched_8" in t:
        payload["batched_8_docs"]["full_speedup_batched_over_sequential"] = t["full_sequential_8"] / t["full_batched_8"]
        payload["batched_8_docs"]["full_tokens_per_s_batched"] = nd / t["full_batched_8"]
    else:
        payload["batched_8_docs"]["full_batched_error"] = batched_error
    write_result(args.name, payload)
    print(f"static {tps['static']:.0f} tok/s, dynamic {tps['dynamic_full']:.0f} tok/s "
          f"(ratio {payload['ratio_dynamic_over_static']:.2f}), sparse ratio {payload['ratio_sparse_over_static']:.2f}; "
          f"8 docs batched vs sequential: {payload['batched_8_docs']}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
